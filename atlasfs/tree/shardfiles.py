"""A shard's files with their bytes, block by block, without its file table: what
``atlasfs export`` writes.

A table is built for lookups: every file's row, the path-sorted order, the lookup index,
the locators of random reads. A pass that writes every file in order needs none of that:
each block is decoded once, its examples named by the same rules and the same
:class:`~atlasfs.formats.naming.KeyAssigner` a table is built with
(:meth:`~atlasfs.tree.table.blockrows.BlockRows.block_rows`), and its files encoded as a read
encodes them (:meth:`~atlasfs.tree.blocks.Blocks.example_of`), so the names and bytes
are the table's and the mount's. Memory is one decoded block at a time (through the
block cache), whatever the shard's size.
"""

from __future__ import annotations

from collections.abc import Iterator

from atlasfs.formats.naming import KeyAssigner
from atlasfs.tree.blocks import eio
from atlasfs.tree.table.layout import FILE
from atlasfs.tree.table.tables import Tables


def shard_files(tables: Tables, s: int) -> Iterator[tuple[str, bytes]]:
    """``(path in the shard folder, bytes)`` of every file of shard position ``s``, in example
    order. A shard that cannot be opened, or a block that cannot be decoded or encoded,
    raises :class:`~atlasfs.tree.base.Unreadable` (EIO) when the pass reaches it."""
    shard = tables.shards[s]
    blocks = tables.blocks
    if shard.error is not None:
        raise blocks.fail(s, -1, str(shard.error))
    tables.prepare(s)
    assigner = KeyAssigner(shard.key_width)
    for block in range(shard.num_blocks):
        rows, readable = tables.rows.block_rows(s, block, assigner, locate=False)
        if not readable:
            raise eio(blocks.failure(s, block))
        if not rows:
            continue
        decoded = blocks.decoded(s, block)
        pos, files = -1, ()
        for row in rows:
            if row[1] != FILE:
                continue
            if row[4] != pos:
                pos = row[4]
                files = blocks.example_of(decoded, s, block, pos)
            if row[5] >= len(files):  # a source's index that does not match its block
                raise blocks.mismatch(s, block)
            yield row[0], files[row[5]]
