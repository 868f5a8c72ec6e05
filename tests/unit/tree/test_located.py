"""Files read without decoding their blocks (issue #18): through a locator (a run of the
decompressed block, or a small file kept in the table) a read gives exactly what
``atlasfs export`` writes; a block that changed since its locators were recorded, or a
stored table whose locators lie, is detected and read through the block, never served
as wrong bytes; forged locator columns are refused when the table is loaded (through a mount:
tests/mount/test_located_reads.py)."""

from __future__ import annotations

import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlasfs import AtlasDataset
from atlasfs.formats.atlas import spans
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.filetable import INLINE_AVERAGE, KEPT_AVERAGE, KEPT_MAX, FileTable, TableError
from atlasfs.tree.table.layout import INLINE, KEPT, NO_LOCATOR
from atlasfs.tree.table.store import table_file_name
from helpers import REFERENCE, in_threads, reference_names
from locateddata import (
    Exported,
    export_shards,
    forged_table,
    index_tables,
    located_tree,
    random_examples,
    stored_table,
    write_dataset,
)


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


@pytest.mark.parametrize("name", reference_names())
def test_every_reference_fixture_reads_the_same_through_both_paths(name: str, tmp_path: Path) -> None:
    dataset = Path(shutil.copytree(REFERENCE / name / "dataset", tmp_path / "dataset"))
    exported = export_shards(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")  # tables loaded from the store, locators and all
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
        index_tables(REFERENCE / name / "dataset", tables)
        tree = located_tree(REFERENCE / name / "dataset", tables)
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
    dataset = write_dataset(tmp_path / "ds", random_examples(3, 24), strategy, block_size=4)
    exported = export_shards(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
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
    dataset = write_dataset(tmp_path / "ds", examples, 2, block_size=1)
    exported = export_shards(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
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


def _lying_store(old: Path, new: Path, tables: Path) -> None:
    """Store the tables of dataset ``old`` as those of ``new`` (same names and sizes, other
    bytes): what a shard rewritten in place with its size and mtime kept would leave."""
    old_tree = located_tree(old, tables / "old")
    new_tree = located_tree(new, tables / "new")
    os.makedirs(tables / "new", exist_ok=True)
    for s, shard in enumerate(new_tree.shards):
        table = old_tree.table(s, sizes=True)
        assert table.locators is not None
        table.save(os.path.join(tables / "new", table_file_name(shard.name)), new_tree.tables.table_key(s))


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_a_changed_block_is_detected_and_read_through_it(tmp_path: Path, strategy: int,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    old = write_dataset(tmp_path / "old", random_examples(1), strategy, shard_size=12)
    new = write_dataset(tmp_path / "new", random_examples(2), strategy, shard_size=12)
    _lying_store(old, new, tmp_path / "tables")
    exported = export_shards(new, tmp_path / "export")
    tree = located_tree(new, tmp_path / "tables" / "new")
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


def test_a_table_with_locators_round_trips_and_one_without_stays_valid(tmp_path: Path) -> None:
    path, key, limits, table = stored_table(tmp_path)
    loaded = FileTable.load(str(path), key, limits)
    assert loaded is not None and loaded.locators is not None
    assert [loaded.locator(i) for i in range(len(table))] == [table.locator(i) for i in range(len(table))]
    assert {loc.inline for loc in map(table.locator, range(len(table))) if loc is not None} == {True, False}
    assert set(table.locators.prefix.tolist()) >= {INLINE, KEPT}
    plain = forged_table(table)
    plain.locators = None
    plain.save(str(path), key)
    loaded = FileTable.load(str(path), key, limits)
    assert loaded is not None and loaded.locators is None


def test_forged_locator_columns_are_refused(tmp_path: Path) -> None:
    path, key, limits, table = stored_table(tmp_path)
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
        forged_table(table, **changes).save(str(path), key)
        with pytest.raises(TableError):
            FileTable.load(str(path), key, limits)
    # A truncated file, and a header announcing locators that are not there.
    forged_table(table).save(str(path), key)
    data = path.read_bytes()
    path.write_bytes(data[:-3])
    with pytest.raises(TableError):
        FileTable.load(str(path), key, limits)


def test_locators_that_lie_within_bounds_cost_a_fallback_not_wrong_bytes(tmp_path: Path) -> None:
    path, key, limits, table = stored_table(tmp_path)
    assert table.locators is not None
    runs = (table.locators.offset != NO_LOCATOR) & (table.locators.prefix != INLINE)

    def shift(offsets: np.ndarray) -> None:
        offsets[runs] = offsets[runs] + 1

    forged_table(table, check=lambda c: c.__setitem__(slice(None), c ^ 0x5A5A5A5A), offset=shift).save(str(path), key)
    dataset = tmp_path / "ds"
    exported = export_shards(dataset, tmp_path / "export")
    tree = located_tree(dataset, tmp_path / "tables")
    _read_every_file(tree, exported, located=True)
    assert tree.located.reads == 0 and tree.located.fallbacks > 0


def test_threads_reading_random_files_cold_get_exactly_the_exported_bytes(tmp_path: Path) -> None:
    dataset = write_dataset(tmp_path / "ds", random_examples(5, 96), 2, block_size=4, shard_size=48)
    exported = export_shards(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables", cache_bytes=64 << 10)  # a few blocks: most reads are cold
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


def test_a_block_known_to_fail_fails_every_file_located_or_not(tmp_path: Path) -> None:
    from atlasfs.errors import AtlasFormatError
    dataset = write_dataset(tmp_path / "ds", random_examples(6), 2, shard_size=24)
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
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
    dataset = write_dataset(tmp_path / "ds", random_examples(7), 2, shard_size=24)
    exported = export_shards(dataset, tmp_path / "export")
    located_tree(dataset, tmp_path / "tables").table(0)  # built by naming, and stored
    tree = located_tree(dataset, tmp_path / "tables")
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
    dataset = write_dataset(tmp_path / "ds", random_examples(8), 2, shard_size=24)
    exported = export_shards(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    for keep in (located.LOCATED_KEEP_BYTES, 4 * 1000):  # the jpg files (2-2.3 KB) kept, then not
        monkeypatch.setattr(located, "LOCATED_KEEP_BYTES", keep)
        tree = located_tree(dataset, tmp_path / "tables")
        for name, data in exported["0"].items():
            _cold(tree, 0)
            entry = tree.lookup(f"/0/{name}")
            assert b"".join(tree.read(entry, offset, 700) for offset in range(0, entry.size, 700)) == data
        assert tree.located.reads > 0


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
