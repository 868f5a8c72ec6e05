"""Writing Atlas v1 datasets that the reference reader reads.

The layout is the reference writer's (EIDOSLAB/torch-atlas-ds v0.1.0): the
same file names, meta keys, index dtypes, zero-padded shard folders,
dictionary training, and every fall-back:

* a shard with fewer than 7 blocks cannot train a dictionary and is written
  with strategy 1; under strategy 2 this happens to the first shard, whose
  dictionary becomes the shared one, so the whole dataset (root included)
  falls back to 1; under strategy 3 only that shard does and the root keeps 3.

Three deliberate differences: frames carry zstd checksums, so corruption
is detected on read; the write is atomic (everything goes to a hidden
temporary folder beside the target, renamed into place by :meth:`close`, and
removed if the write fails), and a shard whose dictionary cannot be trained
(zstd refuses samples that are too small) falls back to strategy 1 instead
of crashing.
"""

from __future__ import annotations

import bisect
import os
import pickle
import shutil
import tempfile
from typing import Any, Iterable

import numpy as np
import zstandard

from atlasfs.formats.atlas.dataset import DICT_NAME
from atlasfs.formats.atlas.meta import FORMAT_VERSION, CompressionStrategy, RootMeta, ShardMeta

#: Blocks are pickled with protocol 4, the reference's default on Python 3.8-3.13.
PICKLE_PROTOCOL = 4
#: zstd needs at least this many samples (blocks) to train a dictionary.
MIN_BLOCKS_FOR_DICTIONARY = 7
_INDEX_DTYPES = (np.uint8, np.uint16, np.uint32, np.uint64)


def index_dtype(data_size: int) -> type[np.unsignedinteger[Any]]:
    """The smallest unsigned dtype whose maximum is >= ``data_size`` (the reference's rule)."""
    limits = [np.iinfo(t).max for t in _INDEX_DTYPES]
    position = bisect.bisect_left(limits, data_size)
    if position == len(limits):
        raise ValueError("shard too large: data.bin must be smaller than 2**64 bytes")
    return _INDEX_DTYPES[position]


def shard_name_width(shards: int) -> int:
    """Digits of the shard folder names of a dataset of ``shards`` shards (the last one's)."""
    return len(str(max(shards, 1) - 1))


def _compressor(level: int, dictionary: zstandard.ZstdCompressionDict | None = None) -> zstandard.ZstdCompressor:
    # Frame checksums (4 bytes a block) let readers detect corrupted data
    # instead of unpickling it; every zstd reader, the reference's included,
    # verifies them.
    return zstandard.ZstdCompressor(level=level, dict_data=dictionary, write_checksum=True)


def _train_dictionary(blocks: list[bytes], fraction: float, level: int) -> zstandard.ZstdCompressionDict | None:
    if len(blocks) < MIN_BLOCKS_FOR_DICTIONARY:
        return None
    size = max(int(fraction * sum(len(b) for b in blocks)) + 1, 1024)
    try:
        return zstandard.train_dictionary(size, blocks, level=level)
    except zstandard.ZstdError:
        return None


class ShardWriter:
    """Writes one shard folder (``atlasfs pack`` writes shards with it in parallel). Under strategy 3 blocks stay in memory until
    :meth:`close`, because the dictionary is trained on all of them."""

    def __init__(self, path: str, block_size: int, strategy: CompressionStrategy, level: int,
                 dict_fraction: float, shared_dict: zstandard.ZstdCompressionDict | None) -> None:
        self.path = path
        self.block_size = block_size
        self.strategy = strategy
        self.level = level
        self.dict_fraction = dict_fraction
        self.stored = 0
        self.trained_dict: zstandard.ZstdCompressionDict | None = None
        self._current: list[Any] = []
        self._pending: list[bytes] = []
        self._offsets: list[int] = []
        self._size = 0
        self._data: Any = None
        os.mkdir(path)
        if strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION:
            self._compressor = _compressor(level, shared_dict)
        elif strategy == CompressionStrategy.STANDARD_COMPRESSION:
            self._compressor = _compressor(level)

    def add(self, example: Any) -> None:
        """Append one example."""
        self._current.append(example)
        self.stored += 1
        if len(self._current) == self.block_size:
            self._flush_block()

    def _flush_block(self) -> None:
        pickled = pickle.dumps(self._current, protocol=PICKLE_PROTOCOL)
        self._current = []
        if self.strategy == CompressionStrategy.DICTIONARY_COMPRESSION:
            self._pending.append(pickled)
        elif self.strategy == CompressionStrategy.NO_COMPRESSION:
            self._write(pickled)
        else:
            self._write(self._compressor.compress(pickled))

    def _write(self, block: bytes) -> None:
        if self._data is None:
            self._data = open(os.path.join(self.path, "data.bin"), "wb")
        self._offsets.append(self._size)
        self._size += len(block)
        self._data.write(block)

    def close(self) -> ShardMeta:
        """Write the last block, the dictionary (strategy 3) and ``index.npy``; the meta to record."""
        if self._current:
            self._flush_block()
        if self.strategy == CompressionStrategy.DICTIONARY_COMPRESSION:
            self.trained_dict = _train_dictionary(self._pending, self.dict_fraction, self.level)
            if self.trained_dict is None:
                self.strategy = CompressionStrategy.STANDARD_COMPRESSION
                compressor = _compressor(self.level)
            else:
                with open(os.path.join(self.path, DICT_NAME), "wb") as f:
                    f.write(self.trained_dict.as_bytes())
                compressor = _compressor(self.level, self.trained_dict)
            for pickled in self._pending:
                self._write(compressor.compress(pickled))
            self._pending = []
        if self._data is not None:
            self._data.close()
        index = np.array(self._offsets + [self._size], dtype=index_dtype(self._size))
        np.save(os.path.join(self.path, "index.npy"), index, allow_pickle=False)
        return ShardMeta(FORMAT_VERSION, self.block_size, self.stored, self.strategy, self.level,
                         self.dict_fraction)

    def abort(self) -> None:
        """Close the data file (the caller removes the folder)."""
        if self._data is not None:
            self._data.close()


