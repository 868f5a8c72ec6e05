"""Stored file tables mapped in place (atlasfs/tree/table/ondisk.py): every bound a forged or
damaged file can break is found at load, the table is rebuilt with one log line, nothing
is read past a file's end; tables of other users are mapped from a private copy; at most
RESIDENT_TABLE_BYTES of tables stay mapped."""

from __future__ import annotations

import gc
import json
import logging
import mmap
import os
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table import checks
from atlasfs.tree.table.filetable import FileTable, Limits, TableError
from atlasfs.tree.table.layout import FILE, UNKNOWN_SIZE
from atlasfs.tree.table.store import TableStore, cache_folder

ROWS = [(f"{i:05d}.{ext}", FILE, 1 + i, i // 4, i % 4, j) for i in range(40) for j, ext in enumerate(("cls", "txt"))]
KEY = {"layout": 1, "files": {"data.bin": [10, 20]}}
LIMITS = Limits(blocks=10, block_size=4)


def _header(data: bytes) -> dict:
    length = int.from_bytes(data[8:12], "little")
    return json.loads(data[16:16 + length])


def _with_header(data: bytes, header: dict) -> bytes:
    """``data`` with another header, its checksum right (only its bounds can refuse it)."""
    length = int.from_bytes(data[8:12], "little")
    text = json.dumps(header).encode()
    assert len(text) <= length, "the forged header must fit the room of the old one"
    text = text.ljust(length)
    return data[:12] + zlib.crc32(text).to_bytes(4, "little") + text + data[16 + length:]


def _section(data: bytes, name: str, change: Callable[[np.ndarray], None], dtype: str) -> bytes:
    """``data`` with section ``name`` changed in place, its checksum right."""
    header = _header(data)
    for section in header["sections"]:
        if section[0] == name:
            _, offset, count, _ = section
            array = np.frombuffer(data, dtype=dtype, count=count // np.dtype(dtype).itemsize, offset=offset).copy()
            change(array)
            raw = array.tobytes()
            section[3] = zlib.crc32(raw)
            data = data[:offset] + raw + data[offset + count:]
    return _with_header(data, header)


def _move(name: str, by: int) -> Callable[[dict], None]:
    def change(header: dict) -> None:
        for section in header["sections"]:
            if section[0] == name:
                section[1] += by
    return change


def _resize(name: str, by: int) -> Callable[[dict], None]:
    def change(header: dict) -> None:
        for section in header["sections"]:
            if section[0] == name:
                section[2] += by
    return change


def _swap_offsets(a: np.ndarray) -> None:
    a[3], a[4] = a[4], a[3]


def _set(index: int, value: int) -> Callable[[np.ndarray], None]:
    def change(a: np.ndarray) -> None:
        a[index] = value
    return change


#: Forgeries: name -> (what it does to the file's bytes, what the refusal says).
FORGERIES: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "truncated by one byte": (lambda d: d[:-1], "out of bounds|where its header means"),
    "truncated to half": (lambda d: d[:len(d) // 2], "out of bounds|where its header means"),
    "truncated into its header": (lambda d: d[:30], "header"),
    "one byte more": (lambda d: d + b"x", "where its header means"),
    "a header checksum that does not match": (lambda d: d[:20] + b"X" + d[21:], "header's checksum"),
    "a section checksum that does not match": (lambda d: d[:-20] + bytes([d[-20] ^ 1]) + d[-19:], "checksum"),
    "a count of entries that lies": (lambda d: _with_header(d, {**_header(d), "entries": 41}), "bytes for 41 entries"),
    "a huge count of entries": (lambda d: _with_header(d, {**_header(d), "entries": 2**40}), "entry count"),
    "a negative count": (lambda d: _with_header(d, {**_header(d), "entries": -1}), "entry count"),
    "a section past the end": (lambda d: _with_header(d, _changed(_header(d), _move("state", 1 << 20))),
                               "section state out of bounds"),
    "a section over the one before": (lambda d: _with_header(d, _changed(_header(d), _move("kind", -8))),
                                      "section kind out of bounds"),
    "a section misaligned": (lambda d: _with_header(d, _changed(_header(d), _move("size", 1))),
                             "section size out of bounds"),
    "a section of the wrong length": (lambda d: _with_header(d, _changed(_header(d), _resize("pos", -4))),
                                      "section pos of"),
    "a section missing": (lambda d: _with_header(d, {**_header(d), "sections": _header(d)["sections"][:-1]}),
                          "not the expected ones"),
    "name offsets out of order": (lambda d: _section(d, "offsets", _swap_offsets, "<u8"), "out of order"),
    "name offsets past the names": (lambda d: _section(d, "offsets", _set(-1, 10**6), "<u8"),
                                    "do not cover the names"),
    "a path order that is no permutation": (lambda d: _section(d, "by_path", _set(0, 1), "<u4"),
                                            "not a permutation"),
    "a lookup index pointing outside": (lambda d: _section(d, "hash_rows", _set(5, 80), "<u4"),
                                        "lookup index pointing outside"),
    "a lookup index pointing twice at one": (lambda d: _section(d, "hash_rows", _set(5, 6), "<u4"),
                                             "lookup index pointing outside the entries or twice"),
    "a lookup index out of order": (lambda d: _section(d, "hashes", lambda a: a.__setitem__(slice(None), a[::-1].copy()),
                                                       "<u8"), "lookup index out of order"),
    "a position outside the shard": (lambda d: _section(d, "block", _set(0, 99), "<u4"), "outside the shard"),
}


def _changed(header: dict, change: Callable[[dict], None]) -> dict:
    change(header)
    return header


def _stored(tmp_path: Path) -> tuple[Path, bytes]:
    table = FileTable.build(ROWS)
    path = tmp_path / "t.table"
    table.save(str(path), KEY)
    data = path.read_bytes()
    # the header has the room a forged one needs (a longer count, a moved offset)
    assert _header(data)["entries"] == 80
    return path, data


def test_a_loaded_table_is_the_file_mapped_and_answers_as_built(tmp_path: Path) -> None:
    path, _ = _stored(tmp_path)
    table = FileTable.build(ROWS)
    loaded = FileTable.load(str(path), KEY, LIMITS)
    assert loaded is not None and isinstance(loaded._names, mmap.mmap) and loaded.path == str(path)
    for column in ("kind", "size", "block", "pos", "file", "by_path"):  # views of the map, not copies
        assert not getattr(loaded, column).flags.owndata and not getattr(loaded, column).flags.writeable
    assert [loaded.row(i) for i in range(len(loaded))] == [table.row(i) for i in range(len(table))]
    assert all(loaded.find(row[0]) == table.find(row[0]) for row in ROWS)
    assert loaded.find("nope") is None and loaded.find("\udcff") is None
    assert loaded.mapped_bytes == path.stat().st_size == loaded.nbytes()


def test_an_unsized_table_keeps_only_its_size_column_in_memory(tmp_path: Path) -> None:
    rows = [(path, kind, UNKNOWN_SIZE if i % 2 else size, *rest) for i, (path, kind, size, *rest) in enumerate(ROWS)]
    FileTable.build(rows).save(str(tmp_path / "t"), KEY)
    loaded = FileTable.load(str(tmp_path / "t"), KEY, LIMITS)
    assert loaded is not None and loaded.size.flags.owndata and loaded.size.flags.writeable
    assert not loaded.block.flags.owndata
    assert loaded.nbytes() == loaded.mapped_bytes + 8 * len(loaded)


@pytest.mark.parametrize("forgery", FORGERIES)
def test_every_forged_or_damaged_bound_is_refused_at_load(tmp_path: Path, forgery: str) -> None:
    path, data = _stored(tmp_path)
    damage, why = FORGERIES[forgery]
    path.write_bytes(damage(data))
    with pytest.raises(TableError, match=why):
        FileTable.load(str(path), KEY, LIMITS)
    with pytest.raises(TableError, match=why):
        FileTable.from_bytes(path.read_bytes(), KEY, LIMITS)


def test_a_file_found_valid_is_mapped_again_without_a_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path, _ = _stored(tmp_path)
    assert FileTable.load(str(path), KEY, LIMITS) is not None
    monkeypatch.setattr(checks, "problem", lambda table, limits: pytest.fail("checked twice"))
    assert FileTable.load(str(path), KEY, LIMITS) is not None
    with pytest.raises(TableError, match="stale or foreign"):  # the header is always checked
        FileTable.load(str(path), {**KEY, "layout": 2}, LIMITS)


# -------------------------------------------------------------------- through a tree and its store


def _dataset(path: Path, shards: int = 4) -> Path:
    with AtlasWriter(path, shard_size=40, block_size=8, compression_strategy=1) as w:
        w.add_examples({"__key__": f"s{i:04d}", "txt": f"t{i}", "cls": i} for i in range(40 * shards))
    return path


def _every_file(tree: BlockTree) -> dict[str, tuple[int, bytes]]:
    found = {}
    for shard in tree.shard_folders():
        for name, _, _ in tree.names(f"/{shard}"):
            entry = tree.lookup(f"/{shard}/{name}")
            found[f"{shard}/{name}"] = (entry.size, tree.read(entry, 0, entry.size))
    return found


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg"


@pytest.mark.parametrize("forgery", ["truncated to half", "a count of entries that lies", "a section past the end",
                                     "name offsets past the names", "a lookup index pointing outside"])
def test_a_forged_table_in_the_cache_is_rebuilt_with_one_log_line(
        tmp_path: Path, cache: Path, caplog: pytest.LogCaptureFixture, forgery: str) -> None:
    dataset = _dataset(tmp_path / "ds")
    expected = _every_file(BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset))))
    stored = Path(cache_folder(str(dataset))) / "1.table"
    good = stored.read_bytes()
    stored.write_bytes(FORGERIES[forgery][0](good))
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
        assert _every_file(tree) == expected
    lines = [r.getMessage() for r in caplog.records if "ignoring the stored file table" in r.getMessage()]
    assert len(lines) == 1 and str(stored) in lines[0] and "building it again" in lines[0], lines
    assert stored.read_bytes() == good  # rebuilt (sized by the reads above) and stored again
    assert tree.cache.misses > 0


def test_another_users_table_is_mapped_from_a_copy_and_survives_truncation_in_place(
        tmp_path: Path, cache: Path) -> None:
    """A table another user owns may be truncated in place by them: it is copied into the
    user's cache and the copy mapped, so its owner's changes never reach the map (a map of
    the original would die of SIGBUS past the new end). The other user owns the dataset (a
    table of anyone else is not used at all: tests/unit/tree/test_table_trust.py)."""
    dataset = _dataset(tmp_path / "ds")
    index = tmp_path / "index"
    expected = _every_file(BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(index))))
    os.chown(dataset, 65534, 65534)
    for table in index.glob("*.table"):
        os.chown(table, 65534, 65534)
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(index)))
    mapped = [tree.table(s) for s in range(len(tree.shards))]
    copies = Path(cache_folder(str(dataset)))
    assert all(t.path is not None and Path(t.path).parent == copies for t in mapped)
    assert sorted(p.name for p in copies.glob("*.table")) == sorted(p.name for p in index.glob("*.table"))
    for table in index.glob("*.table"):
        with open(table, "r+b") as f:
            f.truncate(100)  # in place, as its owner could
    assert _every_file(tree) == expected  # no SIGBUS, nothing rebuilt
    assert tree.cache.misses == len(tree.shards) * 5  # the reads' blocks only (5 a shard)


