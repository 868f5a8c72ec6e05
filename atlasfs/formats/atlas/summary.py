"""What ``atlasfs info`` says of an Atlas dataset beyond any source's counts: each shard's
block size, strategy, ``data.bin`` bytes and compression ratio (from its blocks' zstd frame
headers, which are checked on the way), the root's strategy, the bytes on disk, and
``verify``'s note on ``shard_sizes``."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.atlas.meta import CompressionStrategy
from atlasfs.storage import UnfitFileError, open_regular

if TYPE_CHECKING:
    from atlasfs.formats.atlas.dataset import AtlasDataset, Shard

#: Shards of more blocks than this are summed up without reading their frame headers.
RATIO_MAX_BLOCKS = 100_000
#: Bytes of a zstd frame header that can hold its content size.
_FRAME_HEADER_MAX = 18


def decoded_size(shard: "Shard") -> int | None:
    """Sum of the blocks' decompressed sizes, from their zstd frame headers (None if a
    frame does not record it). Raises :class:`AtlasFormatError` for a bad header."""
    if shard.meta.compression_strategy == CompressionStrategy.NO_COMPRESSION:
        return shard.data_size
    ranges = [(int(shard.index[b]), min(_FRAME_HEADER_MAX, shard.stored_block_size(b))) for b in range(shard.num_blocks)]
    if shard.storage.remote:  # the headers of every block, in a few coalesced GETs
        headers = shard.storage.read_ranges(shard.data_path, ranges)
    else:
        try:  # a regular file, opened without blocking (a FIFO in its place is refused at once)
            fd, _ = open_regular(shard.data_path)
        except UnfitFileError as exc:
            raise AtlasFormatError(str(exc)) from None
        except OSError as exc:
            raise AtlasFormatError(f"{shard.data_path}: cannot read ({exc.strerror})") from None
        try:
            headers = [os.pread(fd, size, start) for start, size in ranges]
        finally:
            os.close(fd)
    total: int | None = 0
    for b, header in enumerate(headers):
        size = shard.codec.check_header(header, f"{shard.data_path} block {b}")
        total = None if total is None or size < 0 else total + size
    return total


def shard_summary(shard: "Shard") -> dict[str, object]:
    """The shard's columns of ``info``; its frame headers checked unless it has more than
    :data:`RATIO_MAX_BLOCKS` blocks (raises :class:`AtlasFormatError` for a bad one)."""
    decoded = decoded_size(shard) if shard.num_blocks <= RATIO_MAX_BLOCKS else None
    shard.decoded_bytes = decoded
    ratio = f"{decoded / shard.data_size:.2f}" if decoded is not None and shard.data_size else "-"
    return {"block_size": shard.meta.block_size, "strategy": int(shard.meta.compression_strategy),
            "data.bin": shard.data_size, "ratio": ratio}


def _stored_bytes(dataset: "AtlasDataset") -> int:
    """Bytes of every file under the dataset's root (objects, for one in a bucket)."""
    total = 0
    if not dataset.storage.remote:
        for folder, _, files in os.walk(dataset.root):
            for name in files:
                try:
                    total += os.lstat(os.path.join(folder, name)).st_size
                except OSError:
                    pass
        return total
    folders = [dataset.root]
    while folders:
        folder = folders.pop()
        for name, is_dir in dataset.storage.listdir(folder):
            path = f"{folder}/{name}"
            if is_dir:
                folders.append(path)
            else:
                total += (dataset.storage.stat(path) or (0, 0))[0]
    return total


def dataset_info(dataset: "AtlasDataset") -> list[str]:
    """The dataset's lines of ``info``: its root strategy, bytes on disk, and the decoded
    bytes and ratio of the shards :func:`shard_summary` has summed up (all, or none said)."""
    strategy = dataset.meta.compression_strategy
    summed = [s for s in dataset.shards if s.error is None and hasattr(s, "decoded_bytes")]
    stored = sum(s.data_size for s in summed)
    lines = [f"strategy     {int(strategy)} ({strategy.name.lower()}) at the root",
             f"on disk      {_stored_bytes(dataset)} bytes ({stored} in data.bin files)"]
    if summed and stored and all(s.decoded_bytes is not None for s in summed):
        total = sum(s.decoded_bytes or 0 for s in summed)
        lines.append(f"decoded      {total} bytes of pickle (compression ratio {total / stored:.2f})")
    return lines


def shard_sizes_note(dataset: "AtlasDataset") -> list[str]:
    """``verify``'s note when the root's ``shard_sizes`` differ from the shards' own counts
    (informational: the shards' counts are used)."""
    sizes = [len(s) for s in dataset.shards]
    if any(s.error is not None for s in dataset.shards) or list(dataset.meta.shard_sizes) == sizes:
        return []
    return [f"{os.path.join(dataset.root, 'meta.json')}: shard_sizes {list(dataset.meta.shard_sizes)} differ from "
            f"the shards' stored_examples {sizes} (informational only; the shards' values are used)"]
