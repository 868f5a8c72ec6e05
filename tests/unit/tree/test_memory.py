"""Memory a mount keeps: decoded blocks within the cache bound, nothing per file beyond the tables.

These count live objects, not RSS (RSS depends on the allocator and on what else ran in the
process; ``bench/memory.py`` measures it on a real mount). The daemon runs the cycle collector
seldom (``mount.GC_THRESHOLDS``), so anything decoded that ends up in a reference cycle stays in
memory long after its block left the cache: the tests run with the collector off to see it.
"""

from __future__ import annotations

import gc
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.tree.blocks import Block
from atlasfs.tree.blocktree import BlockTree
from threadwait import wait_until

SHARDS = 6
PER_SHARD = 160
BLOCK = 16
#: The field every test example carries (metadata: not shown as a file), to count them alive.
MARKER = "__memory_test__"


def _write(path: Path, strategy: int = 2) -> None:
    rng = np.random.default_rng(11)
    words = ["alpha", "beta", "gamma", "delta", "epsilon"]
    with AtlasWriter(path, shard_size=PER_SHARD, block_size=BLOCK, compression_strategy=strategy) as writer:
        for i in range(SHARDS * PER_SHARD):
            writer.add_example({MARKER: i, "npy": rng.random(256), "txt": " ".join(random.Random(i).choices(words, k=300)),
                                "json": {"i": i, "score": float(rng.random())}})


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("memory") / "ds"
    _write(path)
    return path


