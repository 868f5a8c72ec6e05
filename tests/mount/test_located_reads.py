"""Files read without decoding their blocks (issue #18): through a locator (a run of the
decompressed block, or a small file kept in the table) a read gives exactly what
``atlasfs export`` writes; a block that changed since its locators were recorded, or a
stored table whose locators lie, is detected and read through the block, never served
as wrong bytes; forged locator columns are refused when the table is loaded."""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.commands import cli
from atlasfs.formats.atlas import spans
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.filetable import INLINE_AVERAGE, KEPT_AVERAGE, KEPT_MAX, FileTable, Limits, Locators, TableError
from atlasfs.tree.table.layout import INLINE, KEPT, NO_LOCATOR
from atlasfs.tree.table.store import TableStore, table_file_name
from fusemount import atlasfs, engine_answered, mounted, wait_mounted
from helpers import REFERENCE, in_threads, reference_names

Exported = dict[str, dict[str, bytes]]


def _export(dataset: Path, out: Path) -> Exported:
    """``atlasfs export``'s bytes: shard name -> member path -> bytes."""
    assert cli.main(["export", str(dataset), str(out)]) == 0
    exported: Exported = {}
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as t:
            exported[tar.name[:-len(".tar")]] = {m.name: t.extractfile(m).read()  # type: ignore[union-attr]
                                                for m in t.getmembers() if m.isfile()}
    return exported


def _tree(dataset: Path, tables: Path, cache_bytes: int = 64 << 20) -> BlockTree:
    return BlockTree(AtlasDataset(dataset, cache_bytes=0, mmap_index=False, tolerate_broken_shards=True),
                     cache_bytes=cache_bytes, store=TableStore(str(dataset), index_dir=str(tables)))


def _index(dataset: Path, tables: Path) -> None:
    """Build and store every shard's table, every size known (what ``atlasfs index`` does)."""
    tree = _tree(dataset, tables)
    for s in range(len(tree.shards)):
        tree.table(s, sizes=True)
    tree.source.close()


def _cold(tree: BlockTree, s: int) -> None:
    """Make the next read a random reader's first into a block that is not cached."""
    tree.cache.clear()
    spans.PAYLOADS.clear()
    spans.JUST_DECODED.clear()
    tree.blocks.last_block[s] = (-10, 1)


def _read_every_file(tree: BlockTree, exported: Exported, located: bool) -> None:
    """Read every exported file through ``tree`` (``located``: each read the first into a
    block nobody decoded; else through the decoded block) and compare."""
    for s, shard in enumerate(tree.shards):
        for name, data in exported[shard.name].items():
            entry = tree.lookup(f"/{shard.name}/{name}")
            assert entry.size == len(data), name
            if located:
                _cold(tree, s)
            else:
                assert entry.ref is not None
                tree.blocks.decoded(s, entry.ref.block)
            assert tree.read(entry, 0, entry.size + 10) == data, f"{shard.name}/{name}"


def _write(root: Path, examples: list[Any], strategy: int, block_size: int = 2, shard_size: int = 0) -> Path:
    with AtlasWriter(root, shard_size=shard_size or len(examples), block_size=block_size,
                     compression_strategy=strategy) as writer:
        writer.add_examples(examples)
    return root


def _examples(seed: int, n: int = 24) -> list[dict[str, Any]]:
    """Examples whose pickles have one layout whatever the seed (only run bytes differ),
    with every kind of file: raw bytes, text, an array, small ints, a small JSON (inline) and
    a larger one (kept: a dict of 60 numbers of 3 digits, about 330 bytes)."""
    rng = np.random.default_rng(seed)
    return [{"jpg": rng.bytes(2000 + 10 * i), "txt": "".join(rng.choice(list("abc"), 300 + i)),
             "npy": rng.random(50 + i), "cls": i, "json": {"id": i, "tag": "abc"[i % 3]},
             "values.json": {"id": i, "values": rng.integers(100, 1000, 60).tolist()}} for i in range(n)]


# ---------------------------------------------------------------- the reference fixtures


