"""Shard file tables: lookups, listings, storage, staleness, forged tables; `atlasfs index`."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from atlasfs import AtlasDataset
from atlasfs.tree.table.filetable import FileTable, Limits, TableError
from atlasfs.tree.table.layout import DIR, FILE, UNREADABLE
from atlasfs.tree.table.store import BESIDE_DATASET
from fusemount import atlasfs
from tabledata import keyed_dataset


#: Files in example order: the keys are unsorted and the folder "a" comes back after "b.txt".
ROWS = [("b.txt", FILE, 3, 0, 0, 0), ("a/x.cls", FILE, 1, 0, 1, 0), ("a.cls", FILE, 2, 1, 0, 0),
        ("a-b.txt", FILE, 4, 1, 1, 0), ("a/y/z.jpg", FILE, 5, 2, 0, 0), ("ü.txt", FILE, 1, 2, 1, 0),
        ("a/w.cls", FILE, 1, 3, 0, 0), ("000007.unreadable", UNREADABLE, 0, 3, 1, 0)]


KEY = {"layout": 1, "files": {"data.bin": [10, 20]}}


LIMITS = Limits(blocks=4, block_size=2)


@pytest.mark.parametrize("fixed_width", [True, False])
def test_the_path_order_is_the_order_of_the_path_bytes(fixed_width: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """by_path (what proves a stored table's paths unique) sorts the UTF-8 bytes of the paths,
    whether sorted as fixed-width strings or, past their bound, by Python."""
    if not fixed_width:
        monkeypatch.setattr("atlasfs.tree.table.builder._SORT_BYTES", 0)
    rng = np.random.default_rng(5)
    alphabet = ["a", "b", "ab", "é", "z", "0", "-", ".", "~", "ü", "\u4e2d"]
    names = {"".join(rng.choice(alphabet, size=int(rng.integers(1, 6)))) + f".{i % 3}" for i in range(3000)}
    rows = [(name, FILE, 1, i // 100, i % 100, 0) for i, name in enumerate(sorted(names, key=hash))]
    table = FileTable.build(rows)
    paths = [table.entry_path(i).encode() for i in range(len(table))]
    assert [paths[i] for i in table.by_path.tolist()] == sorted(paths)
    assert all(table.find(row[0]) == i for i, row in enumerate(rows))


def test_listings_follow_example_order_and_lookups_find_every_path() -> None:
    table = FileTable.build(ROWS)
    # a folder stands where its first example is, and holds its later examples too
    assert [name for name, _ in table.children("")] == ["b.txt", "a", "a.cls", "a-b.txt", "ü.txt", "000007.unreadable"]
    assert [name for name, _ in table.children("a")] == ["x.cls", "y", "w.cls"]
    assert [name for name, _ in table.children("a/y")] == ["z.jpg"]
    assert table.children("a/x.cls") == [] and table.children("nope") == []
    row = table.row(table.find("a/y/z.jpg"))
    assert (row.kind, row.size, row.block, row.pos, row.file) == (FILE, 5, 2, 0, 0)
    assert table.row(table.find("a/y")).kind == DIR
    for i in range(len(table)):
        assert table.find(table.row(i).path) == i
    assert table.find("a/nope") is None and table.find("") is None and table.find("zz") is None
    # export order: every file by example, whatever folder it is in
    assert [table.row(i).path for i in table.example_order()] == [r[0] for r in ROWS]
    assert len(FileTable.build([])) == 0 and list(FileTable.build([]).children("")) == []


def test_a_flat_table_keeps_example_order() -> None:
    rows = [(f"{key}.{ext}", FILE, 1, i, 0, j) for i, key in enumerate(["zeta", "alpha", "mid", "beta"])
            for j, ext in enumerate(["cls", "txt"])]
    table = FileTable.build(rows)
    assert [name for name, _ in table.children("")] == [r[0] for r in rows]
    assert table.example_order() == list(range(len(rows)))
    assert table.find("beta.txt") == 7


def test_save_and_load(tmp_path: Path) -> None:
    table = FileTable.build(ROWS)
    table.save(str(tmp_path / "t"), KEY)
    loaded = FileTable.load(str(tmp_path / "t"), KEY, LIMITS)
    assert loaded is not None
    assert [table.row(i) for i in range(len(table))] == [loaded.row(i) for i in range(len(loaded))]
    assert [name for name, _ in loaded.children("a")] == ["x.cls", "y", "w.cls"]
    assert FileTable.load(str(tmp_path / "missing"), KEY, LIMITS) is None
    with pytest.raises(TableError, match="stale or foreign"):
        FileTable.load(str(tmp_path / "t"), {**KEY, "layout": 2}, LIMITS)
    with pytest.raises(TableError, match="outside the shard"):
        FileTable.load(str(tmp_path / "t"), KEY, Limits(blocks=1, block_size=2))


def _forged(paths: list[str], kinds: list[int], by_path: list[int] | None = None) -> FileTable:
    encoded = [p.encode() for p in paths]
    offsets = np.cumsum([0] + [len(p) for p in encoded]).astype(np.uint64)
    n = len(paths)
    order = by_path if by_path is not None else sorted(range(n), key=encoded.__getitem__)
    return FileTable(b"".join(encoded), offsets,
                     {"kind": np.array(kinds, np.uint8), "size": np.ones(n, np.uint64), "block": np.zeros(n, np.uint32),
                      "pos": np.zeros(n, np.uint32), "file": np.zeros(n, np.uint16),
                      "by_path": np.array(order, np.uint32)})


@pytest.mark.parametrize("paths, kinds, by_path", [
    (["a", "b/c", "a/d"], [DIR, FILE, FILE], None),  # a/d is not under its folder's run
    (["a/d"], [FILE], None),  # no folder entry for a
    (["a", "a/d"], [FILE, FILE], None),  # the parent is a file
    (["b", "a"], [FILE, FILE], [0, 1]),  # path order not sorted
    (["b", "a"], [FILE, FILE], [1, 1]),  # not a permutation
    (["a", "a"], [FILE, FILE], None),  # repeated
])
def test_forged_orders_are_refused(tmp_path: Path, paths: list[str], kinds: list[int], by_path: list[int] | None) -> None:
    _forged(paths, kinds, by_path).save(str(tmp_path / "t"), KEY)
    with pytest.raises(TableError):
        FileTable.load(str(tmp_path / "t"), KEY, LIMITS)


@pytest.mark.parametrize("rows", [
    [("../escape", FILE, 1, 0, 0, 0)],
    [("a/../../b", FILE, 1, 0, 0, 0)],
    [("/abs", FILE, 1, 0, 0, 0)],
    [("a//b", FILE, 1, 0, 0, 0)],
    [("nul\0", FILE, 1, 0, 0, 0)],
    [("x" * 300, FILE, 1, 0, 0, 0)],
    [("ok", 7, 1, 0, 0, 0)],
])
def test_forged_tables_are_refused(tmp_path: Path, rows: list) -> None:
    table = FileTable.build([("fine.txt", FILE, 1, 0, 0, 0)])
    _forged([rows[0][0]], [rows[0][1]]).save(str(tmp_path / "t"), KEY)
    with pytest.raises(TableError):
        FileTable.load(str(tmp_path / "t"), KEY, LIMITS)
    table.save(str(tmp_path / "ok"), KEY)
    data = (tmp_path / "ok").read_bytes()
    for damaged in (data[:-1], data + b"x", b"garbage", data[:20]):
        (tmp_path / "d").write_bytes(damaged)
        with pytest.raises(TableError):
            FileTable.load(str(tmp_path / "d"), KEY, LIMITS)


def test_index_command_writes_beside_the_dataset_or_to_an_index_dir(tmp_path: Path) -> None:
    dataset = keyed_dataset(tmp_path / "ds")
    result = atlasfs("index", str(dataset))
    assert result.returncode == 0, result.stderr
    tables = ["0.table", "1.table", "2.table"]  # and energon's index.sqlite of the tar view (docs/training.md)
    stored = sorted(p.name for p in (dataset / BESIDE_DATASET).iterdir())
    assert stored[:3] == tables and len(stored) == 4 and re.fullmatch(r"energon-[0-9a-f]{32}\.sqlite", stored[3])
    assert AtlasDataset(dataset).shards[0].name == "0"  # the hidden folder is not a shard
    other = keyed_dataset(tmp_path / "other")
    index = tmp_path / "index"
    result = atlasfs("index", str(other), "--index-dir", str(index))
    assert result.returncode == 0, result.stderr
    assert not (other / BESIDE_DATASET).exists()
    assert sorted(p.name for p in index.iterdir())[:3] == tables and len(list(index.iterdir())) == 4
    assert str(index) in result.stdout
    blocked = tmp_path / "file"
    blocked.write_text("")
    result = atlasfs("index", str(other), "--index-dir", str(blocked / "sub"))
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "--index-dir" in result.stderr


def test_a_table_is_sized_from_its_locators_without_decoding(tmp_path: Path) -> None:
    """``located_sizes`` is each entry's ``located_size`` at once, and sizing a table (what
    `atlasfs index` and the tar view's layout do) encodes only the files no locator sizes."""
    import random

    from atlasfs.tree.blocktree import BlockTree
    from atlasfs.tree.table.layout import INLINE, KEPT, UNKNOWN_SIZE
    from atlasfs import AtlasWriter

    rng = random.Random(5)
    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=64, block_size=16, compression_strategy=1) as writer:
        for i in range(64):  # runs (bin, txt; npy behind its header), inline (cls), kept (a json of
            values = 1500 if i == 3 else 20  # ~500 bytes), none (one json past 16 KiB, in block 0)
            writer.add_example({"bin": rng.randbytes(300), "txt": "y" * (i + 200), "cls": i,
                                "npy": np.arange(i + 100, dtype=np.int64),
                                "json": {"i": i, "v": [rng.random() for _ in range(values)]}})
    tree = BlockTree(AtlasDataset(dataset), cache_bytes=0)
    table = tree.table(0)
    rows = np.arange(len(table))
    located = table.located_sizes(rows)
    assert located.dtype == np.uint64
    assert [None if v == UNKNOWN_SIZE else int(v) for v in located] == [table.located_size(i) for i in rows]
    kinds = set(table.locators.prefix[table.locators.offset != 0xFFFFFFFF].tolist())
    assert {0, 1, INLINE, KEPT} <= kinds, kinds  # every kind of locator: runs without and with a prefix
    assert int(np.count_nonzero((located == UNKNOWN_SIZE) & (table.kind == FILE))) == 1  # the big json
    misses = tree.cache.misses
    sized = tree.table(0, sizes=True)
    reference = BlockTree(AtlasDataset(dataset))
    assert [(p, e.size) for p, e in tree.walk("/")] == [(p, e.size) for p, e in reference.walk("/")]
    assert not np.any(sized.size[sized.kind == FILE] == UNKNOWN_SIZE)
    assert tree.cache.misses - misses == 1  # block 0 decoded for its big json, no other
