import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import os
import tempfile

# Mounts store shard file tables under the user's cache folder when the dataset is
# read-only (the shared fixtures): keep those out of the real home directory.
os.environ.setdefault("XDG_CACHE_HOME", tempfile.mkdtemp(prefix="atlasfs-test-cache-"))