@pytest.mark.parametrize("name", reference_names())
def test_every_reference_fixture_reads_the_same_through_both_paths(name: str, tmp_path: Path) -> None:
    dataset = Path(shutil.copytree(REFERENCE / name / "dataset", tmp_path / "dataset"))
    exported = _export(dataset, tmp_path / "export")
    _index(dataset, tmp_path / "tables")
    tree = _tree(dataset, tmp_path / "tables")  # tables loaded from the store, locators and all
    _read_every_file(tree, exported, located=True)
    located = tree.located.reads
    _read_every_file(tree, exported, located=False)
    assert tree.located.fallbacks == 0
    files = sum(map(len, exported.values()))
    if files:
        assert tree.located.reads == located > 0  # the block path served the second pass


def test_the_fixtures_have_every_kind_of_locator(tmp_path: Path) -> None:
    kinds = set()
    for name in reference_names():
        tables = tmp_path / name
        _index(REFERENCE / name / "dataset", tables)
        tree = _tree(REFERENCE / name / "dataset", tables)
        for s in range(len(tree.shards)):
            table = tree.table(s)
            for i in range(len(table)):
                locator = table.locator(i)
                if locator is not None:
                    kinds.add("inline" if locator.inline else "npy" if locator.prefix else "run")
    assert kinds == {"inline", "npy", "run"}


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_files_of_no_run_are_kept_compressed_a_block_at_a_time(tmp_path: Path, strategy: int) -> None:
    """A JSON of a dict too big for the inline bytes (no bytes of the pickle are its encoding)
    is kept in the table, with its block's others in one zstd frame: a stored table gives it
    back exactly, and a read of it decodes nothing."""
    dataset = _write(tmp_path / "ds", _examples(3, 24), strategy, block_size=4)
    exported = _export(dataset, tmp_path / "export")
    _index(dataset, tmp_path / "tables")
    tree = _tree(dataset, tmp_path / "tables")
    table = tree.table(0)
    assert table.locators is not None
    kept = np.flatnonzero(table.locators.prefix == KEPT)
    assert [table.entry_path(int(i)) for i in kept] == [name for name in exported["0"] if name.endswith(".values.json")]
    assert len(table.locators.kept_ends) == 6 and 0 < len(table.locators.kept) <= KEPT_AVERAGE * len(table)
    for i in kept:
        locator = table.locator(int(i))
        assert locator is not None and locator.inline
        assert locator.prefix == exported["0"][table.entry_path(int(i))]
    _read_every_file(tree, exported, located=True)
    assert tree.located.fallbacks == 0 and tree.located.reads == len(exported["0"])  # none through its block


