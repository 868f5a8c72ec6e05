import sys
from pathlib import Path

# The tests import their helpers by name (``import helpers``): tests/support/ holds them, and
# tests/contract/ the contract suite's (formatfixtures.py is shared with the formats' own
# tests). Without __init__.py files pytest imports each test file by its basename, so
# basenames are unique across the folders.
_TESTS = Path(__file__).resolve().parent
for _folder in (_TESTS / "support", _TESTS / "contract"):
    sys.path.insert(0, str(_folder))

import atexit
import os
import shutil
import tempfile

# Under scripts/test-sanitized.sh pytest runs with the sanitizer runtimes preloaded: the
# programs the tests run must not inherit them (dd aborts under ASan); the mount daemons get
# them back from tests/support/fusemount.py.
if os.environ.get("ATLASFS_TEST_SANITIZED") and "LD_PRELOAD" in os.environ:
    os.environ["ATLASFS_TEST_DAEMON_PRELOAD"] = os.environ.pop("LD_PRELOAD")

# Mounts store shard file tables under the user's cache folder when the dataset is
# read-only (the shared fixtures): keep those out of the real home directory.
if "XDG_CACHE_HOME" not in os.environ:
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="atlasfs-test-cache-")
    atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], True)

# Background mounts with no syslog (the usual case in tests) log to the user's state folder.
if "XDG_STATE_HOME" not in os.environ:
    os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="atlasfs-test-state-")
    atexit.register(shutil.rmtree, os.environ["XDG_STATE_HOME"], True)


import pytest  # noqa: E402


@pytest.fixture(scope="module")
def ray_address() -> str:
    """One local Ray cluster for a test module (``ray.init(num_cpus=2)``), shut down at its
    end; its address, for ``--ray ADDRESS``. Not one for the session: a driver left running
    in the pytest process for the tests after it made the storage tests' in-process TCP
    proxies miss their 2-3 s deadlines in CI. In CI a test that cannot start Ray
    fails; elsewhere it is skipped when Ray is not installed."""
    try:
        import ray
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail("Ray is not installed (CI installs it with the test extra)")
        pytest.skip("Ray is not installed: pip install 'atlasfs[ray]'")
    # "local": a cluster of its own, even while another runs here (a test's Cluster, `ray start`)
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


#: Markers given by folder: every test under tests/mount/ mounts a real FUSE filesystem, and
#: tests/loaders/ holds the real loaders' tests (make test-loaders selects them by marker).
_FOLDER_MARKS = {"mount": ("fuse",), "loaders": ("loaders", "fuse")}


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by the folder it is in (_FOLDER_MARKS)."""
    for item in items:
        parts = item.path.relative_to(_TESTS).parts if item.path.is_relative_to(_TESTS) else ()
        for name in _FOLDER_MARKS.get(parts[0] if len(parts) > 1 else "", ()):
            item.add_marker(name)
