"""A dataset whose examples come in an order no sort gives: unsorted keys, folders that come
back after other samples."""

from __future__ import annotations

from pathlib import Path

from atlasfs import AtlasWriter


#: Unsorted keys, and keys in folders that come back after other samples.
KEYS = ["zeta", "alpha", "mid", "beta", "d/9", "omega", "d/1", "e/f/2", "gamma", "d/5", "e/0", "a0"]


def shuffled_dataset(path: Path) -> Path:
    """An Atlas dataset of one shard at path: the KEYS in their order, a txt and a cls each."""
    with AtlasWriter(path, shard_size=len(KEYS), block_size=5, compression_strategy=1) as writer:
        writer.add_examples({"__key__": key, "txt": f"text of {key}", "cls": i} for i, key in enumerate(KEYS))
    return path
