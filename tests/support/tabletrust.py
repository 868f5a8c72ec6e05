"""Stored tables another user could write, for the tests of issue #35's points on tables: a
dataset, its tables in a folder, files and folders made nobody's, and locators forged
(tests/unit/tree/test_table_trust.py, tests/mount/test_hostile_tables.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.formats.atlas.spans.find import inline_check, stored_crc
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.filetable import FileTable, Locators
from atlasfs.tree.table.layout import FILE, INLINE, NO_LOCATOR
from atlasfs.tree.table.store import TableStore
from otheruser import NOBODY


def trust_examples(n: int) -> list[dict[str, Any]]:
    """Every kind of file: raw bytes and text (located runs), small ints and JSON (inline),
    a larger JSON (kept in the table)."""
    rng = np.random.default_rng(7)
    return [{"__key__": f"s{i:03d}", "jpg": rng.bytes(1500 + 10 * i), "txt": f"text {i} " * 40, "cls": i,
             "json": {"id": i}, "values.json": {"id": i, "values": rng.integers(100, 1000, 60).tolist()}}
            for i in range(n)]


def trust_dataset(path: Path, shards: int = 2) -> Path:
    """An Atlas dataset at path of `shards` shards of 12 such examples, blocks of 4."""
    with AtlasWriter(path, shard_size=12, block_size=4, compression_strategy=1) as writer:
        writer.add_examples(trust_examples(12 * shards))
    return path


def index_into(dataset: Path, folder: Path) -> None:
    """Every shard's table, every size known, stored in ``folder`` (what ``atlasfs index`` does)."""
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(folder)))
    for s in range(len(tree.shards)):
        tree.table(s, sizes=True)
    tree.source.close()


def nobodys(path: Path, mode: int | None = None) -> Path:
    """``path`` (a file, folder or link) given to ``nobody``, as if they had made it."""
    os.lchown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    if mode is not None:
        path.chmod(mode)
    return path


def fingerprints(shard: Path, block: int) -> list[int]:
    """What a block's fingerprint may be (spans/read.py): its frame's checksum, or the CRC-32
    of its stored bytes."""
    index = np.load(shard / "index.npy")
    stored = (shard / "data.bin").read_bytes()[int(index[block]):int(index[block + 1])]
    return [int.from_bytes(stored[-4:], "little"), stored_crc(stored)]


def forged_locators(table: FileTable, key: dict[str, Any], path: Path, shard: Path, size_of: int | None = None,
            size: int = 0, inline: bool = True) -> None:
    """``table`` (of the shard folder ``shard``) stored at ``path`` with every checksum right,
    lying: its first inline file's bytes changed (``inline``; its check made to match), and the
    file of row ``size_of`` (its locator dropped) said to be ``size`` bytes."""
    locators = table.locators
    assert locators is not None
    columns = {name: getattr(locators, name).copy() for name in ("offset", "length", "check", "prefix")}
    inline_bytes = bytearray(bytes(locators.inline))
    if inline:  # its check recomputed as a forger would: from the block's fingerprint, read from the data
        row = int(np.flatnonzero(columns["prefix"] == INLINE)[0])
        at, length = int(columns["offset"][row]), int(columns["length"][row])
        original = bytes(inline_bytes[at:at + length])
        fingerprint = next(f for f in fingerprints(shard, int(table.block[row]))
                           if inline_check(original, f) == int(columns["check"][row]))
        inline_bytes[at:at + length] = b"X" * length
        columns["check"][row] = inline_check(b"X" * length, fingerprint)
    sizes = np.array(table.size, dtype=np.uint64)
    if size_of is not None:
        sizes[size_of] = size
        columns["offset"][size_of], columns["length"][size_of], columns["prefix"][size_of] = NO_LOCATOR, 0, 0
    forged = FileTable(bytes(table._names), np.array(table._offsets), {
        "kind": np.array(table.kind), "size": sizes, "block": np.array(table.block), "pos": np.array(table.pos),
        "file": np.array(table.file), "by_path": np.array(table.by_path)})
    forged.state = table.state
    forged.locators = Locators(columns["offset"], columns["length"], columns["check"], columns["prefix"],
                               list(locators.prefixes), bytes(inline_bytes), bytes(locators.kept),
                               np.array(locators.kept_ends))
    forged.save(str(path), key)


def jpg_row(table: FileTable) -> int:
    """The row of the table's first .jpg file."""
    return next(i for i in range(len(table)) if table.kind[i] == FILE and table.entry_path(i).endswith(".jpg"))
