"""``write_atlas``: a ``ray.data.Dataset`` of samples written as an Atlas v1 dataset that the
reference reader and ``atlasfs mount`` read, with ``pack``'s options.

The rows are cut into blocks of exactly ``shard_size`` (Ray's strict repartition, the dataset's
order kept), each written by a write task as one shard (the writer's
:class:`~atlasfs.formats.atlas.writer.ShardWriter`, the reference writer's rules) into a
hidden folder beside the target; once every task is done the driver names the shards in
the dataset's order (task, then shard within it) with the padded names of the last one's
number, writes the root ``meta.json`` last and renames the folder into place: a reader never
sees half a dataset, and a failed write leaves nothing at ``path``.

A row is an example: ``__key__`` (kept where it names the sample as the mount would show
it; the reader's rules give others their index key) and its fields, bytes or any value
the Atlas format pickles. Strategy 2 (the default) trains its one dictionary first, on the
driver, from the blocks of the first ``shard_size`` rows (the first shard, as the reference
writer does: those rows are computed twice), and hands it to every task.
"""

from __future__ import annotations

import os
import pickle
import shutil
import sys
import uuid
from typing import Any

import zstandard
from ray.data.datasource import Datasink

from atlasfs.formats.atlas.dataset import DICT_NAME
from atlasfs.formats.atlas.meta import FORMAT_VERSION, CompressionStrategy, RootMeta
from atlasfs.formats.atlas.writer import PICKLE_PROTOCOL, ShardWriter, _train_dictionary, shard_name_width

#: Examples per shard when not told (the reference writer's ``shard_size`` must be given).
SHARD_SIZE = 10_000


def _rows(block: Any) -> list[dict[str, Any]]:
    """A Ray block (Arrow table or pandas frame) as examples, without the fields a row lacks."""
    from ray.data.block import BlockAccessor
    # field names interned: a block's pickle names each once (as examples made with literal keys)
    return [{sys.intern(k): v for k, v in row.items() if v is not None or k == "__key__"}
            for row in BlockAccessor.for_block(block).iter_rows(public_row_format=True)]


