import sys

from atlasfs.commands.cli import main

sys.exit(main())