class AtlasWriter:
    """Write an Atlas v1 dataset at ``path`` (which must not exist yet).

    Use as a context manager, or call :meth:`close` at the end; until then
    nothing appears at ``path``. If the ``with`` body raises, the partial
    dataset is removed.

    Parameters (the reference's names and defaults):
        shard_size: examples per shard.
        block_size: examples per block (the unit of compression and of reads).
        compression_strategy: 0 none, 1 zstd, 2 one dictionary trained on the
            first shard and shared (default), 3 one dictionary per shard.
        compression_level: zstd level.
        compression_dict_size: dictionary size as a fraction of the shard's
            uncompressed bytes (at least 1 KiB).
    """

    def __init__(self, path: str | os.PathLike[str], shard_size: int, block_size: int,
                 compression_strategy: int = CompressionStrategy.SHARED_DICTIONARY_COMPRESSION,
                 compression_level: int = 3, compression_dict_size: float = 0.01) -> None:
        if shard_size < 1 or block_size < 1:
            raise ValueError("shard_size and block_size must be >= 1")
        if not 0.0 <= compression_dict_size <= 1.0:
            raise ValueError("compression_dict_size must be between 0 and 1")
        self.path = os.path.abspath(os.fspath(path))
        self.shard_size = shard_size
        self.block_size = block_size
        self.strategy = CompressionStrategy(compression_strategy)
        self.level = compression_level
        # Recorded as given, like the reference: 0 or 1 is written as 0 / 1, not 0.0 / 1.0.
        size = compression_dict_size
        self.dict_fraction = size if type(size) is int else float(size)
        if os.path.lexists(self.path):
            raise FileExistsError(f"{self.path}: already exists")
        parent, name = os.path.split(self.path)
        self._tmp = tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=parent)
        self._shard_sizes: list[int] = []
        self._shared_dict: zstandard.ZstdCompressionDict | None = None
        self._closed = False
        self._shard = self._new_shard()

    def _new_shard(self) -> ShardWriter:
        strategy = self.strategy
        if strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION and self._shared_dict is None:
            strategy = CompressionStrategy.DICTIONARY_COMPRESSION  # train on the first shard
        path = os.path.join(self._tmp, str(len(self._shard_sizes)))
        return ShardWriter(path, self.block_size, strategy, self.level, self.dict_fraction, self._shared_dict)

    def add_example(self, example: Any) -> None:
        """Append one example (any picklable object)."""
        if self._closed:
            raise ValueError("writer is closed")
        if self._shard.stored == self.shard_size:
            self._finish_shard()
            self._shard = self._new_shard()
        self._shard.add(example)

    def add_examples(self, examples: Iterable[Any]) -> None:
        """Append every example of ``examples``, in order."""
        for example in examples:
            self.add_example(example)

    def _finish_shard(self) -> None:
        shard = self._shard
        meta = shard.close()
        first = not self._shard_sizes
        self._shard_sizes.append(shard.stored)
        if first and self.strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION:
            if shard.trained_dict is None:
                self.strategy = CompressionStrategy.STANDARD_COMPRESSION
            else:
                os.rename(os.path.join(shard.path, DICT_NAME), os.path.join(self._tmp, DICT_NAME))
                self._shared_dict = shard.trained_dict
                meta = ShardMeta(**{**meta.__dict__, "compression_strategy": self.strategy})
        with open(os.path.join(shard.path, "meta.json"), "w") as f:
            f.write(meta.to_json())

    def close(self) -> None:
        """Finish the last shard, write the root meta and move the dataset into place."""
        if self._closed:
            return
        self._closed = True
        try:
            self._finish_shard()
            root = RootMeta(FORMAT_VERSION, tuple(self._shard_sizes), self.strategy)
            with open(os.path.join(self._tmp, "meta.json"), "w") as f:
                f.write(root.to_json())
            width = shard_name_width(len(self._shard_sizes))
            for number in range(len(self._shard_sizes)):
                os.rename(os.path.join(self._tmp, str(number)), os.path.join(self._tmp, str(number).zfill(width)))
            if os.path.lexists(self.path):  # rename(2) would silently replace an empty folder
                raise FileExistsError(f"{self.path}: appeared while the dataset was being written")
            # mkdtemp made it 0700: give it the mode mkdir would (other users' readers failed on it)
            os.chmod(self._tmp, 0o777 & ~_umask())
            os.rename(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Discard everything written so far."""
        self._closed = True
        self._shard.abort()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "AtlasWriter":
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _umask() -> int:
    """This process's umask, from /proc (setting it to read it races with other threads'
    file creation), else by setting it and setting it back."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