class AtlasDatasink(Datasink):
    """Writes Atlas shards from Ray's write tasks (see the module's docstring)."""

    def __init__(self, path: str, shard_size: int = SHARD_SIZE, block_size: int = 64,
                 strategy: int = int(CompressionStrategy.SHARED_DICTIONARY_COMPRESSION), level: int = 3,
                 dict_size: float = 0.01, shared: bytes | None = None) -> None:
        if shard_size < 1 or block_size < 1 or strategy not in range(4):
            raise ValueError("shard_size and block_size must be at least 1, strategy 0, 1, 2 or 3")
        self.path = os.path.abspath(path)
        if os.path.lexists(self.path):
            raise FileExistsError(f"{self.path}: already exists (write_atlas writes a new dataset there)")
        parent, name = os.path.split(self.path)
        self.folder = os.path.join(parent, f".{name}.write-{uuid.uuid4().hex[:8]}")
        self.shard_size, self.block_size, self.level, self.dict_size = shard_size, block_size, level, dict_size
        self.strategy = strategy
        if strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION and shared is None:
            self.strategy = int(CompressionStrategy.STANDARD_COMPRESSION)  # none could be trained
        self.shared = shared

    def get_name(self) -> str:
        return "Atlas"

    @property
    def min_rows_per_write(self) -> int:
        """Ray gathers a shard's worth of rows at least for each write task."""
        return self.shard_size

    def on_write_start(self, schema: Any = None) -> None:
        os.mkdir(self.folder)

    def write(self, blocks: Any, ctx: Any) -> list[tuple[str, int, int]]:
        """Write this task's rows as shards ``<task>-<n>``; ``(folder, examples, strategy)`` of each."""
        shared = zstandard.ZstdCompressionDict(self.shared) if self.shared is not None else None
        written: list[tuple[str, int, int]] = []
        writer: ShardWriter | None = None
        try:
            for block in blocks:
                for example in _rows(block):
                    if writer is None or writer.stored == self.shard_size:
                        if writer is not None:
                            written.append(self._close(writer))
                        name = f"{ctx.task_idx:08d}-{len(written):06d}"
                        writer = ShardWriter(os.path.join(self.folder, name), self.block_size,
                                             CompressionStrategy(self.strategy), self.level, self.dict_size, shared)
                    writer.add(example)
            if writer is not None:
                written.append(self._close(writer))
                writer = None
        finally:
            if writer is not None:
                writer.abort()
        return written

    @staticmethod
    def _close(writer: ShardWriter) -> tuple[str, int, int]:
        meta = writer.close()
        with open(os.path.join(writer.path, "meta.json"), "w") as f:
            f.write(meta.to_json())
        return os.path.basename(writer.path), meta.stored_examples, int(meta.compression_strategy)

    def on_write_complete(self, write_result: Any) -> None:
        """Name the shards in order, the root ``meta.json`` last, then the folder into place."""
        shards = sorted(s for task in write_result.write_returns for s in task)
        if not shards:  # an empty dataset is one empty shard, as the reference writer's
            shards = [self._close(ShardWriter(os.path.join(self.folder, "0"), self.block_size,
                                              CompressionStrategy.STANDARD_COMPRESSION, self.level, self.dict_size,
                                              None))]
        width = shard_name_width(len(shards))
        for i, (name, _, _) in enumerate(shards):
            os.rename(os.path.join(self.folder, name), os.path.join(self.folder, str(i).zfill(width)))
        strategy = self.strategy
        if strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION:
            with open(os.path.join(self.folder, DICT_NAME), "wb") as f:
                f.write(self.shared or b"")
        root = RootMeta(FORMAT_VERSION, tuple(n for _, n, _ in shards), CompressionStrategy(strategy))
        with open(os.path.join(self.folder, "meta.json"), "w") as f:
            f.write(root.to_json())
        if os.path.lexists(self.path):
            raise FileExistsError(f"{self.path}: appeared while the dataset was being written")
        os.rename(self.folder, self.path)

    def on_write_failed(self, error: Exception) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def train_shared(dataset: Any, shard_size: int, block_size: int, level: int, dict_size: float) -> bytes | None:
    """Strategy 2's dictionary: trained on the blocks of the first ``shard_size`` rows of
    ``dataset`` (pickled as the shard writer pickles them); None if zstd trains none."""
    rows = [example for batch in dataset.limit(shard_size).iter_batches(batch_format="pyarrow", batch_size=None)
            for example in _rows(batch)]
    blocks = [pickle.dumps(rows[i:i + block_size], protocol=PICKLE_PROTOCOL) for i in range(0, len(rows), block_size)]
    trained = _train_dictionary(blocks, dict_size, level)
    return None if trained is None else trained.as_bytes()


def write_atlas(dataset: Any, path: str, *, shard_size: int = SHARD_SIZE, block_size: int = 64,
                strategy: int = int(CompressionStrategy.SHARED_DICTIONARY_COMPRESSION), level: int = 3,
                dict_size: float = 0.01, **write_args: Any) -> None:
    """Write ``dataset`` (rows of ``__key__`` and fields) as an Atlas dataset at ``path``
    (which must not exist), with ``pack``'s options; ``write_args`` go to
    ``Dataset.write_datasink`` (``concurrency``...)."""
    shared = None
    if strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION:
        shared = train_shared(dataset, shard_size, block_size, level, dict_size)
    # blocks of exactly shard_size rows (the last one fewer), a write task each: every shard
    # but the last holds shard_size examples, as the reference writer's
    dataset = dataset.repartition(target_num_rows_per_block=shard_size, strict=True)
    dataset.write_datasink(AtlasDatasink(path, shard_size, block_size, strategy, level, dict_size, shared),
                           **write_args)
