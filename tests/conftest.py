import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import atexit
import os
import shutil
import tempfile

# Mounts store shard file tables under the user's cache folder when the dataset is
# read-only (the shared fixtures): keep those out of the real home directory.
if "XDG_CACHE_HOME" not in os.environ:
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="atlasfs-test-cache-")
    atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

# Background mounts with no syslog (the usual case in tests) log to the user's state folder.
if "XDG_STATE_HOME" not in os.environ:
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="atlasfs-test-state-")
    atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], True)
