"""The built-in demo dataset: small, image-like, labelled, dictionary-compressed."""

from __future__ import annotations

import os
import random
import zlib
from typing import Any

from atlasfs.formats.atlas.writer import AtlasWriter

LABELS = ["cat", "dog", "bird", "fish", "horse"]


def _fake_png(rng: random.Random, size: int) -> bytes:
    """A small valid PNG with random-looking pixels (images-like bytes without Pillow)."""
    width = height = size

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    rows = b"".join(b"\x00" + bytes(rng.getrandbits(8) for _ in range(width * 3)) for _ in range(height))
    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def demo_examples(count: int = 200, seed: int = 0) -> list[dict[str, Any]]:
    """WebDataset-style examples: ``png`` bytes, ``cls`` label, ``json`` metadata."""
    rng = random.Random(seed)
    examples = []
    for i in range(count):
        label = rng.randrange(len(LABELS))
        examples.append({
            "__key__": f"{LABELS[label]}/sample{i:04d}",
            "png": _fake_png(rng, 16),
            "cls": label,
            "json": {"label": LABELS[label], "source": "atlasfs demo", "index": i, "width": 16, "height": 16},
        })
    return examples


def write_demo(path: str | os.PathLike[str], count: int = 200) -> None:
    """Write the demo dataset at ``path``: 4 shards of 50, blocks of 5, shared dictionary."""
    with AtlasWriter(path, shard_size=50, block_size=5, compression_strategy=2) as writer:
        writer.add_examples(demo_examples(count))
