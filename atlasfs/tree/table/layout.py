"""The file table's layout and its rows' node ids, stated once for Python and for C.

The native engine reads attached tables itself (``atlasfs/fuse/native/``: ``tables.c`` the
entry columns, ``located.c`` the locator columns, ``readpath.c`` a row's kind, size and block)
and names their rows by node ids it computes the same way: the kinds, sentinels, column
widths and node-id scheme below are what both sides agree on, and
``tests/unit/tree/test_table_layout.py`` checks that the C side's constants equal them.
"""

from __future__ import annotations

# -- the entry columns

#: An entry's kind (its ``kind`` column): a file, a folder, or the file standing for a block
#: that could not be decoded (``<index key>.unreadable``).
FILE, DIR, UNREADABLE = 0, 1, 2
#: A file's size (its ``size`` column) before its bytes have been encoded: a table can name
#: files before it knows how big they are (a listing needs no sizes).
UNKNOWN_SIZE = 2**64 - 1
#: ``(column, dtype, entries more than the rows)`` of the per-entry columns, in the order a
#: stored table holds them: ``offsets`` (where each path starts in the names, then where the
#: last ends), the entries' columns, ``by_path`` (rows sorted by path bytes), and the lookup
#: index (``hashes``: the paths' stable 64-bit hashes, sorted; ``hash_rows``: the row of each).
ENTRY_SECTIONS: tuple[tuple[str, str, int], ...] = (
    ("offsets", "<u8", 1), ("kind", "u1", 0), ("size", "<u8", 0), ("block", "<u4", 0), ("pos", "<u4", 0),
    ("file", "<u2", 0), ("by_path", "<u4", 0), ("hashes", "<u8", 0), ("hash_rows", "<u4", 0))

# -- the locator columns (optional: where a file's bytes can be read without its block)

#: ``(column, dtype)`` of the locator columns, in the order a stored table holds them.
LOCATOR_SECTIONS: tuple[tuple[str, str], ...] = (
    ("offset", "<u4"), ("length", "<u4"), ("check", "<u4"), ("prefix", "<u2"))
#: A row's locator offset when it has none.
NO_LOCATOR = 0xFFFFFFFF
#: A row's prefix number when its locator is inline (its offset is then in the inline bytes).
INLINE = 0xFFFF
#: A row's prefix number when its file is kept (its offset and length are then in the
#: decompressed frame of its block's kept files).
KEPT = 0xFFFE
#: Most bytes of an inline file.
INLINE_MAX = 255
#: Most bytes of a block's kept files, decompressed (C bounds its decompression by it too).
KEPT_BLOCK_MAX = 16 << 20
#: Bumped whenever the rules of which files get which locators change, so that stored tables
#: are rebuilt and gain them (part of a stored table's key: Python's only, C never reads keys).
#: 1: blocks with no frame checksum (strategy 0) of any size get inline and kept files (their
#: fingerprint is read once a block and remembered), not only those up to 256 KiB.
LOCATOR_RULES = 1

# -- node ids (inode numbers): a shard folder's and its table rows', computed, never stored

#: The mount's root folder (FUSE's root node id).
ROOT = 1
#: Bits of a node id below the shard: shard position ``s``'s folder is ``(s + 1) << ROW_BITS``,
#: row ``i`` of its table that plus ``1 + i``.
ROW_BITS = 32
#: Node ids from here on are shard folders and table rows; below, the folders above shards.
TABLE_NODES = 1 << ROW_BITS
#: The row part of a node id (the row plus one; 0 for the shard folder).
ROW_MASK = TABLE_NODES - 1


def shard_ino(s: int) -> int:
    """The node id of shard position ``s``'s folder."""
    return (s + 1) << ROW_BITS


def row_ino(s: int, row: int) -> int:
    """The node id of row ``row`` of shard position ``s``'s table."""
    return shard_ino(s) + 1 + row


def split_ino(ino: int) -> tuple[int, int]:
    """``(shard position, row)`` of a node id from :data:`TABLE_NODES` on; the row is -1 for
    the shard folder itself. Not checked against any shard or table: callers do."""
    return (ino >> ROW_BITS) - 1, (ino & ROW_MASK) - 1
