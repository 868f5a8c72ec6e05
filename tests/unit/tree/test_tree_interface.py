"""What the FUSE engine asks of the tree, through public calls: a shard's run of blocks read in
order (``BlockTree.in_order_run``) and a table's paths as columns (``FileTable.names``/``offsets``)."""

from __future__ import annotations

from pathlib import Path

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.store import TableStore


def _write(path: Path) -> None:
    with AtlasWriter(path, shard_size=96, block_size=8, compression_strategy=1) as writer:
        for i in range(192):
            writer.add_example({"__key__": f"k{i:04d}", "txt": f"text {i}", "cls": i % 5})


def test_in_order_run_counts_blocks_read_in_order_while_the_last_is_cached(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    tree = BlockTree(AtlasDataset(dataset))
    assert tree.in_order_run(0, 0) == 0  # nothing read yet
    for block in range(4):
        assert tree.block_files(0, block) is not None  # what the engine asks for: it reads the block
        assert tree.in_order_run(0, block) == block + 2  # block 0 follows the shard's start: a run of 2
        assert tree.in_order_run(1, block) == 0  # another shard's run is its own
    assert tree.in_order_run(0, 2) == 0  # not the last block read
    tree.block_files(0, 7)  # a jump starts a new run
    assert tree.in_order_run(0, 7) == 1
    uncached = BlockTree(AtlasDataset(dataset), cache_bytes=0)  # a block kept nowhere is no run
    for block in range(3):
        uncached.block_files(0, block)
    assert (0, 2) not in uncached.cache
    assert uncached.in_order_run(0, 2) == 0


def test_names_and_offsets_give_every_row_path_in_listing_order(tmp_path: Path) -> None:
    dataset = tmp_path / "ds"
    _write(dataset)
    built = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    listed = [name for name, _, _ in built.names("/1")]
    mapped = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset))).table(1)  # stored by the first
    assert mapped.path is not None  # mapped from its file: names is a view of the map
    for table in (built.table(1), mapped):
        names, offsets = table.names, table.offsets
        assert len(offsets) == len(table) + 1 and int(offsets[0]) == 0 and int(offsets[-1]) == len(names)
        paths = [bytes(names[int(a):int(b)]).decode() for a, b in zip(offsets[:-1], offsets[1:])]
        assert paths == listed
