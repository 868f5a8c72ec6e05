"""Atlas datasets: the format's metadata, block codec, reader and writer.

An Atlas dataset is a folder with a root ``meta.json`` and shard folders, each
with its own ``meta.json``, ``index.npy`` (where every block starts in
``data.bin``) and ``data.bin`` (pickled blocks of examples, zstd-compressed
or not). :class:`~.dataset.AtlasDataset` reads one and is its own
:class:`~atlasfs.formats.source.Source`.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from atlasfs.errors import AtlasFormatError
from atlasfs.storage import LOCAL, Storage, UnfitFileError, open_regular
from atlasfs.storage.files import listdir_or_empty

if TYPE_CHECKING:
    from atlasfs.formats.atlas.dataset import AtlasDataset
    from atlasfs.formats.factory import SourceOptions


def looks_like(path: str, storage: Storage = LOCAL) -> bool:
    """A folder with a root ``meta.json``, or shard folders holding ``data.bin`` or
    ``index.npy`` (an Atlas dataset whose root ``meta.json`` is lost: opening it then
    says so, rather than that it is no dataset)."""
    if storage.isfile(os.path.join(path, "meta.json")):
        return True
    children = [os.path.join(path, name) for name, is_dir in listdir_or_empty(storage, path) if is_dir]
    return any(storage.isfile(os.path.join(child, name)) for child in children for name in ("data.bin", "index.npy"))


def open_source(path: str, options: "SourceOptions", storage: Storage | None = None) -> "AtlasDataset":
    """Open the dataset for serving: a shard that cannot be opened stands as a broken
    shard (its ``error`` set: the tree fails its folder and tar with EIO and says why)
    while the others serve."""
    from atlasfs.formats.atlas.dataset import AtlasDataset
    # The tree caches encoded blocks itself; the index is read into memory because a
    # mapped index.npy truncated under us would kill the daemon (SIGBUS).
    dataset = AtlasDataset(path, cache_bytes=0, trust_pickle=options.trust_pickle, mmap_index=False,
                           tolerate_broken_shards=True, check_data_size=not options.lenient, storage=storage)
    if not dataset.storage.remote:
        _break_unreadable(dataset)
    return dataset


def _break_unreadable(dataset: "AtlasDataset") -> None:
    """Stand a broken shard for each shard whose ``data.bin`` cannot be opened for reading
    (no permission, not a file): opening the shard only looked at its size, and the mount
    would find out at the first listing, long after ``atlasfs mount`` returned."""
    from atlasfs.formats.atlas.dataset import BrokenShard
    for position, shard in enumerate(dataset.shards):
        if shard.error is not None or not shard.data_size:
            continue
        try:
            # never blocking: a FIFO standing for data.bin must not hang the mount
            os.close(open_regular(shard.data_path)[0])
        except UnfitFileError as exc:  # "data.bin: not a regular file (a FIFO)"
            problem: str | None = exc.strerror
        except OSError as exc:
            problem = f"cannot be read ({exc.strerror})"
        else:
            problem = None
        if problem is not None:
            broken = BrokenShard(shard.path, shard.number, AtlasFormatError(f"{shard.data_path}: {problem}"),
                                 len(shard))
            broken.first_index, broken.key_width = shard.first_index, shard.key_width
            dataset.shards[position] = broken