def test_kept_files_past_the_tables_bound_keep_their_blocks(tmp_path: Path) -> None:
    """Past KEPT_AVERAGE compressed bytes a file, a block's kept files are taken back whole
    (they are read through the block); a file past KEPT_MAX is never kept."""
    rng = np.random.default_rng(4)
    examples = [{"json": {"values": [i] * 300}} for i in range(6)]  # 1.2 KB that compress to a few dozen
    examples += [{"json": {"values": rng.random(300).tolist()}} for _ in range(2)]  # 6 KB that do not
    examples.append({"json": {"values": [1] * (KEPT_MAX // 2)}})  # over KEPT_MAX
    dataset = _write(tmp_path / "ds", examples, 2, block_size=1)
    exported = _export(dataset, tmp_path / "export")
    _index(dataset, tmp_path / "tables")
    tree = _tree(dataset, tmp_path / "tables")
    table = tree.table(0)
    locators = table.locators
    assert locators is not None and 0 < len(locators.kept) <= KEPT_AVERAGE * len(table)
    assert (locators.prefix == KEPT).tolist() == [True] * 6 + [False] * 3
    assert len(locators.kept_ends) == 6
    _read_every_file(tree, exported, located=True)
    assert tree.located.reads == 6 and tree.located.fallbacks == 0


def test_every_atlas_shard_is_the_block_store_its_located_reads_need() -> None:
    """LocatedReads is mixed into the Atlas Shard and uses what spans.BlockStore names; a
    shard that lost one of those would fail only on its first located read."""
    for name in reference_names():
        dataset = AtlasDataset(REFERENCE / name / "dataset", cache_bytes=0)
        try:
            for shard in dataset.shards:
                assert isinstance(shard, spans.LocatedReads) and isinstance(shard, spans.BlockStore), name
        finally:
            dataset.close()


# ---------------------------------------------------------------- data that changed, tables that lie


def _lying_store(old: Path, new: Path, tables: Path) -> None:
    """Store the tables of dataset ``old`` as those of ``new`` (same names and sizes, other
    bytes): what a shard rewritten in place with its size and mtime kept would leave."""
    old_tree = _tree(old, tables / "old")
    new_tree = _tree(new, tables / "new")
    os.makedirs(tables / "new", exist_ok=True)
    for s, shard in enumerate(new_tree.shards):
        table = old_tree.table(s, sizes=True)
        assert table.locators is not None
        table.save(os.path.join(tables / "new", table_file_name(shard.name)), new_tree.tables.table_key(s))


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_a_changed_block_is_detected_and_read_through_it(tmp_path: Path, strategy: int,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    old = _write(tmp_path / "old", _examples(1), strategy, shard_size=12)
    new = _write(tmp_path / "new", _examples(2), strategy, shard_size=12)
    _lying_store(old, new, tmp_path / "tables")
    exported = _export(new, tmp_path / "export")
    tree = _tree(new, tmp_path / "tables" / "new")
    assert all(tree.table(s).locators is not None for s in range(len(tree.shards)))  # the lying table is used
    with caplog.at_level(logging.WARNING, logger="atlasfs"):
        _read_every_file(tree, exported, located=True)
    assert tree.located.fallbacks > 0
    warned = [r for r in caplog.records if "read through the block from now on" in r.getMessage()]
    blocks = sum(shard.num_blocks for shard in tree.shards)
    assert 0 < len(warned) <= blocks  # once per block at most
    # Only the files whose bytes are the same in both (cls, json: same values) may still be
    # served from the table; every other read was the block's.
    assert tree.located.reads <= sum(len(files) for files in exported.values()) * 2 // 5


def test_a_byte_changed_in_place_is_never_served_stale_through_a_mount(tmp_path: Path) -> None:
    """Strategy 0, a byte of an image flipped in data.bin with its size and mtime kept: the
    stored table still matches the shard's signature, the mount must serve the new bytes."""
    dataset = _write(tmp_path / "ds", _examples(3), 0, shard_size=12)
    assert atlasfs("index", str(dataset)).returncode == 0
    data_bin = dataset / "0" / "data.bin" if (dataset / "0").is_dir() else next(dataset.glob("*/data.bin"))
    stat = os.stat(data_bin)
    blob = bytearray(data_bin.read_bytes())
    jpg = _examples(3)[5]["jpg"]
    at = bytes(blob).find(jpg)
    assert at > 0
    blob[at + 100] ^= 0xFF
    data_bin.write_bytes(bytes(blob))
    os.utime(data_bin, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    exported = _export(dataset, tmp_path / "export")  # the bytes the dataset holds now
    names = [(shard, name) for shard, files in exported.items() for name in files]
    random.Random(1).shuffle(names)
    with mounted(dataset) as mnt:
        for shard, name in names:
            assert (mnt / shard / name).read_bytes() == exported[shard][name], name


def _stored_table(tmp_path: Path) -> tuple[Path, dict[str, Any], Limits, FileTable]:
    dataset = _write(tmp_path / "ds", _examples(4), 2, shard_size=24)
    _index(dataset, tmp_path / "tables")
    tree = _tree(dataset, tmp_path / "tables")
    table = tree.table(0)
    path = tmp_path / "tables" / table_file_name(tree.shards[0].name)
    assert path.exists() and table.locators is not None
    return path, tree.tables.table_key(0), Limits(tree.shards[0].num_blocks, tree.shards[0].block_size), table


def _forged(table: FileTable, **changes: Any) -> FileTable:
    locators = table.locators
    assert locators is not None
    columns = {name: getattr(locators, name).copy() for name in ("offset", "length", "check", "prefix")}
    fields = {"prefixes": list(locators.prefixes), "inline": bytes(locators.inline),  # maps, if loaded
              "kept": bytes(locators.kept), "kept_ends": locators.kept_ends.copy()}
    for name, change in changes.items():
        if name in columns:
            change(columns[name])
        else:
            fields[name] = change(fields[name])
    forged = FileTable(table._names, table._offsets, {name: getattr(table, name) for name in
                                                      ("kind", "size", "block", "pos", "file", "by_path")})
    forged.state = table.state
    forged.locators = Locators(columns["offset"], columns["length"], columns["check"], columns["prefix"],
                               fields["prefixes"], fields["inline"], fields["kept"], fields["kept_ends"])
    return forged


def test_a_table_with_locators_round_trips_and_one_without_stays_valid(tmp_path: Path) -> None:
    path, key, limits, table = _stored_table(tmp_path)
    loaded = FileTable.load(str(path), key, limits)
    assert loaded is not None and loaded.locators is not None
    assert [loaded.locator(i) for i in range(len(table))] == [table.locator(i) for i in range(len(table))]
    assert {loc.inline for loc in map(table.locator, range(len(table))) if loc is not None} == {True, False}
    assert set(table.locators.prefix.tolist()) >= {INLINE, KEPT}
    plain = _forged(table)
    plain.locators = None
    plain.save(str(path), key)
    loaded = FileTable.load(str(path), key, limits)
    assert loaded is not None and loaded.locators is None


def test_forged_locator_columns_are_refused(tmp_path: Path) -> None:
    path, key, limits, table = _stored_table(tmp_path)
    assert table.locators is not None
    inline_rows = np.flatnonzero(table.locators.prefix == INLINE)
    kept_rows = np.flatnonzero(table.locators.prefix == KEPT)
    run_rows = np.flatnonzero((table.locators.offset != NO_LOCATOR) & (table.locators.prefix != INLINE)
                              & (table.locators.prefix != KEPT))
    unlocated = np.flatnonzero(table.locators.offset == NO_LOCATOR)
    forgeries = {
        "a prefix number past the prefixes": dict(prefix=lambda a: a.__setitem__(run_rows[0], 999)),
        "an inline file past the inline bytes": dict(offset=lambda a: a.__setitem__(inline_rows[0], 10**6)),
        "a prefix without a locator": dict(prefix=lambda a: a.__setitem__(unlocated[0], 1)) if len(unlocated) else
        dict(inline=lambda b: b + b"x" * (INLINE_AVERAGE * len(table))),
        "more inline bytes than the bound": dict(inline=lambda b: b + b"x" * (INLINE_AVERAGE * len(table))),
        "a prefix bigger than its file": dict(prefixes=lambda p: [b"\x93NUMPY" + b"h" * 10**5] + p[1:]),
        "a run longer than its file": dict(length=lambda a: a.__setitem__(run_rows[0], a[run_rows[0]] + 1)),
        "a length without a locator": dict(length=lambda a: a.__setitem__(unlocated[0], 5)) if len(unlocated) else
        dict(length=lambda a: a.__setitem__(inline_rows[0], 10**6)),
        "more kept bytes than the bound": dict(kept=lambda b: b + b"x" * (KEPT_AVERAGE * len(table))),
        "a kept file past its bound": dict(length=lambda a: a.__setitem__(kept_rows[0], KEPT_MAX + 1)),
        "kept frames out of order": dict(kept_ends=lambda e: e[::-1].copy()),
        "kept frames past the kept bytes": dict(kept_ends=lambda e: e + 10**6),
        "a kept file of a block with no frame": dict(kept_ends=lambda e: e[:-1].copy()),
    }
    assert table.locators.prefixes  # the .npy files' headers: the last forgery needs one
    for what, changes in forgeries.items():
        _forged(table, **changes).save(str(path), key)
        with pytest.raises(TableError):
            FileTable.load(str(path), key, limits)
    # A truncated file, and a header announcing locators that are not there.
    _forged(table).save(str(path), key)
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(TableError):
        FileTable.load(str(path), key, limits)


def test_locators_that_lie_within_bounds_cost_a_fallback_not_wrong_bytes(tmp_path: Path) -> None:
    path, key, limits, table = _stored_table(tmp_path)
    assert table.locators is not None
    runs = (table.locators.offset != NO_LOCATOR) & (table.locators.prefix != INLINE)

    def shift(offsets: np.ndarray) -> None:
        offsets[runs] = offsets[runs] + 1

    _forged(table, check=lambda c: c.__setitem__(slice(None), c ^ 0x5A5A5A5A), offset=shift).save(str(path), key)
    dataset = tmp_path / "ds"
    exported = _export(dataset, tmp_path / "export")
    tree = _tree(dataset, tmp_path / "tables")
    _read_every_file(tree, exported, located=True)
    assert tree.located.reads == 0 and tree.located.fallbacks > 0


# ---------------------------------------------------------------- threads, and a real mount


def test_threads_reading_random_files_cold_get_exactly_the_exported_bytes(tmp_path: Path) -> None:
    dataset = _write(tmp_path / "ds", _examples(5, 96), 2, block_size=4, shard_size=48)
    exported = _export(dataset, tmp_path / "export")
    _index(dataset, tmp_path / "tables")
    tree = _tree(dataset, tmp_path / "tables", cache_bytes=64 << 10)  # a few blocks: most reads are cold
    files = [(shard, name) for shard, names in exported.items() for name in names]
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(400):
            shard, name = rng.choice(files)
            try:
                entry = tree.lookup(f"/{shard}/{name}")
                if rng.random() < 0.3:
                    spans.PAYLOADS.clear()
                    spans.JUST_DECODED.clear()
                got = tree.read(entry, 0, entry.size)
            except Exception as exc:  # reported below
                errors.append(f"{shard}/{name}: {exc!r}")
                continue
            if got != exported[shard][name]:
                errors.append(f"{shard}/{name}: wrong bytes")

    in_threads(reader, 8)
    assert errors == []
    assert tree.located.reads > 100 and tree.located.fallbacks == 0


def test_a_mount_serves_the_exported_bytes_to_random_readers(tmp_path: Path) -> None:
    dataset = Path(shutil.copytree(REFERENCE / "s2_shared_dict" / "dataset", tmp_path / "s2"))
    exported = _export(dataset, tmp_path / "export")
    assert atlasfs("index", str(dataset)).returncode == 0  # tables with locators, beside the dataset
    files = [(shard, name) for shard, names in exported.items() for name in names]
    errors: list[str] = []
    with mounted(dataset) as mnt:
        def reader(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(150):
                shard, name = rng.choice(files)
                with open(mnt / shard / name, "rb", buffering=0) as f:
                    got = f.read()
                if got != exported[shard][name]:
                    errors.append(f"{shard}/{name}")

        in_threads(reader, 6)
    assert errors == []


def test_a_block_known_to_fail_fails_every_file_located_or_not(tmp_path: Path) -> None:
    from atlasfs.errors import AtlasFormatError
    dataset = _write(tmp_path / "ds", _examples(6), 2, shard_size=24)
    _index(dataset, tmp_path / "tables")
    tree = _tree(dataset, tmp_path / "tables")
    shard = tree.shards[0]

    def broken(block: int) -> Any:
        raise AtlasFormatError(f"{shard.data_path} block {block}: damaged")

    shard.decode_block = broken  # type: ignore[method-assign]
    table = tree.table(0)
    in_block_0 = [f"/{shard.name}/{table.row(i).path}" for i in range(len(table)) if table.block.item(i) == 0]
    tree.located.enabled = False
    with pytest.raises(OSError):  # decoded, it fails: the block is known to fail from now on
        tree.read(tree.lookup(in_block_0[0]), 0, 10)
    tree.located.enabled = True
    for path in in_block_0:
        _cold(tree, 0)
        with pytest.raises(OSError):
            tree.read(tree.lookup(path), 0, 1 << 20)
    assert tree.located.reads == 0


def test_a_table_not_yet_sized_sizes_located_files_at_lookup_without_decoding(tmp_path: Path) -> None:
    """A first mount's table knows the sizes of raw bytes only (so that its listings hand
    out no attributes it would have to size); a located file's lookup takes its size from
    its locator, and its read decodes nothing."""
    from atlasfs.tree.table.layout import UNKNOWN_SIZE
    dataset = _write(tmp_path / "ds", _examples(7), 2, shard_size=24)
    exported = _export(dataset, tmp_path / "export")
    _tree(dataset, tmp_path / "tables").table(0)  # built by naming, and stored
    tree = _tree(dataset, tmp_path / "tables")
    assert bool(np.any(tree.table(0).size == UNKNOWN_SIZE))
    names = list(exported["0"].items())
    random.Random(2).shuffle(names)
    for name, data in names:
        _cold(tree, 0)
        entry = tree.lookup(f"/0/{name}")
        assert tree.read(entry, 0, entry.size) == data
    assert tree.cache.misses == 0 and tree.located.reads == len(names)
    assert not bool(np.any(tree.table(0).size == UNKNOWN_SIZE))


def test_files_read_a_piece_at_a_time_come_out_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file bigger than one request: its first request locates it and keeps it for the
    next ones, or (past the keep bound) leaves it to its block; the bytes are the same."""
    import atlasfs.tree.located as located
    dataset = _write(tmp_path / "ds", _examples(8), 2, shard_size=24)
    exported = _export(dataset, tmp_path / "export")
    _index(dataset, tmp_path / "tables")
    for keep in (located.LOCATED_KEEP_BYTES, 4 * 1000):  # the jpg files (2-2.3 KB) kept, then not
        monkeypatch.setattr(located, "LOCATED_KEEP_BYTES", keep)
        tree = _tree(dataset, tmp_path / "tables")
        for name, data in exported["0"].items():
            _cold(tree, 0)
            entry = tree.lookup(f"/0/{name}")
            assert b"".join(tree.read(entry, offset, 700) for offset in range(0, entry.size, 700)) == data
        assert tree.located.reads > 0


# ---------------------------------------------------------------- located reads in C, through a mount


def _engine_answered(log: Path) -> dict[str, tuple[int, int]]:
    """What the native engine says it answered, in C and in Python, per kind (logged as the
    daemon ends: waited for)."""
    deadline = time.monotonic() + 20
    while True:
        lines = [line for line in log.read_text().splitlines() if "native engine answered" in line] \
            if log.exists() else []
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert lines, f"the daemon did not say what it answered: {log.read_text() if log.exists() else 'no log'}"
    return engine_answered(lines[-1])


def _read_through(mnt: Path, exported: Exported, readers: int = 4) -> list[str]:
    """Every exported file read through ``mnt`` by ``readers`` threads, each in its own random
    order; the files whose bytes differ."""
    files = [(shard, name) for shard, names in exported.items() for name in names]
    errors: list[str] = []

    def reader(seed: int) -> None:
        order = files[:]
        random.Random(seed).shuffle(order)
        for shard, name in order:
            with open(mnt / shard / name, "rb", buffering=0) as f:
                if f.read() != exported[shard][name]:
                    errors.append(f"{shard}/{name}")

    in_threads(reader, readers)
    return errors


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
@pytest.mark.parametrize("images", [False, True])
def test_the_engine_reads_located_files_in_c_with_the_exported_bytes(tmp_path: Path, strategy: int,
                                                                      images: bool) -> None:
    """Every kind of locator (runs with and without a prefix, inline and kept files) of every
    compression strategy, read by parallel readers: C answers them where their bytes lie.
    With images (300 KB of random bytes: zstd stores them raw), each read whole takes its
    run alone, without decompressing its block."""
    examples = _examples(7, 48)
    if images:
        rng = np.random.default_rng(8)
        examples = [{**example, "jpg": rng.bytes(300_000)} for example in examples[:12]]
    dataset = _write(tmp_path / "ds", examples, strategy, block_size=4, shard_size=24 if not images else 6)
    exported = _export(dataset, tmp_path / "export")
    _index(dataset, tmp_path / "tables")
    log = tmp_path / "daemon.log"
    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        assert _read_through(mnt, exported) == []
    answered = _engine_answered(log)
    assert answered["located"][1] == 0, answered  # no located read failed its checks
    if images:
        # The images whole, each in one request: the run alone (stored raw by zstd, or with no
        # compression). Strategy 0's small files have no locator here (blocks of 1.2 MB have no
        # fingerprint): random readers have them read by the control plane, from the block.
        assert answered["stored"][0] >= 12, answered
    else:
        files = sum(len(names) for names in exported.values())  # every one located: its json is small, inline
        assert answered["located"][0] >= files and answered["read"][1] == 0, answered  # none asked Python


def test_locators_that_lie_are_left_to_the_control_plane_which_serves_the_right_bytes(tmp_path: Path) -> None:
    """A stored table whose runs point one byte off, with checks that do not match: C serves
    none of them (its CRC-32 check), the control plane reads each through its block."""
    path, key, _, table = _stored_table(tmp_path)
    assert table.locators is not None
    runs = (table.locators.offset != NO_LOCATOR) & (table.locators.prefix != INLINE)

    def shift(offsets: np.ndarray) -> None:
        offsets[runs] = offsets[runs] + 1

    _forged(table, offset=shift).save(str(path), key)  # the checks are the true runs': they fail one byte off
    dataset = tmp_path / "ds"
    exported = _export(dataset, tmp_path / "export")
    log = tmp_path / "daemon.log"
    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        assert _read_through(mnt, {"0": exported["0"]}, readers=2) == []
    located_in_c, left_to_python = _engine_answered(log)["located"]
    assert left_to_python > 0
    small = int(np.isin(table.locators.prefix, [INLINE, KEPT]).sum())
    assert located_in_c <= 2 * small  # only the inline and kept files, untouched, may still be read in C


@pytest.mark.parametrize("lie", ["frames", "offsets"])
def test_kept_files_that_lie_are_left_to_the_control_plane_which_serves_the_right_bytes(tmp_path: Path,
                                                                                       lie: str) -> None:
    """A stored table whose kept frames are damaged (a byte flipped in each), or whose kept
    files point one byte off: C serves none that does not check out, the control plane reads
    those through their block, with the exported bytes."""
    path, key, _, table = _stored_table(tmp_path)
    assert table.locators is not None
    kept = table.locators.prefix == KEPT
    ends = table.locators.kept_ends.tolist()
    assert kept.any() and ends

    def flip(frames: bytes) -> bytes:
        damaged = bytearray(frames)
        for start, end in zip([0] + ends, ends):
            damaged[(start + end) // 2] ^= 0x55
        return bytes(damaged)

    def shift(offsets: np.ndarray) -> None:
        offsets[kept] = offsets[kept] + 1

    _forged(table, **({"kept": flip} if lie == "frames" else {"offset": shift})).save(str(path), key)
    dataset = tmp_path / "ds"
    exported = _export(dataset, tmp_path / "export")
    names = {name for i, name in enumerate(map(table.entry_path, range(len(table)))) if kept[i]}
    log = tmp_path / "daemon.log"
    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        assert _read_through(mnt, {"0": {name: exported["0"][name] for name in names}}, readers=2) == []
    located_in_c, left_to_python = _engine_answered(log)["located"]
    assert left_to_python > 0
    if lie == "offsets":
        assert located_in_c == 0  # a flipped byte may spare a frame's other file: that one still checks out


@pytest.mark.parametrize("strategy", [0, 2])
def test_files_read_in_pieces_from_their_middle_are_read_alone_and_kept(tmp_path: Path, strategy: int) -> None:
    """A read that is not the whole file (the kernel's read-ahead pieces) takes the file's run
    alone, checks it whole and keeps it for the next pieces: bytes as exported, none asked
    Python, no block decompressed for it."""
    rng = np.random.default_rng(9)
    examples = [{"jpg": rng.bytes(700_000 + 1000 * i), "cls": i} for i in range(8)]
    dataset = _write(tmp_path / "ds", examples, strategy, block_size=4)
    exported = _export(dataset, tmp_path / "export")
    _index(dataset, tmp_path / "tables")
    log = tmp_path / "daemon.log"
    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        for shard, names in exported.items():
            for name, data in names.items():
                if not name.endswith(".jpg"):
                    continue
                fd = os.open(mnt / shard / name, os.O_RDONLY)
                try:
                    middle = len(data) // 2
                    assert os.pread(fd, 4096, middle) == data[middle:middle + 4096], name
                    got = b"".join(iter(lambda: os.read(fd, 65536), b""))
                finally:
                    os.close(fd)
                assert got == data, name
    answered = _engine_answered(log)
    assert answered["read"][1] == 0 and answered["located"][1] == 0, answered
    assert answered["stored"][0] >= 8 and answered["stored"][1] == 0, answered


# ---------------------------------------------------------------- tables read from their files

_FOREGROUND = """
import sys
from atlasfs.commands import cli
from atlasfs.fuse import attachments
from atlasfs.tree.table import tables
tables.RESIDENT_TABLE_BYTES = 1  # the tree holds one table at a time
attachments.FILE_TABLES_MAX = int(sys.argv[1])
sys.exit(cli.main(["mount", "-f", sys.argv[2], sys.argv[3], "-o", "log_file=" + sys.argv[4]]))
"""


def _mount_holding_one_table(dataset: Path, mnt: Path, log: Path, file_tables: int) -> Any:
    """A foreground daemon whose tree holds one table at a time, and whose engine reads at most
    ``file_tables`` tables from their files."""
    process = subprocess.Popen([sys.executable, "-c", _FOREGROUND, str(file_tables), str(dataset), str(mnt), str(log)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_mounted(process, mnt)
    return process


@pytest.mark.parametrize("limits, tables, soft", [((512, 1024), 256, 1024), ((300, 300), 14, 300)])
def test_tables_read_from_their_files_fit_the_open_files_limit(limits: tuple[int, int], tables: int,
                                                               soft: int) -> None:
    """Three descriptors a table read from its file, 256 left to the rest: the soft limit is
    raised within the hard one as far as that needs, and the tables fit what is left (run in a
    process of its own: the limit is the process's)."""
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_NOFILE, tuple(map(int, sys.argv[1:3])));"
            "from atlasfs.fuse import attachments; n = attachments.file_tables_max();"
            "print(n, resource.getrlimit(resource.RLIMIT_NOFILE)[0])")
    run = subprocess.run([sys.executable, "-c", code, *map(str, limits)], capture_output=True, text=True, check=True)
    assert run.stdout.split() == [str(tables), str(soft)], run.stderr


@pytest.mark.parametrize("file_tables", [0, 64])
def test_tables_read_from_their_files_answer_random_readers_over_more_tables_than_the_tree_holds(
        tmp_path: Path, file_tables: int) -> None:
    """The tree holds one table at a time here, and random readers go through 6 shards: a
    table attached from its mapped columns is let go with its map, so lookups and reads of
    the other shards are the control plane's (file_tables 0: the test can fail); a table
    read from its file (pread: no memory held) stays attached, and C answers nearly all."""
    dataset = _write(tmp_path / "ds", _examples(6, 144), 2, block_size=3, shard_size=24)  # listings of 144; 8 blocks a shard: a dictionary
    exported = _export(dataset, tmp_path / "export")
    _index(dataset, dataset / ".atlasfs-tables")  # where a mount finds them
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    process = _mount_holding_one_table(dataset, mnt, log, file_tables)
    try:
        assert _read_through(mnt, exported, readers=4) == []
        for shard, names in exported.items():  # listed from the tables (in windows of rows, read from the files)
            assert os.listdir(mnt / shard) == list(names)
            assert {p.name: p.stat().st_size for p in (mnt / shard).iterdir()} == {n: len(d) for n, d in names.items()}
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        process.wait(timeout=30)
    answered = _engine_answered(log)
    files = sum(len(names) for names in exported.values())
    if file_tables:
        # Python: each shard's folder, and what the 4 readers asked of a shard before its table
        # was attached (at most one request each).
        shards = len(exported)
        assert answered["lookup"][1] <= 5 * shards and answered["read"][1] <= 4 * shards, answered
        assert answered["located"][0] >= files - 4 * shards
        # The 6 shards' located reads share the dataset's one zstd dictionary.
        assert "zstd dictionaries held: 1" in log.read_text()
    else:
        assert answered["lookup"][1] > 10 * len(exported) and answered["read"][1] > 0, answered