@contextmanager
def _collector_off() -> Iterator[None]:
    """No cycle collection inside: what a cycle keeps stays countable."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _live() -> tuple[int, int]:
    """(Block objects, decoded test examples) alive now, garbage awaiting collection included."""
    blocks = examples = 0
    for obj in gc.get_objects():
        kind = type(obj)
        if kind is Block:
            blocks += 1
        elif kind is dict and MARKER in obj:
            examples += 1
    return blocks, examples


def _capacity(tree: BlockTree) -> int:
    """Blocks the cache bound can hold at most (the cheapest block's decoded size), plus one being decoded."""
    smallest = min(shard.decode_block(b)[1] for shard in tree.source.shards for b in range(shard.num_blocks))
    return tree.cache.max_bytes // smallest + 1


def test_listing_every_shard_keeps_no_decoded_block_beyond_the_cache_bound(dataset: Path) -> None:
    tree = BlockTree(AtlasDataset(dataset), cache_bytes=96 << 10)  # a few blocks of a dataset ~30x larger
    capacity = _capacity(tree)
    assert capacity * 8 < SHARDS * PER_SHARD // BLOCK  # the dataset is far larger than the cache
    with _collector_off():
        for shard in tree.source.shards:
            assert len(tree.names(f"/{shard.name}")) == PER_SHARD * 3
        blocks, examples = _live()
    assert blocks <= capacity and examples <= capacity * BLOCK, (blocks, examples, capacity)


def test_reading_every_file_from_threads_keeps_no_decoded_block_beyond_the_cache_bound(dataset: Path) -> None:
    tree = BlockTree(AtlasDataset(dataset), cache_bytes=96 << 10)
    capacity = _capacity(tree)
    paths = [f"/{shard.name}/{name}" for shard in tree.source.shards for name, _, _ in tree.names(f"/{shard.name}")]
    threads = 4

    def read(k: int) -> None:
        for path in paths[k::threads]:
            entry = tree.lookup(path)
            tree.read(entry, 0, entry.size)

    with _collector_off():
        workers = [threading.Thread(target=read, args=(k,)) for k in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        assert tree.blocks.readahead is not None
        blocks, examples = _live()
    # read-ahead's thread ends once idle (tests/unit/tree/test_readahead.py counts such threads)
    wait_until(lambda: not any(t.name == "atlasfs-readahead" for t in threading.enumerate()))
    # threads may each hold one block they are reading beside what the cache holds
    assert blocks <= capacity + threads and examples <= (capacity + threads) * BLOCK, (blocks, examples, capacity)


def test_listings_and_lookups_keep_no_python_object_per_file(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a listing keeps is the shard's file table (numpy arrays and one blob of names) and
    its lookup index: a pass of ``ls -lR`` or ``find`` over any number of files leaves a number
    of Python objects that does not grow with them."""
    import atlasfs.tree.blocktree as blocktree

    monkeypatch.setattr(blocktree, "RECENT_ENTRIES", 64)  # the lookups' memo, bounded
    tree = BlockTree(AtlasDataset(dataset), cache_bytes=96 << 10)
    shards = [f"/{shard.name}" for shard in tree.source.shards]
    for shard in shards:  # tables built, every size learnt: listings then carry entries
        tree.table(tree.placement.by_name[shard[1:]], sizes=True)
    tree.cache.clear()
    gc.collect()
    before = len(gc.get_objects())
    files = 0
    for _ in range(2):  # a listing with attributes (READDIRPLUS), as the kernel asks, then every lookup
        for shard in shards:
            listing = tree.names(shard)
            for start in range(0, len(listing), 128):
                batch = tree.names(shard)[start:start + 128]
                assert all(entry is not None for entry in tree.known_entries(shard, start, start + len(batch)))
            for name, _, _ in listing:
                tree.lookup(f"{shard}/{name}")
                files += 1
    tree.cache.clear()
    gc.collect()
    grown = len(gc.get_objects()) - before
    assert files // 2 == SHARDS * PER_SHARD * 3
    assert grown < 2 * 64 + 20 * SHARDS, grown  # the memo's entries and refs, a listing object per folder


def test_listings_under_way_keep_few_windows_of_entries(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bridge keeps listings under way between their requests (no OPENDIR or RELEASEDIR
    says when one ends), but only the WINDOWS_KEPT most recently used keep their window of
    entries (~240 bytes each, KNOWN_WINDOW of them): listing every shard with attributes, as
    `tar` does, leaves that many windows, not one a shard."""
    from atlasfs.fuse import engine

    monkeypatch.setattr(engine, "WINDOWS_KEPT", 2)
    tree = BlockTree(AtlasDataset(dataset), cache_bytes=96 << 10)
    for shard in tree.source.shards:  # every size known: a listing hands attributes out
        tree.table(tree.placement.by_name[shard.name], sizes=True)
    bridge = engine.NativeBridge(tree)  # no session: no table attached, every listing Python's
    for shard in tree.source.shards:
        node = bridge.lookup(engine.ROOT, shard.name.encode())
        assert isinstance(node, tuple), node
        assert len(bridge.readdir(node[0], 0, 64, True)) == 64
    listings = list(bridge._listings.values())
    assert len(listings) == SHARDS and all(listing.plus for listing in listings)
    assert [bool(listing.window) for listing in listings] == [False] * (SHARDS - 2) + [True] * 2
    again = bridge.readdir(bridge.lookup(engine.ROOT, tree.source.shards[0].name.encode())[0], 64, 64, True)
    assert len(again) == 64 and all(entry[3] for entry in again)  # its window asked again: attributes


def test_blocks_are_decoded_a_few_at_a_time(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block being decoded is not in the cache yet (its pickle and its objects, beside
    each other): however many threads read, at most DECODERS are decoded at once."""
    import time

    import atlasfs.tree.blocks as blocks

    tree = BlockTree(AtlasDataset(dataset), cache_bytes=0)  # nothing cached: every read decodes
    running = [0, 0]  # now, most
    lock = threading.Lock()
    shard_type = type(tree.source.shards[0])
    decode = shard_type.decode_block

    def counted(self: object, block: int) -> object:
        with lock:
            running[0] += 1
            running[1] = max(running)
        time.sleep(0.002)
        try:
            return decode(self, block)  # type: ignore[arg-type]
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(shard_type, "decode_block", counted)
    workers = [threading.Thread(target=lambda k=k: [tree.blocks.decoded(k % SHARDS, b) for b in range(10)])
               for k in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert running[1] == blocks.DECODERS


def test_memory_freed_by_evictions_is_given_back(dataset: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Once blocks costing half the cache bound (at least TRIM_AFTER_MIN) have been evicted,
    the tree asks the allocator to give free pages back (atlasfs.memory.trim)."""
    import atlasfs.tree.blocks as blocks
    from atlasfs import memory

    calls = []
    monkeypatch.setattr(memory, "trim", lambda force=False: calls.append(force) or True)
    monkeypatch.setattr(blocks, "TRIM_AFTER_MIN", 64 << 10)
    tree = BlockTree(AtlasDataset(dataset), cache_bytes=96 << 10)
    shard = tree.source.shards[0]
    for block in range(shard.num_blocks):  # every block of the shard through the cache
        tree.blocks.decoded(0, block)
    evicted = tree.cache.evicted_bytes
    assert 1 <= len(calls) <= evicted // (64 << 10)


def test_free_memory_is_given_back_on_glibc() -> None:
    from atlasfs import memory

    if memory._glibc() is None:
        pytest.skip("not glibc")
    assert memory.trim(force=True)


def test_a_block_is_charged_what_its_objects_hold(tmp_path: Path) -> None:
    """A block's cost in the cache is what its decoded objects hold, not only its pickle's
    size: lists of floats take 9 bytes a float pickled and 32 in memory."""
    import tracemalloc

    path = tmp_path / "floats"
    rng = random.Random(5)
    with AtlasWriter(path, shard_size=64, block_size=64, compression_strategy=1) as writer:
        for i in range(64):
            writer.add_example({"json": {"i": i, "values": [rng.random() for _ in range(120)]}})
    tree = BlockTree(AtlasDataset(path), cache_bytes=64 << 20)
    shard = tree.source.shards[0]
    shard.decode_block(0)  # imports and first-use allocations out of the way
    gc.collect()
    tracemalloc.start()
    try:
        examples, pickled = shard.decode_block(0)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del examples
    tree.blocks.decoded(0, 0)
    cost = tree.cache.current_bytes
    assert held > 2 * pickled  # the case this is about
    assert 0.9 * held <= cost <= 1.5 * held, (cost, held, pickled)


def _rss() -> int:
    """This process's resident set (VmRSS), in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_listing_and_looking_up_300000_files_keeps_memory_within_the_resident_tables(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stored tables are mapped, and at most RESIDENT_TABLE_BYTES of them stay mapped: listing
    and looking up every file of 300,000 (stored tables of ~72 bytes a file) grows the process by
    the resident tables, not by the files: ~4 bytes a file (1.1 MB) when written. The code
    before (tables read into memory, names kept twice, a lookup index of Python hashes built
    per process) grew by 97 bytes a file here (29 MB)."""
    from fusemount import atlasfs

    import atlasfs.tree.table.tables as tables
    from atlasfs.tree.table.store import TableStore

    shards, per_shard = 12, 12_500
    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=per_shard, block_size=256, compression_strategy=1) as writer:
        writer.add_examples({"__key__": f"{i:07d}", "cls": i % 1000, "txt": f"w{i}"} for i in range(shards * per_shard))
    index = tmp_path / "index"
    result = atlasfs("index", str(dataset), "--index-dir", str(index))  # tables built, sized, stored
    assert result.returncode == 0, result.stderr
    stored = sum(p.stat().st_size for p in index.glob("*.table"))
    files = 2 * shards * per_shard
    bound = 4 << 20  # about two of these tables
    monkeypatch.setattr(tables, "RESIDENT_TABLE_BYTES", bound)
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(index)))
    folders = [f"/{name}" for name in tree.shard_folders()]
    tree.lookup(f"{folders[0]}/0000000.cls")  # first-use allocations out of the way
    gc.collect()
    before = _rss()
    seen = 0
    for _ in range(2):  # as find does: the listing with attributes, then a lookup of each file
        for folder in folders:
            listing = tree.names(folder)
            for start in range(0, len(listing), 256):
                assert all(entry is not None for entry in tree.known_entries(folder, start, start + 256))
            for name, _, _ in listing:
                tree.lookup(f"{folder}/{name}")
                seen += 1
    gc.collect()
    grown = _rss() - before
    assert seen == 2 * files and stored > 5 * bound  # the tables are far larger than what stays mapped
    assert tree.tables.tables.bytes <= bound
    assert grown < bound + (6 << 20), (grown, stored)
    assert grown / files < 25, grown / files  # bytes a file (the old code: ~64 plus twice its 11-byte path)
