"""Stored tables through real mounts: two first mounts at once serve right and leave one valid
table (the store alone: tests/unit/tree/test_tablestore.py)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from atlasfs import AtlasDataset
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.store import TableStore, cached_tables
from fusemount import mounted
from tabledata import cache, shards_dataset


def test_two_first_mounts_at_once_serve_right_and_leave_one_valid_table(tmp_path: Path, cache: Path) -> None:
    dataset = shards_dataset(tmp_path / "ds", shards=6)
    env = {"XDG_CACHE_HOME": str(cache.parent.parent)}
    before = sorted(os.walk(dataset))
    with mounted(dataset, env=env) as one, mounted(dataset, env=env) as two:
        results: dict[Path, dict[str, bytes]] = {}

        def read_all(mnt: Path) -> None:
            results[mnt] = {f"{shard}/{name}": (mnt / shard / name).read_bytes()
                            for shard in sorted(os.listdir(mnt)) for name in os.listdir(mnt / shard)}

        threads = [threading.Thread(target=read_all, args=(mnt,)) for mnt in (one, two)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert results[one] == results[two]
    assert len(results[one]) == 120 * 2
    assert all(results[one][f"{i // 20}/s{i:03d}.txt"] == f"t{i}".encode() for i in range(120))
    assert sorted(os.walk(dataset)) == before
    tables = sorted(Path(t.path).name for t in cached_tables())
    assert tables == [f"{s}.table" for s in range(6)]
    # whole and valid: a tree lists every shard from them without decoding
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    for shard in range(6):
        tree.names(f"/{shard}")
    assert tree.cache.misses == 0
