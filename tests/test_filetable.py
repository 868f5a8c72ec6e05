"""Shard file tables: lookups, listings, storage, staleness, forged tables; `atlasfs index`."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.filetable import DIR, FILE, UNREADABLE, FileTable, Limits
from atlasfs.tablestore import BESIDE_DATASET
from fusemount import atlasfs, mounted

ROWS = [("b.txt", FILE, 3, 0, 1, 0), ("a/x.cls", FILE, 1, 0, 0, 0), ("a.cls", FILE, 2, 1, 0, 0),
        ("a/y/z.jpg", FILE, 5, 1, 1, 1), ("a-b.txt", FILE, 4, 2, 0, 0), ("ü.txt", FILE, 1, 2, 1, 0),
        ("000007.unreadable", UNREADABLE, 0, 3, 1, 0)]
KEY = {"layout": 1, "files": {"data.bin": [10, 20]}}
LIMITS = Limits(blocks=4, block_size=2)


def test_lookup_and_byte_ordered_listings() -> None:
    table = FileTable.build(ROWS)
    assert [name for name, _ in table.children("")] == ["000007.unreadable", "a", "a-b.txt", "a.cls", "b.txt", "ü.txt"]
    assert [name for name, _ in table.children("a")] == ["x.cls", "y"]
    assert [name for name, _ in table.children("a/y")] == ["z.jpg"]
    row = table.row(table.find("a/y/z.jpg"))
    assert (row.kind, row.size, row.block, row.pos, row.file) == (FILE, 5, 1, 1, 1)
    assert table.row(table.find("a/y")).kind == DIR
    assert table.find("a/nope") is None and table.find("") is None
    assert len(FileTable.build([])) == 0 and list(FileTable.build([]).children("")) == []


def test_save_and_load(tmp_path: Path) -> None:
    table = FileTable.build(ROWS)
    table.save(str(tmp_path / "t"), KEY)
    loaded = FileTable.load(str(tmp_path / "t"), KEY, LIMITS)
    assert loaded is not None
    assert [table.row(i) for i in range(len(table))] == [loaded.row(i) for i in range(len(loaded))]
    assert FileTable.load(str(tmp_path / "t"), {**KEY, "layout": 2}, LIMITS) is None  # stale
    assert FileTable.load(str(tmp_path / "missing"), KEY, LIMITS) is None
    assert FileTable.load(str(tmp_path / "t"), KEY, Limits(blocks=1, block_size=2)) is None  # out of range


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
    forged = FileTable(b"".join(r[0].encode() for r in rows), np.array([0, len(rows[0][0].encode())], dtype=np.uint64),
                       {"kind": np.array([r[1] for r in rows], np.uint8), "size": np.array([1], np.uint64),
                        "block": np.zeros(1, np.uint32), "pos": np.zeros(1, np.uint32), "file": np.zeros(1, np.uint16)})
    forged.save(str(tmp_path / "t"), KEY)
    assert FileTable.load(str(tmp_path / "t"), KEY, LIMITS) is None
    table.save(str(tmp_path / "ok"), KEY)
    data = (tmp_path / "ok").read_bytes()
    for damaged in (data[:-1], data + b"x", b"garbage", data[:20]):
        (tmp_path / "d").write_bytes(damaged)
        assert FileTable.load(str(tmp_path / "d"), KEY, LIMITS) is None


def _dataset(path: Path) -> Path:
    with AtlasWriter(path, shard_size=20, block_size=4, compression_strategy=1) as w:
        w.add_examples({"__key__": f"k/{i:03d}", "txt": f"t{i}", "cls": i} for i in range(60))
    return path


def test_second_mount_lists_from_the_stored_table_without_decoding(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds")
    with mounted(dataset) as mnt:
        first = sorted(os.listdir(mnt / "1" / "k"))
    assert sorted(p.name for p in (dataset / BESIDE_DATASET).iterdir()) == ["1.table"]  # only shard 1 was looked at
    # Damage block 0 of shard 1 without changing its size or mtime: the stored table still
    # applies, so the listing must come out whole (nothing decoded), and only reads fail.
    data = dataset / "1" / "data.bin"
    st = data.stat()
    raw = bytearray(data.read_bytes())
    raw[20:40] = bytes(20)
    data.write_bytes(bytes(raw))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    with mounted(dataset) as mnt:
        assert sorted(os.listdir(mnt / "1" / "k")) == first
        with pytest.raises(OSError):
            (mnt / "1" / "k" / "020.txt").read_bytes()
        assert (mnt / "1" / "k" / "039.txt").read_bytes() == b"t39"
    # A real change (new mtime) makes the table stale: rebuilt, the damage now shows in names.
    os.utime(data)
    with mounted(dataset) as mnt:
        names = os.listdir(mnt / "1")
        assert "000020.unreadable" in names


def test_index_command_builds_tables_ahead_and_respects_read_only_datasets(tmp_path: Path) -> None:
    dataset = _dataset(tmp_path / "ds")
    result = atlasfs("index", str(dataset))
    assert result.returncode == 0, result.stderr
    assert (dataset / BESIDE_DATASET / "2.table").exists()
    assert AtlasDataset(dataset).shards[0].name == "0"  # the hidden folder is not a shard
    readonly = _dataset(tmp_path / "ro")
    cache = tmp_path / "cache"
    os.chmod(readonly, 0o555)
    try:
        result = atlasfs("index", str(readonly), env={**os.environ, "XDG_CACHE_HOME": str(cache)})
        assert result.returncode == 0, result.stderr
        assert not (readonly / BESIDE_DATASET).exists()
        assert len(list(cache.glob("atlasfs/*/*.table"))) == 3
        assert str(cache) in result.stdout
    finally:
        os.chmod(readonly, 0o755)
