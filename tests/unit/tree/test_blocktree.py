"""BlockTree's caches: what a read decodes and encodes, and that the bound is kept."""

from __future__ import annotations

import errno
import random
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.filetable import FileTable
from atlasfs.tree.table.layout import NO_LOCATOR, UNKNOWN_SIZE
from atlasfs.tree.table.store import TableStore
from threadwait import wait_until


def _write(path: Path, examples: int = 200, values: int = 20) -> None:
    """``values`` numbers in each json (past ~800, ~16 KiB: too big to be kept in the table)."""
    rng = random.Random(3)
    with AtlasWriter(path, shard_size=100, block_size=16, compression_strategy=1) as writer:
        for i in range(examples):
            writer.add_example({"bin": rng.randbytes(300), "json": {"i": i, "v": [rng.random() for _ in range(values)]},
                                "txt": "x" * (i % 50)})


def test_a_read_on_a_stored_table_decodes_one_block_and_encodes_one_example(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    first = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    expected = {path: first.read(entry, 0, entry.size) for path, entry in first.walk("/")}

    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    tree.located.enabled = False  # the block path (reads through locators: tests/unit/tree/test_located.py)
    path = sorted(expected)[137]
    entry = tree.lookup("/" + path)
    assert tree.read(entry, 0, entry.size) == expected[path]
    assert tree.cache.misses == 1  # the table came from the store: one decode
    block = next(iter(tree.cache._items.values()))[0]
    assert sum(e is not None for e in block.encoded) == 1  # and one example encoded
    for other in sorted(expected):  # the other files of that example, and its block's other examples
        if other.rpartition(".")[0] == path.rpartition(".")[0]:
            assert tree.read(tree.lookup("/" + other), 0, 1 << 20) == expected[other]
    assert sum(e is not None for e in block.encoded) == 1
    assert tree.cache.misses == 1
    # partial reads at every offset give the same bytes
    assert b"".join(tree.read(entry, offset, 7) for offset in range(0, entry.size, 7)) == expected[path]
    # every file, in a random order, is right
    order = sorted(expected)
    random.Random(5).shuffle(order)
    for other in order:
        assert tree.read(tree.lookup("/" + other), 0, 1 << 20) == expected[other], other


def test_encoded_files_count_against_the_bound(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset, 400)
    bound = 64 << 10
    tree = BlockTree(AtlasDataset(dataset), cache_bytes=bound)
    tree.located.enabled = False  # every read through its block
    shard = tree.source.shards[0]
    decoded_cost = shard.decode_block(0)[1]
    order = [(path, entry) for path, entry in tree.walk("/")]
    first = order[0][1]
    tree.read(first, 0, first.size)
    key = (first.ref.shard, first.ref.block)
    cost_after_one = tree.cache._items[key][1]
    assert cost_after_one > decoded_cost  # json and txt files are new bytes; bin is shared
    for path, entry in order:
        tree.read(entry, 0, entry.size)
        assert tree.cache.current_bytes <= bound


def test_a_block_that_cannot_be_decoded_fails_its_reads_with_eio_once_the_table_is_stored(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    first = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    files = dict(first.walk("/"))
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    # damage block 0 of shard 0 in memory only: its decode now fails
    shard = tree.source.shards[0]
    original = shard.decode_block

    def broken(block: int):  # type: ignore[no-untyped-def]
        if block == 0:
            from atlasfs.errors import AtlasFormatError
            raise AtlasFormatError(f"{shard.data_path} block 0: damaged")
        return original(block)

    shard.decode_block = broken  # type: ignore[method-assign]
    tree.located.enabled = False  # through the block (a located read checks only its own file's bytes)
    in_block_0 = [p for p, e in files.items() if e.ref.shard == 0 and e.ref.block == 0]
    elsewhere = [p for p, e in files.items() if e.ref.shard == 0 and e.ref.block == 1]
    for path in in_block_0:
        with pytest.raises(OSError) as info:
            tree.read(tree.lookup("/" + path), 0, 10)
        assert info.value.errno == errno.EIO and "block 0: damaged" in str(info.value)
    for path in elsewhere:
        assert tree.read(tree.lookup("/" + path), 0, 1 << 20) == first.read(files[path], 0, 1 << 20)


def _counting_decodes(shard: Any) -> list[int]:
    """The blocks ``shard`` decodes from now on, in order (its ``decode_block`` wrapped)."""
    calls: list[int] = []
    original = shard.decode_block

    def counting(block: int):  # type: ignore[no-untyped-def]
        calls.append(block)
        return original(block)

    shard.decode_block = counting
    return calls


def test_building_a_table_without_a_cache_decodes_each_block_once(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    tree = BlockTree(AtlasDataset(dataset), cache_bytes=0)  # as `atlasfs index` opens it
    shard = tree.source.shards[0]
    calls = _counting_decodes(shard)
    assert len(tree.table(0)) == 100 * 3
    assert sorted(calls) == list(range(shard.num_blocks))


def test_a_block_whose_files_outgrow_the_decode_limit_fails_with_eio(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    files = dict(tree.walk("/"))  # tables built and stored with the normal limit
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    in_block_0 = sorted(p for p, e in files.items() if e.ref.shard == 0 and e.ref.block == 0)
    tree.read(tree.lookup("/" + in_block_0[0]), 0, 10)  # decoded within the limit (its pickle: ~8 KB)
    limit = tree.source.shards[0].decode_block(0)[1] + 500
    tree.source.shards[0].codec.max_block_bytes = limit  # the block's files (~12 KB) will not fit
    with pytest.raises(OSError) as info:
        for path in in_block_0:
            tree.read(tree.lookup("/" + path), 0, 1 << 20)
    assert info.value.errno == errno.EIO and f"would take more than {limit} bytes" in str(info.value)
    with pytest.raises(OSError):  # and the block stays failed
        tree.read(tree.lookup("/" + in_block_0[0]), 0, 10)


def _unsized(table: FileTable) -> int:
    return int(np.count_nonzero(table.size == UNKNOWN_SIZE))


def test_a_first_listing_names_files_without_encoding_any(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    full = BlockTree(AtlasDataset(dataset))  # no store: the reference listing, sizes and all
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    shard = tree.source.shards[0]
    calls = _counting_decodes(shard)
    listing = tree.names(f"/{shard.name}")
    assert list(listing) == [(name, e.is_dir, e.ino) for name, e in full.listdir(f"/{shard.name}")]
    assert sorted(calls) == list(range(shard.num_blocks))  # each block decoded once...
    assert not tree.cache._items  # ...and not kept: every file is located in its block as stored (random bytes)
    table = tree.table(0)
    assert _unsized(table) == 100 * 2  # json and txt, no example encoded; bin's size is its length
    # stored at once: a second tree lists without decoding
    again = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    assert again.names(f"/{shard.name}") == listing and again.cache.misses == 0

    # lookups fill the sizes in: a file's locator tells its size (the json, kept in the table,
    # decodes nothing), else a block at a time (its next files are looked up next); the table
    # is stored again once it knows them all
    misses = tree.cache.misses
    assert listing[1][0].endswith(".json") and table.located_size(1) is not None
    tree.lookup(f"/{shard.name}/{listing[1][0]}")
    assert _unsized(table) == 100 * 2 - 1 and tree.cache.misses == misses
    for name, _, _ in listing:
        entry = tree.lookup(f"/{shard.name}/{name}")
        assert entry == full.lookup(f"/{shard.name}/{name}")
        assert len(tree.read(entry, 0, 1 << 20)) == entry.size
    assert _unsized(table) == 0
    third = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    assert _unsized(third.table(0)) == 0 and third.cache.misses == 0


def test_index_sizes_every_file_and_stores_the_table(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    tree = BlockTree(AtlasDataset(dataset), cache_bytes=0, store=TableStore(str(dataset)))
    for s in range(len(tree.source.shards)):
        assert _unsized(tree.table(s, sizes=True)) == 0
    again = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    reference = BlockTree(AtlasDataset(dataset))
    assert [(p, e) for p, e in again.walk("/")] == [(p, e) for p, e in reference.walk("/")]
    assert again.cache.misses == 0 and all(_unsized(again.table(s)) == 0 for s in range(2))


def test_a_listed_file_whose_example_cannot_be_encoded_fails_with_eio(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset, values=1000)  # json of ~20 KB: no locator, sized by encoding its example
    tree = BlockTree(AtlasDataset(dataset))
    shard = tree.source.shards[0]
    listing = tree.names(f"/{shard.name}")
    limit = shard.codec.max_block_bytes
    shard.codec.max_block_bytes = 1000  # block 0's files (16 x ~20 KB) no longer fit
    with pytest.raises(OSError) as info:
        for name, _, _ in listing[:16 * 3]:
            tree.lookup(f"/{shard.name}/{name}")
    assert info.value.errno == errno.EIO and "would take more than 1000 bytes" in str(info.value)
    shard.codec.max_block_bytes = limit
    with pytest.raises(OSError):  # the block stays failed (its txt files were sized by their locators)...
        last_of_block = tree.lookup(f"/{shard.name}/{listing[16 * 3 - 1][0]}")
        tree.read(last_of_block, 0, 10)
    last = tree.lookup(f"/{shard.name}/{listing[-1][0]}")  # ...and the others serve
    assert len(tree.read(last, 0, 1 << 20)) == last.size > 0


def test_serving_imports_no_module_lazily(tmp_path: Path) -> None:
    """A module imported on first use lands in some request's time (np.unique pulled in
    numpy.ma: 10-20 ms of a daemon's first listing). Everything serving needs is imported
    before the mount goes live."""
    dataset = tmp_path / "ds"
    _write(dataset)
    script = f"""
import sys
import atlasfs.fuse.mount  # what the daemon imports before it serves
from atlasfs import AtlasDataset
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.store import TableStore
dataset = AtlasDataset({str(dataset)!r})  # opened before the mount goes live
before = set(sys.modules)
for _ in range(2):  # building the tables, then loading them
    tree = BlockTree(dataset, store=TableStore(dataset.root))
    for shard, _, _ in tree.names("/"):
        for name, _, _ in tree.names("/" + shard):
            entry = tree.lookup(f"/{{shard}}/{{name}}")
            tree.read(entry, 0, entry.size)
    tree.table(1, sizes=True)
print(sorted(set(sys.modules) - before))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]", result.stdout


def test_a_reader_going_in_order_gets_the_next_blocks_read_ahead(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    BlockTree(AtlasDataset(dataset), cache_bytes=0, store=TableStore(str(dataset))).table(0, sizes=True)
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))  # lists and sizes from the store
    by_block: dict[int, list[str]] = {}
    for path, entry in BlockTree(AtlasDataset(dataset)).walk("/"):
        if entry.ref.shard == 0:
            by_block.setdefault(entry.ref.block, []).append("/" + path)
    for block in (0, 1):  # two blocks in order: blocks 2 and 3 are decoded and encoded meanwhile
        entry = tree.lookup(by_block[block][0])
        tree.read(entry, 0, entry.size)
    assert tree.blocks.readahead is not None
    wait_until(tree.blocks.readahead.idle)
    cached = {key: block for key, (block, _) in tree.cache._items.items() if len(key) == 2}  # not scratch
    # block 0: a reader's first read in a shard is read through its locator (it may be random)
    assert set(cached) == {(0, 1), (0, 2), (0, 3)}
    assert all(e is not None for e in cached[(0, 2)].encoded + cached[(0, 3)].encoded)
    misses = tree.cache.misses
    for path in by_block[2] + by_block[3]:
        entry = tree.lookup(path)
        tree.read(entry, 0, entry.size)
    wait_until(tree.blocks.readahead.idle)
    assert (0, 4) in tree.cache._items and tree.cache.misses == misses + 2  # blocks 4 and 5, ahead

    random_reader = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    for block in (5, 2, 3, 1):  # not in order (one step in order is chance): nothing read ahead
        entry = random_reader.lookup(by_block[block][0])
        random_reader.read(entry, 0, entry.size)
    assert random_reader.blocks.readahead is not None
    wait_until(random_reader.blocks.readahead.idle)
    assert random_reader.blocks.readahead.loaded == 0 and random_reader.cache.misses == 0  # through locators


def test_the_folder_cache_keeps_the_recently_listed_within_its_bound(tmp_path: Path, monkeypatch) -> None:
    import atlasfs.tree.listing as listing

    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=300, block_size=16) as writer:
        for i in range(300):  # three sub-folders of 100 files in one shard
            writer.add_example({"__key__": f"d{i % 3}/{i:04d}", "cls": i})
    tree = BlockTree(AtlasDataset(dataset))
    # a sub-folder's listing keeps its rows (4 bytes each) and counts one more
    monkeypatch.setattr(listing, "FOLDER_CACHE_ROWS", 250)  # room for two sub-folders' listings
    first = tree.names("/0/d0")
    assert list(first) == [(name, e.is_dir, e.ino) for name, e in tree.listdir("/0/d0")]
    cached = tree.folders.listings[(0, "d0")]
    tree.names("/0/d1")
    assert tree.names("/0/d0") == first  # from the cache, and now the most recently listed
    tree.names("/0/d2")  # pushes out the least recently listed: d1
    assert set(tree.folders.listings) == {(0, "d0"), (0, "d2")} and tree.folders.rows == 2 * 101
    assert tree.folders.listings[(0, "d0")] is cached
    with pytest.raises(TypeError):
        first[0] = ("x", False, 1)  # type: ignore[index]  # shared, so immutable
    assert first[-1] == first[99] and first[98:200] == list(first)[98:] and first[::50] == list(first)[::50]
    # listdir sized blocks in order: let the read-ahead thread it started end (test_readahead counts them)
    wait_until(lambda: not any(t.name == "atlasfs-readahead" for t in threading.enumerate()))


def test_a_build_caches_the_blocks_whose_files_are_not_stored_as_they_are(tmp_path: Path) -> None:
    """A table's build leaves out of the cache only blocks whose files are all located in runs
    of their stored bytes (read by preads); a compressed block's files would be decompressed
    again by their reads, so it stays cached, as every block did before."""
    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=64, block_size=16, compression_strategy=1) as writer:
        for i in range(64):
            writer.add_example({"txt": "word " * 200 + str(i), "bin": random.Random(i).randbytes(4000)})
    tree = BlockTree(AtlasDataset(dataset))
    shard = tree.source.shards[0]
    tree.names(f"/{shard.name}")
    table = tree.table(0)
    assert table.locators is not None and int(np.count_nonzero(table.locators.offset == NO_LOCATOR)) == 0
    assert sorted(block for _, block in tree.cache._items) == list(range(shard.num_blocks))
    assert tree.cache.misses == shard.num_blocks
