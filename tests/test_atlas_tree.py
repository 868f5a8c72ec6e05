"""AtlasTree's caches: what a read decodes and encodes, and that the bound is kept."""

from __future__ import annotations

import errno
import random
from pathlib import Path

import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.atlas_tree import AtlasTree
from atlasfs.tablestore import TableStore


def _write(path: Path, examples: int = 200) -> None:
    rng = random.Random(3)
    with AtlasWriter(path, shard_size=100, block_size=16, compression_strategy=1) as writer:
        for i in range(examples):
            writer.add_example({"bin": rng.randbytes(300), "json": {"i": i, "v": [rng.random() for _ in range(20)]},
                                "txt": "x" * (i % 50)})


def test_a_read_on_a_stored_table_decodes_one_block_and_encodes_one_example(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    first = AtlasTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    expected = {path: first.read(entry, 0, entry.size) for path, entry in first.walk("/")}

    tree = AtlasTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    path = sorted(expected)[137]
    entry = tree.lookup("/" + path)
    assert tree.read(entry, 0, entry.size) == expected[path]
    assert (tree.blocks.misses, tree.files.misses) == (1, 1)  # the table came from the store
    # the other files of that example come from the encoded example, a neighbour from the decoded block
    for other in sorted(expected):
        if other.rpartition(".")[0] == path.rpartition(".")[0]:
            assert tree.read(tree.lookup("/" + other), 0, 1 << 20) == expected[other]
    assert (tree.blocks.misses, tree.files.misses) == (1, 1)
    # partial reads at every offset give the same bytes
    assert b"".join(tree.read(entry, offset, 7) for offset in range(0, entry.size, 7)) == expected[path]
    # every file, in a random order, is right
    order = sorted(expected)
    random.Random(5).shuffle(order)
    for other in order:
        assert tree.read(tree.lookup("/" + other), 0, 1 << 20) == expected[other], other


def test_both_caches_together_keep_the_bound(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset, 400)
    bound = 64 << 10
    tree = AtlasTree(AtlasDataset(dataset), cache_bytes=bound)
    assert tree.blocks.max_bytes + tree.files.max_bytes == bound
    for path, entry in tree.walk("/"):
        tree.read(entry, 0, entry.size)
        assert tree.blocks.current_bytes + tree.files.current_bytes <= bound
    assert tree.files.current_bytes > 0 and tree.blocks.current_bytes > 0


def test_a_block_that_cannot_be_decoded_fails_its_reads_with_eio_once_the_table_is_stored(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    first = AtlasTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    files = dict(first.walk("/"))
    tree = AtlasTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    # damage block 0 of shard 0 in memory only: its decode now fails
    shard = tree.dataset.shards[0]
    original = shard.decode_block

    def broken(block: int):  # type: ignore[no-untyped-def]
        if block == 0:
            from atlasfs.errors import AtlasFormatError
            raise AtlasFormatError(f"{shard.data_path} block 0: damaged")
        return original(block)

    shard.decode_block = broken  # type: ignore[method-assign]
    in_block_0 = [p for p, e in files.items() if e.ref.shard == 0 and e.ref.block == 0]
    elsewhere = [p for p, e in files.items() if e.ref.shard == 0 and e.ref.block == 1]
    for path in in_block_0:
        with pytest.raises(OSError) as info:
            tree.read(tree.lookup("/" + path), 0, 10)
        assert info.value.errno == errno.EIO and "block 0: damaged" in str(info.value)
    for path in elsewhere:
        assert tree.read(tree.lookup("/" + path), 0, 1 << 20) == first.read(files[path], 0, 1 << 20)