def test_tables_past_the_resident_bound_are_let_go_and_mapped_again(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import atlasfs.tree.table.tables as tables

    dataset = _dataset(tmp_path / "ds", shards=6)
    expected = _every_file(BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset))))
    one = max(p.stat().st_size for p in Path(cache_folder(str(dataset))).glob("*.table"))
    monkeypatch.setattr(tables, "RESIDENT_TABLE_BYTES", 2 * one)
    monkeypatch.setattr(tables.Tables, "_build_table", lambda self, s: pytest.fail("a table was built again"))
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    assert _every_file(tree) == expected
    assert len(tree.tables.tables) == 2 and tree.tables.tables.bytes <= 2 * one
    assert _every_file(tree) == expected  # mapped again, every name and byte the same
    gc.collect()
    ours = _mapped_tables(cache_folder(str(dataset)))  # another test's tree may not be collected yet
    assert len(ours) == 2, ours  # the others are unmapped, not only forgotten


def _mapped_tables(folder: str) -> set[str]:
    """The table files in ``folder`` this process maps now."""
    with open("/proc/self/maps") as f:
        return {path for path in (line.split()[-1] for line in f if line.rstrip().endswith(".table"))
                if os.path.dirname(path) == folder}


def test_tables_without_a_store_are_let_go_too_and_built_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``atlasfs export`` has no store: its tables are held in memory, within the same bound."""
    import atlasfs.tree.table.tables as tables

    dataset = _dataset(tmp_path / "ds", shards=4)
    expected = _every_file(BlockTree(AtlasDataset(dataset)))
    monkeypatch.setattr(tables, "RESIDENT_TABLE_BYTES", 1)
    tree = BlockTree(AtlasDataset(dataset))
    assert _every_file(tree) == expected
    assert len(tree.tables.tables) == 1 and tree.tables.tables.get(3) is not None
    assert _every_file(tree) == expected  # built again, the same


def test_sizes_learnt_by_a_table_let_go_are_stored_first(
        tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import atlasfs.tree.table.tables as tables

    dataset = _dataset(tmp_path / "ds", shards=3)
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    for shard in tree.shard_folders():  # built and stored unsized: the names only
        tree.names(f"/{shard}")
    monkeypatch.setattr(tables, "RESIDENT_TABLE_BYTES", 1)  # one table held at a time
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    before = int(np.count_nonzero(tree.table(0).size == UNKNOWN_SIZE))
    for name in ("s0000.txt", "s0000.cls", "s0001.cls"):  # sized from their locators, or their block
        tree.lookup(f"/0/{name}")
    unsized = int(np.count_nonzero(tree.table(0).size == UNKNOWN_SIZE))
    tree.names("/1")  # lets shard 0's table go: what it learnt is stored
    stored = FileTable.load(str(Path(cache_folder(str(dataset))) / "0.table"), tree.tables.table_key(0),
                            Limits(tree.shards[0].num_blocks, tree.shards[0].block_size))
    assert stored is not None and int(np.count_nonzero(stored.size == UNKNOWN_SIZE)) == unsized
    assert 0 < unsized <= before - 3
