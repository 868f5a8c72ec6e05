"""Where file tables are stored: the user's cache (bounded), --index-dir, beside the dataset
only through `atlasfs index`; stale or corrupt tables are rebuilt; concurrent mounts."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from atlasfs import AtlasDataset
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.store import BESIDE_DATASET, TableStore, cache_folder, cached_tables
from fusemount import atlasfs
from tabledata import cache, shards_dataset


def _listing_and_decodes(dataset: Path, store: TableStore) -> tuple[list[str], int]:
    tree = BlockTree(AtlasDataset(dataset), store=store)
    names = [name for shard in ("0", "1", "2") for name, _, _ in tree.names(f"/{shard}")]
    return names, tree.cache.misses


def test_tables_go_to_the_user_cache_and_a_second_tree_decodes_nothing(tmp_path: Path, cache: Path) -> None:
    dataset = shards_dataset(tmp_path / "ds")
    names, decoded = _listing_and_decodes(dataset, TableStore(str(dataset)))
    assert decoded == 15
    folder = Path(cache_folder(str(dataset)))
    assert folder.parent == cache
    assert sorted(p.name for p in folder.glob("*.table")) == ["0.table", "1.table", "2.table"]
    assert not (dataset / BESIDE_DATASET).exists()
    assert {t.dataset for t in cached_tables()} == {str(dataset.resolve())}
    assert _listing_and_decodes(dataset, TableStore(str(dataset))) == (names, 0)


def test_a_corrupt_stored_table_is_ignored_with_one_log_line_and_rebuilt(
        tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    dataset = shards_dataset(tmp_path / "ds")
    names, _ = _listing_and_decodes(dataset, TableStore(str(dataset)))
    table = Path(cache_folder(str(dataset))) / "1.table"
    good = table.read_bytes()
    table.write_bytes(good[:40] + b"\xff" * 64 + good[104:])
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        assert _listing_and_decodes(dataset, TableStore(str(dataset))) == (names, 5)  # shard 1 decoded again
    lines = [r.getMessage() for r in caplog.records if "ignoring the stored file table" in r.getMessage()]
    assert len(lines) == 1 and str(table) in lines[0] and "building it again" in lines[0]
    assert table.read_bytes() == good  # rebuilt and stored again
    assert _listing_and_decodes(dataset, TableStore(str(dataset))) == (names, 0)


def test_index_tables_beside_the_dataset_and_index_dirs_are_read(tmp_path: Path, cache: Path) -> None:
    dataset = shards_dataset(tmp_path / "ds")
    names, _ = _listing_and_decodes(dataset, TableStore(str(dataset), beside=True))  # what atlasfs index does
    assert sorted(p.name for p in (dataset / BESIDE_DATASET).glob("*.table")) == ["0.table", "1.table", "2.table"]
    assert not cache.exists()
    assert _listing_and_decodes(dataset, TableStore(str(dataset))) == (names, 0)  # a mount's store reads them
    index = tmp_path / "index"
    other = shards_dataset(tmp_path / "other")
    assert _listing_and_decodes(other, TableStore(str(other), index_dir=str(index)))[1] == 15
    assert sorted(p.name for p in index.iterdir()) == ["0.table", "1.table", "2.table"]
    assert not cache.exists() and not (other / BESIDE_DATASET).exists()
    assert _listing_and_decodes(other, TableStore(str(other), index_dir=str(index)))[1] == 0


def test_index_after_a_mount_stores_beside_the_dataset_although_the_cache_holds_the_tables(
        tmp_path: Path, cache: Path) -> None:
    dataset = shards_dataset(tmp_path / "ds")
    _listing_and_decodes(dataset, TableStore(str(dataset)))  # a mount filled the user's cache
    result = atlasfs("index", str(dataset), env={**os.environ, "XDG_CACHE_HOME": str(cache.parent.parent)})
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (dataset / BESIDE_DATASET).glob("*.table")) == ["0.table", "1.table", "2.table"]


def test_tables_for_every_user_are_0644_and_the_users_cache_stays_private(tmp_path: Path, cache: Path) -> None:
    dataset = shards_dataset(tmp_path / "ds")
    _listing_and_decodes(dataset, TableStore(str(dataset)))  # a mount: the user's cache
    assert {p.stat().st_mode & 0o777 for p in cache.rglob("*.table")} == {0o600}
    env = {**os.environ, "XDG_CACHE_HOME": str(cache.parent.parent)}
    result = subprocess.run([sys.executable, "-m", "atlasfs", "index", str(dataset)], env=env, umask=0o077,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    beside = dataset / BESIDE_DATASET
    assert beside.stat().st_mode & 0o777 == 0o755
    tables = sorted(beside.iterdir())
    assert {p.stat().st_mode & 0o777 for p in tables} == {0o644}
    # tables an older atlasfs stored 0600 become readable when `atlasfs index` finds them up to date
    for table in tables:
        table.chmod(0o600)
    before = {p: p.read_bytes() for p in tables}
    assert atlasfs("index", str(dataset), env=env).returncode == 0
    assert {p.stat().st_mode & 0o777 for p in tables} == {0o644}
    assert {p: p.read_bytes() for p in tables} == before


def test_the_cache_is_bounded_least_recently_used_first(tmp_path: Path, cache: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    first = shards_dataset(tmp_path / "a")
    _listing_and_decodes(first, TableStore(str(first)))
    one_dataset = sum(t.bytes for t in cached_tables())
    monkeypatch.setenv("ATLASFS_TABLE_CACHE_SIZE", str(one_dataset + one_dataset // 2))
    second = shards_dataset(tmp_path / "b")
    _listing_and_decodes(second, TableStore(str(second)))
    tables = cached_tables()
    assert sum(t.bytes for t in tables) <= one_dataset + one_dataset // 2
    # the newest dataset's tables all stayed; the oldest of the first went
    assert [Path(t.path).name for t in tables if t.dataset == str(second.resolve())] == ["0.table", "1.table", "2.table"]
    assert len([t for t in tables if t.dataset == str(first.resolve())]) < 3
    cleared = atlasfs("cache", "--clear", str(second), env=dict(os.environ))
    assert cleared.returncode == 0, cleared.stderr
    assert all(t.dataset != str(second.resolve()) for t in cached_tables())
