"""The adapter's own rules, called directly (the mount tests drive it through the kernel)."""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.fuse.adapter import KEPT_THREAD_STATES, FuseAdapter
from atlasfs.tree.blocktree import BlockTree


@pytest.fixture()
def adapter(tmp_path: Path) -> FuseAdapter:
    with AtlasWriter(tmp_path / "ds", shard_size=4, block_size=2) as writer:
        for i in range(8):
            writer.add_example({"txt": f"example {i}"})
    return FuseAdapter(BlockTree(AtlasDataset(tmp_path / "ds")))


def test_exceptions_become_negative_errnos(adapter: FuseAdapter) -> None:
    def missing(path: bytes) -> int:
        raise FileNotFoundError(errno.ENOENT, "no")

    def broken(path: bytes) -> int:
        raise ValueError("a bug")

    def no_errno(path: bytes) -> int:
        raise OSError("no errno")

    assert adapter._guard("getattr", missing)(b"/x") == -errno.ENOENT
    assert adapter._guard("getattr", broken)(b"/x") == -errno.EIO
    assert adapter._guard("getattr", no_errno)(b"/x") == -errno.EIO
    assert adapter._guard("read", lambda *a: 7)(b"/x") == 7


def test_paths_that_are_not_utf8_are_not_found(adapter: FuseAdapter) -> None:
    guarded = adapter._guard("getattr", adapter.getattr)
    assert guarded(b"/0/\xff.txt", None, None) == -errno.ENOENT
    assert guarded(b"/\xc3(", None, None) == -errno.ENOENT


def test_kept_thread_states_are_bounded(adapter: FuseAdapter) -> None:
    guarded = adapter._guard("getattr", lambda path: 0)
    threads = [threading.Thread(target=guarded, args=(b"/",)) for _ in range(KEPT_THREAD_STATES + 20)]
    for thread in threads:
        thread.start()
        thread.join()
    assert adapter._kept == KEPT_THREAD_STATES
