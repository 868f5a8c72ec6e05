"""Datasets, exports and tables for the located-read tests (tests/unit/tree/test_located.py,
tests/mount/test_located_reads.py): what a read must give, and tables whose locators lie."""

from __future__ import annotations

import random
import tarfile
from pathlib import Path
from typing import Any

import numpy as np

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.commands import cli
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.filetable import FileTable, Limits, Locators
from atlasfs.tree.table.store import TableStore, table_file_name
from helpers import in_threads


Exported = dict[str, dict[str, bytes]]


def export_shards(dataset: Path, out: Path) -> Exported:
    """``atlasfs export``'s bytes: shard name -> member path -> bytes."""
    assert cli.main(["export", str(dataset), str(out)]) == 0
    exported: Exported = {}
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as t:
            exported[tar.name[:-len(".tar")]] = {m.name: t.extractfile(m).read()  # type: ignore[union-attr]
                                                for m in t.getmembers() if m.isfile()}
    return exported


def located_tree(dataset: Path, tables: Path, cache_bytes: int = 64 << 20) -> BlockTree:
    """A tree over the dataset (broken shards tolerated) whose tables are stored in `tables`."""
    return BlockTree(AtlasDataset(dataset, cache_bytes=0, mmap_index=False, tolerate_broken_shards=True),
                     cache_bytes=cache_bytes, store=TableStore(str(dataset), index_dir=str(tables)))


def index_tables(dataset: Path, tables: Path) -> None:
    """Build and store every shard's table, every size known (what ``atlasfs index`` does)."""
    tree = located_tree(dataset, tables)
    for s in range(len(tree.shards)):
        tree.table(s, sizes=True)
    tree.source.close()


def write_dataset(root: Path, examples: list[Any], strategy: int, block_size: int = 2, shard_size: int = 0) -> Path:
    """An Atlas dataset of these examples at root (one shard unless shard_size says)."""
    with AtlasWriter(root, shard_size=shard_size or len(examples), block_size=block_size,
                     compression_strategy=strategy) as writer:
        writer.add_examples(examples)
    return root


def random_examples(seed: int, n: int = 24) -> list[dict[str, Any]]:
    """Examples whose pickles have one layout whatever the seed (only run bytes differ),
    with every kind of file: raw bytes, text, an array, small ints, a small JSON (inline) and
    a larger one (kept: a dict of 60 numbers of 3 digits, about 330 bytes)."""
    rng = np.random.default_rng(seed)
    return [{"jpg": rng.bytes(2000 + 10 * i), "txt": "".join(rng.choice(list("abc"), 300 + i)),
             "npy": rng.random(50 + i), "cls": i, "json": {"id": i, "tag": "abc"[i % 3]},
             "values.json": {"id": i, "values": rng.integers(100, 1000, 60).tolist()}} for i in range(n)]


def stored_table(tmp_path: Path) -> tuple[Path, dict[str, Any], Limits, FileTable]:
    """A one-shard dataset's stored table with locators: its file, key, limits and the table."""
    dataset = write_dataset(tmp_path / "ds", random_examples(4), 2, shard_size=24)
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    table = tree.table(0)
    path = tmp_path / "tables" / table_file_name(tree.shards[0].name)
    assert path.exists() and table.locators is not None
    return path, tree.tables.table_key(0), Limits(tree.shards[0].num_blocks, tree.shards[0].block_size), table


def forged_table(table: FileTable, **changes: Any) -> FileTable:
    """The table with its locator columns changed: each change is applied to a copy."""
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


def read_through(mnt: Path, exported: Exported, readers: int = 4) -> list[str]:
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
