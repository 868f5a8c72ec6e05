"""What the loader tests share (tests/unit/tree/test_indexes.py, tests/mount/test_loader_indexes.py,
tests/loaders/test_loaders_real.py): the Atlas dataset they read (samples of random bytes as ``jpg`` with a ``cls`` and a ``json``, in
small blocks), and what an energon ``index.sqlite`` holds."""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

from atlasfs import AtlasWriter
from atlasfs.tree.tarview import TarView
from fusemount import atlasfs


def loader_dataset(path: Path, seed: int, examples: int = 120, shard_size: int = 50, odd_keys: bool = False) -> Path:
    """Write it at ``path``: keys in a shuffled order; ``odd_keys``: one long key and one
    non-ASCII key in a sub-folder, which take pax headers in a tar."""
    rng = random.Random(seed)
    keys = [f"k{i:04d}" for i in range(examples)]
    rng.shuffle(keys)
    if odd_keys:
        keys[3], keys[8] = "x" * 120, "ünï/" + keys[8]
    with AtlasWriter(path, shard_size=shard_size, block_size=6, compression_strategy=1) as writer:
        for i, key in enumerate(keys):
            writer.add_example({"__key__": key, "jpg": rng.randbytes(rng.randrange(1, 3000)), "cls": i,
                                "json": {"i": i}})
    return path


def sqlite_rows(path: Path) -> tuple[list, list, list]:
    """An energon ``index.sqlite``'s schema (in order) and its sample and part rows (sorted)."""
    db = sqlite3.connect(f"file:{path}?mode=ro&immutable=1", uri=True)
    try:
        return (list(db.execute("SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY rowid")),
                sorted(db.execute("SELECT * FROM samples")), sorted(db.execute("SELECT * FROM sample_parts")))
    finally:
        db.close()


def indexes_dataset(path: Path, examples: int = 120, shard_size: int = 50, odd_keys: bool = True) -> Path:
    """The index tests' dataset: ``loader_dataset`` of seed 7, odd keys by default."""
    return loader_dataset(path, 7, examples, shard_size, odd_keys)


def export_tars(dataset: Path, out: Path) -> None:
    """``atlasfs export`` of the dataset into ``out``; it must succeed."""
    result = atlasfs("export", str(dataset), str(out))
    assert result.returncode == 0, result.stderr


def view_read(view: TarView, path: str) -> bytes:
    """A file of the tar view read whole (asking for more than its size gives its size)."""
    entry = view.lookup(path)
    data = view.read(entry, 0, entry.size + 10)
    assert len(data) == entry.size
    return data
