"""``read_atlas``: a dataset of any format atlasfs reads as a ``ray.data.Dataset`` of samples.

A sample is what the mount shows of it (:func:`~atlasfs.commands.packexamples.shard_samples`):
``__key__`` and one column per file suffix holding the file's bytes (None where a sample has
no such file), or with ``decode=True`` the value webdataset's default decoders give
(``.cls`` int, ``.txt`` str, ``.json``, ``.npy``, ``.npz``; other fields stay bytes). One read
task per shard, each opening the dataset itself and yielding its samples in order in blocks
of :data:`ROWS_PER_BLOCK`; the dataset's order is kept where Ray keeps order
(``DataContext.execution_options.preserve_order``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from atlasfs.commands.packexamples import DECODERS, shard_samples
from atlasfs.errors import AtlasFormatError
from atlasfs.formats.factory import SourceOptions, open_source
from atlasfs.storage import StorageOptions, set_default_options

#: Samples a read task puts in one Ray block.
ROWS_PER_BLOCK = 1024
#: Bytes of decoded Atlas blocks a read task caches.
CACHE_BYTES = 64 << 20


class AtlasDatasource(Datasource):
    """The shards of ``path`` (any format atlasfs reads, a folder or an ``s3://``... URL)."""

    def __init__(self, path: str, decode: bool = False, format: str | None = None,
                 options: SourceOptions | None = None, storage: StorageOptions | None = None) -> None:
        self.path = path if "://" in path else os.path.abspath(path)
        self.decode, self.format = decode, format
        self.options, self.storage = options or SourceOptions(), storage or StorageOptions()
        set_default_options(self.storage)
        with open_source(self.path, format, self.options) as source:
            self.kind = source.kind
            self.shards = [shard.name for shard in source.shards]

    def estimate_inmemory_data_size(self) -> int | None:
        return None

    def get_name(self) -> str:
        return "Atlas"

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context: Any = None) -> list[ReadTask]:
        """One task per shard, whatever ``parallelism`` asks: a shard is read whole, in order."""
        tasks = []
        for s, name in enumerate(self.shards):
            metadata = BlockMetadata(num_rows=None, size_bytes=None, exec_stats=None, input_files=(name,))
            read = _Reader(self.path, self.kind, self.options, self.storage, s, self.decode)
            tasks.append(ReadTask(read, metadata, per_task_row_limit=per_task_row_limit))
        return tasks


class _Reader:
    """A read task's work (picklable): one shard's samples as Arrow tables."""

    def __init__(self, path: str, kind: str, options: SourceOptions, storage: StorageOptions, s: int,
                 decode: bool) -> None:
        self.path, self.kind, self.options, self.storage = path, kind, options, storage
        self.s, self.decode = s, decode

    def __call__(self) -> Iterator[pa.Table]:
        from atlasfs.tree.base import Unreadable
        from atlasfs.tree.blocktree import BlockTree
        set_default_options(self.storage)
        with open_source(self.path, self.kind, self.options) as source:
            tree = BlockTree(source, cache_bytes=CACHE_BYTES, log_failures=False)
            shard = tree.shards[self.s]
            try:
                if shard.error is not None:
                    raise shard.error
                shard.prepare()
                count = sum(shard.block_length(b) for b in range(shard.num_blocks))
                rows: list[dict[str, Any]] = []
                for key, files in shard_samples(tree, self.s, 0, count):
                    rows.append({"__key__": key, **{suffix: self._value(suffix, data) for suffix, data in files}})
                    if len(rows) == ROWS_PER_BLOCK:
                        yield _table(rows, self.decode)
                        rows = []
                if rows:
                    yield _table(rows, self.decode)
            except Unreadable as exc:
                raise AtlasFormatError(f"{self.path}: shard {shard.name}: {exc.cause}") from None

    def _value(self, suffix: str, data: bytes) -> Any:
        if not self.decode:
            return data
        decoder = DECODERS.get(suffix.rsplit(".", 1)[-1].lower())
        if decoder is None:
            return data
        try:
            return decoder(data)
        except Exception:  # noqa: BLE001 (bytes no decoder takes stay bytes, as webdataset's decode leaves them)
            return data


def _table(rows: list[dict[str, Any]], decode: bool) -> Any:
    """A block of ``rows``: an Arrow table of a binary column per field (bytes), or a
    pandas frame of Python values (decoded: Ray keeps what Arrow cannot type)."""
    columns = list(dict.fromkeys(name for row in rows for name in row))
    if decode:
        import pandas as pd
        return pd.DataFrame({name: [row.get(name) for row in rows] for name in columns}, columns=columns)
    return pa.table({name: pa.array([row.get(name) for row in rows], type=pa.string() if name == "__key__"
                                    else pa.binary()) for name in columns})


def read_atlas(path: str, decode: bool = False, *, format: str | None = None, options: SourceOptions | None = None,
               storage: StorageOptions | None = None, **read_args: Any) -> Any:
    """``path`` (any format atlasfs reads: an Atlas folder, WebDataset tars, Dolma, Lavender,
    ``.pbin``; a folder or an ``s3://``... URL) as a ``ray.data.Dataset`` of samples, one row
    each: ``__key__`` and each file's bytes by its suffix (decoded with ``decode``). One read
    task per shard; ``read_args`` go to ``ray.data.read_datasource`` (``concurrency``...)."""
    import ray.data
    return ray.data.read_datasource(AtlasDatasource(path, decode, format, options, storage), **read_args)
