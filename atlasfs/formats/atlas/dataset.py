"""Reading Atlas v1 datasets: random access, iteration, thread safety.

Differences from the reference reader (EIDOSLAB/torch-atlas-ds v0.1.0), by design:

* Shard folders are ordered by number, not by name, so unpadded names work.
* A negative index wraps once, like a Python list; the reference wraps a
  second time inside the shard, so ``ds[-len(ds) - 1]`` returned an example
  there and raises :class:`IndexError` here.
* An unknown compression strategy is an error; the reference read it as raw.
* Reads are positioned (``os.pread``) and zstd contexts are per thread, so
  one dataset object may be shared by any number of threads.
* Blocks are unpickled with an allow-list unless ``trust_pickle=True``.
"""

from __future__ import annotations

import bisect
import io
import itertools
import os
import re
from typing import Any, Iterator

import numpy as np

from atlasfs.blockcache import BlockCache
from atlasfs.errors import AtlasFormatError
from atlasfs.formats.atlas import summary
from atlasfs.formats.atlas.codec import DEFAULT_MAX_BLOCK_BYTES, BlockCodec, ZstdDictionary
from atlasfs.formats.atlas.meta import CompressionStrategy, RootMeta, ShardMeta, parse_root_meta, parse_shard_meta
from atlasfs.formats.atlas.spans import LocatedReads
from atlasfs.formats.naming import index_key_width
from atlasfs.formats.source import Source, SourceShard, file_signature, refused_in_one_line
from atlasfs.storage import (LOCAL, LocalStorage, Storage, StorageChangedError, StorageUnavailableError, UnfitFileError,
                             open_storage)

#: Default bound of the decoded-block cache.
DEFAULT_CACHE_BYTES = 256 << 20
DICT_NAME = "zstd_dict.bin"
_SHARD_NAME = re.compile(r"[0-9]+")


def _stat_signature(path: str, storage: Storage = LOCAL) -> tuple[int, int] | None:
    return storage.stat(path)


def _open_index(path: str, storage: Storage) -> io.BufferedIOBase:
    """``index.npy`` as a file object: the file itself (a regular file, opened without
    blocking: :meth:`LocalStorage.open`), or its bytes fetched from a store (it is small:
    8 bytes a block, so one GET). Read by its header: nothing past what it states."""
    if storage.remote:
        return io.BytesIO(storage.read(path))
    return storage.open(path)


def _load_index(path: str, num_blocks: int, mmap: bool, storage: Storage = LOCAL) -> np.ndarray:
    """Read and validate ``index.npy``, checking its header against the file size
    before allocating or mapping anything (a forged shape cannot cost memory)."""
    try:
        with _open_index(path, storage) as f:
            try:
                version = np.lib.format.read_magic(f)
                if version == (1, 0):
                    shape, _, dtype = np.lib.format.read_array_header_1_0(f)
                elif version == (2, 0):
                    shape, _, dtype = np.lib.format.read_array_header_2_0(f)
                else:
                    raise ValueError(f"unsupported .npy version {version}")
            except Exception as exc:  # numpy raises many types on a bad header
                raise AtlasFormatError(f"{path}: not a valid .npy file ({exc})") from None
            if dtype.kind != "u":
                raise AtlasFormatError(f"{path}: index dtype is {dtype}, expected an unsigned integer type")
            if len(shape) != 1:
                raise AtlasFormatError(f"{path}: index must be a 1-D array, found shape {shape}")
            if shape[0] != num_blocks + 1:
                raise AtlasFormatError(
                    f"{path}: index has {shape[0]} entries, expected {num_blocks + 1} "
                    f"({num_blocks} blocks from stored_examples and block_size in "
                    f"{os.path.join(os.path.dirname(path), 'meta.json')})")
            offset = f.tell()
            if isinstance(f, io.BytesIO):
                payload = len(f.getbuffer()) - offset
            else:
                payload = os.fstat(f.fileno()).st_size - offset
            if payload != shape[0] * dtype.itemsize:
                raise AtlasFormatError(
                    f"{path}: {payload} bytes of data for {shape[0]} entries of {dtype.itemsize} bytes")
            if isinstance(f, io.BytesIO):  # fetched: already in memory, nothing to map
                index = np.frombuffer(f.read(), dtype=dtype, count=shape[0])
                _check_index(path, index)
            elif mmap:
                index = np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape)
                _check_index(path, index)
            else:
                index = _read_index(path, f, dtype, shape[0])
    except StorageUnavailableError:
        raise
    except FileNotFoundError:
        raise AtlasFormatError(f"{path}: missing") from None
    except UnfitFileError as exc:  # a FIFO, a device...: its message names the file and what it is
        raise AtlasFormatError(str(exc)) from None
    except OSError as exc:
        raise AtlasFormatError(f"{path}: cannot read ({exc.strerror})") from None
    return index


#: Entries of ``index.npy`` read and checked at a time (1 MiB of 8-byte entries).
_INDEX_CHUNK = 1 << 17


def _read_index(path: str, f: Any, dtype: np.dtype, count: int) -> np.ndarray:
    """The ``count`` entries of ``f`` (past its header), read and checked a chunk at a time.

    The header's shape matching the file's size bounds nothing when the file is sparse: a
    ``meta.json`` claiming 2^28 blocks beside a sparse 2 GiB ``index.npy`` had info, verify and
    a mount read it whole (2.4 GB) before finding its second entry not after the first. The
    array is allocated untouched (its pages cost memory only once filled) and each chunk is
    checked as it comes, so a forged index fails within its first wrong chunk; only entries
    that really increase (8 bytes each on disk) take memory."""
    index = np.empty(count, dtype=dtype)
    raw = memoryview(index).cast("B")
    step = _INDEX_CHUNK * dtype.itemsize
    for start in range(0, len(raw), step):
        part = raw[start:start + step]
        while part:
            got = f.readinto(part)
            if not got:
                raise AtlasFormatError(f"{path}: shorter than its header states (changed while read)")
            part = part[got:]
        first = start // dtype.itemsize
        _check_index(path, index[max(first - 1, 0):first + _INDEX_CHUNK], max(first - 1, 0))
    return index


def _check_index(path: str, index: np.ndarray, base: int = 0) -> None:
    """:class:`AtlasFormatError` unless ``index`` (entries ``base``... of a shard's index)
    starts at 0 (if ``base`` is 0) and increases, checked a chunk at a time (no temporary
    array the size of a huge index)."""
    if base == 0 and index[0] != 0:
        raise AtlasFormatError(f"{path}: index starts at {int(index[0])}, expected 0")
    for start in range(0, len(index) - 1, _INDEX_CHUNK):
        part = index[start:start + _INDEX_CHUNK + 1]
        increasing = part[1:] > part[:-1]
        if not bool(np.all(increasing)):
            bad = base + start + int(np.argmin(increasing))
            raise AtlasFormatError(f"{path}: index is not increasing (entry {bad + 1} is {int(index[bad - base + 1])}, "
                                   f"after {int(index[bad - base])})")


class Shard(LocatedReads, SourceShard):  # LocatedReads: files read without their block (spans.py)
    """One shard folder: its meta, its block index and its ``data.bin``.

    Usually reached through :attr:`AtlasDataset.shards`. ``shard[i]`` and
    iteration go through the dataset's block cache. As a
    :class:`~atlasfs.formats.source.SourceShard` it needs no pass over its
    files: ``index.npy`` says where every block is.
    """

    #: Files a shard's table depends on, relative to its folder.
    TABLE_FILES = ("meta.json", "index.npy", "data.bin", DICT_NAME, f"../{DICT_NAME}")
    #: Digits of index keys: the dataset sets it from its number of examples.
    key_width = index_key_width(0)

    def __init__(self, path: str, number: int, shared_dict: ZstdDictionary | None, cache: BlockCache,
                 *, trust_pickle: bool = False, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
                 mmap_index: bool = True, storage: Storage = LOCAL, check_data_size: bool = True) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.number = number
        #: Where the shard's files are read from (a local folder, or an object store).
        self.storage = storage
        self.meta: ShardMeta = parse_shard_meta(path, storage)
        self.data_path = os.path.join(path, "data.bin")
        self.index_path = os.path.join(path, "index.npy")
        self.index = _load_index(self.index_path, self.num_blocks, mmap_index, storage)
        self._signature = self._read_signature()
        data_size = self._signature[0][0] if self._signature[0] else None
        expected = int(self.index[-1])
        if data_size is not None:  # a FIFO or device stands for it: say so, not "0 bytes" (a stat, no open)
            try:
                storage.check_file(self.data_path)
            except UnfitFileError as exc:
                raise AtlasFormatError(str(exc)) from None
            except OSError:
                pass  # gone since the stat, or unreadable: said as before (or by _break_unreadable)
        # Unchecked, each block is checked when read (read_raw): the intact ones read.
        if check_data_size and data_size is None and expected:
            raise AtlasFormatError(f"{self.data_path}: missing ({self.meta.stored_examples} examples in meta.json)")
        if check_data_size and data_size is not None and data_size != expected:
            raise AtlasFormatError(
                f"{self.data_path}: {data_size} bytes, but {self.index_path} ends at {expected}"
                f" ({'truncated' if data_size < expected else 'trailing data'})")
        self.codec = BlockCodec(self.meta.compression_strategy, self._dictionary(shared_dict),
                                trust_pickle=trust_pickle, max_block_bytes=max_block_bytes)
        self._cache = cache
        # data.bin is read through the store, or locally on a descriptor of the shard's own
        # (closed by close(); another reader of the same file keeps its own).
        self._data = storage if storage.remote else LocalStorage()

    def _dictionary(self, shared: ZstdDictionary | None) -> ZstdDictionary | None:
        strategy = self.meta.compression_strategy
        # The dictionary is read at the shard's first decode, but looked at now (a stat: a
        # FIFO, a device or a file past MAX_DICTIONARY_BYTES fails the shard in one line).
        if strategy == CompressionStrategy.DICTIONARY_COMPRESSION:
            dictionary = ZstdDictionary(os.path.join(self.path, DICT_NAME), self.storage)
            dictionary.check("shard uses compression strategy 3, per-shard dictionary")
            return dictionary
        if strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION:
            if shared is None:
                raise AtlasFormatError(
                    f"{os.path.join(os.path.dirname(self.path), DICT_NAME)}: missing "
                    f"(shard {self.name} uses compression strategy 2, shared dictionary)")
            shared.check()  # looked at once for every shard (a root of another strategy did not)
            return shared
        return None

    def _read_signature(self) -> tuple[tuple[int, int] | None, tuple[int, int] | None]:
        # A store's sizes and mtimes come from its listing (no request per read); its
        # reads are checked against the listed ETag instead (docs/storage.md).
        return (_stat_signature(self.data_path, self.storage), _stat_signature(self.index_path, self.storage))

    @property
    def num_blocks(self) -> int:
        """Number of blocks in ``data.bin``."""
        return self.meta.num_blocks

    @property
    def block_size(self) -> int:
        """Examples in a full block."""
        return self.meta.block_size

    @property
    def max_block_bytes(self) -> int:  # type: ignore[override]
        """Most bytes a block may decompress to (its files may take no more either)."""
        return self.codec.max_block_bytes

    def block_where(self, block: int) -> str:
        return f"{self.data_path} block {block}"

    def table_files(self) -> list[str]:
        return [os.path.join(self.path, name) for name in self.TABLE_FILES]

    def table_key(self) -> dict[str, Any]:
        return {"start": self.first_index, "width": self.key_width,
                "files": {name: self._file_signature(os.path.join(self.path, name)) for name in self.TABLE_FILES}}

    def _file_signature(self, path: str) -> list[Any] | None:
        """What a stored table depends on for one file: size and mtime (and, in a store,
        its ETag: an object rewritten within the same second keeps its mtime)."""
        if not self.storage.remote:
            return file_signature(path)
        if "/../" in path:  # the root's dictionary; normpath would fold a URL's "//"
            head, _, tail = path.partition("/../")
            path = f"{os.path.dirname(head)}/{tail}"
        found = self.storage.stat(path)
        if found is None:
            return None
        return [found[0], found[1], getattr(self.storage, "etag", lambda _: None)(path)]

    @property
    def mtime(self) -> float:
        """Modification time of the shard's data (seconds since the epoch)."""
        sig = self._signature[0] or self._signature[1]
        return sig[1] / 1e9 if sig else 0.0

    @property
    def data_size(self) -> int:
        """Bytes in ``data.bin`` (0 when there is none)."""
        return self._offset(-1)

    def stored_block_size(self, block: int) -> int:
        """Bytes ``block`` takes in ``data.bin`` (compressed, if it is)."""
        return self._offset(block + 1) - self._offset(block)

    def _offset(self, i: int) -> int:
        if isinstance(self.index, np.memmap):
            self.check_unchanged()  # a mapped index.npy truncated since open would raise SIGBUS
        return int(self.index[i])

    def __len__(self) -> int:
        return self.meta.stored_examples

    def block_length(self, block: int) -> int:
        """Number of examples in ``block`` (the last block may be partial)."""
        size = self.meta.block_size
        return min(size, self.meta.stored_examples - block * size)

    def summary(self) -> dict[str, object]:
        return summary.shard_summary(self)

    def locate(self, i: int) -> tuple[int, int]:
        """``(block, position in block)`` of the shard's example ``i`` (0 <= i < len)."""
        return divmod(i, self.meta.block_size)

    def check_unchanged(self) -> None:
        """Raise :class:`AtlasFormatError` if ``data.bin`` or ``index.npy`` changed since open."""
        now = self._read_signature()
        if now != self._signature:
            changed = self.data_path if now[0] != self._signature[0] else self.index_path
            raise AtlasFormatError(
                f"{changed}: changed since the dataset was opened (size or modification time); reopen it")

    def _read_data(self, block: int, offset: int, size: int, changed: str) -> bytes:
        """``size`` bytes at ``offset`` of ``data.bin`` for a read in ``block``; a failed read
        is an :class:`AtlasFormatError` naming the file and block (``changed``: the message
        when the store's object changed), a store that does not answer stays transient."""
        try:
            return self._data.pread(self.data_path, offset, size)
        except StorageUnavailableError:
            raise
        except StorageChangedError:
            raise AtlasFormatError(f"{self.data_path}: {changed}") from None
        except UnfitFileError as exc:  # data.bin replaced by a FIFO, a device...: said as it is
            raise AtlasFormatError(str(exc)) from None
        except OSError as exc:
            raise AtlasFormatError(f"{self.data_path}: read of block {block} failed ({exc.strerror})") from None

    def read_raw(self, block: int) -> bytes:
        """The block's bytes as stored in ``data.bin`` (compressed or not).

        From a store, a read that gets no answer within the deadline raises
        :class:`StorageUnavailableError` (transient: the block is not broken)."""
        if not 0 <= block < self.num_blocks:
            raise IndexError(f"block {block} out of range for shard {self.name} ({self.num_blocks} blocks)")
        self.check_unchanged()  # first: a mapped index.npy truncated since open would raise SIGBUS
        start, end = int(self.index[block]), int(self.index[block + 1])
        raw = self._read_data(block, start, end - start,
                              "changed in the store since the dataset was opened (ETag differs); remount")
        if len(raw) != end - start:
            raise AtlasFormatError(
                f"{self.data_path}: block {block} truncated (expected {end - start} bytes at offset {start}, "
                f"got {len(raw)})")
        return raw

    def read_range(self, block: int, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` of ``block`` as stored in ``data.bin`` (fewer past the
        block's end): a read of one file without its block (spans.py) reads no more. The
        caller checks :meth:`check_unchanged` first (once, not once per range)."""
        start, end = int(self.index[block]), int(self.index[block + 1])
        size = max(0, min(size, end - start - offset))
        if offset < 0 or not size:
            return b""
        data = self._read_data(block, start + offset, size, "changed in the store since the dataset was opened")
        if len(data) != size:
            raise AtlasFormatError(f"{self.data_path}: block {block} truncated")
        return data

    def decode_block(self, block: int) -> tuple[list[Any], int]:
        """Read and decode ``block``, bypassing the cache: ``(examples, decoded bytes)``."""
        where = f"{self.data_path} block {block}"
        kept = self.kept_payload(block)  # LocatedReads: decompressed by a read of one of its files
        if kept is not None:
            return self.codec.decode_payload(kept, self.block_length(block), where)
        raw = self.read_raw(block)
        return self.codec.decode(raw, self.block_length(block), where,
                                 self.payload_keeper(block))  # LocatedReads: file_spans searches it next

    def block(self, block: int) -> list[Any]:
        """The examples of ``block``, through the dataset's block cache."""
        return self._cache.get((self.path, block), lambda: self.decode_block(block))

    def __getitem__(self, i: int) -> Any:
        """Example ``i`` of this shard; negative indices wrap once, like the dataset's."""
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"shard indices must be integers, not {type(i).__name__}")
        i = int(i)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index out of range for shard {self.name} ({n} examples)")
        block, pos = self.locate(i)
        return self.block(block)[pos]

    def __iter__(self) -> Iterator[Any]:
        for b in range(self.num_blocks):
            yield from self.block(b)

    def close(self) -> None:
        """Close the ``data.bin`` descriptor (reopened on the next read)."""
        self._data.close_file(self.data_path)

    def __repr__(self) -> str:
        return f"Shard({self.path!r}, examples={len(self)}, blocks={self.num_blocks})"


class BrokenShard(Shard):
    """Stands for a shard folder that could not be opened: every read raises its error.

    Its length is the root meta's ``shard_sizes`` entry (0 if there is none),
    so the global indices of the shards after it do not move.
    """

    def __init__(self, path: str, number: int, error: AtlasFormatError, size_hint: int) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.number = number
        self.error = error
        self._size_hint = size_hint

    def __len__(self) -> int:
        return self._size_hint

    num_blocks = 0  # type: ignore[assignment]
    data_size = 0  # type: ignore[assignment]

    @property
    def mtime(self) -> float:
        try:
            return os.stat(self.path).st_mtime
        except OSError:
            return 0.0

    def locate(self, i: int) -> tuple[int, int]:
        raise self.error

    def read_raw(self, block: int) -> bytes:
        raise self.error

    def block(self, block: int) -> list[Any]:
        raise self.error

    def __iter__(self) -> Iterator[Any]:
        raise self.error

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"BrokenShard({self.path!r}, {self.error})"


def find_shard_dirs(root: str, storage: Storage = LOCAL) -> list[tuple[int, str]]:
    """``(number, name)`` of each shard folder under ``root``, ordered by number.

    Hidden folders are not shards; any other folder must be named by digits.
    """
    try:
        entries = storage.listdir(root)
    except StorageUnavailableError:
        raise
    except FileNotFoundError:
        raise AtlasFormatError(f"{root}: no such dataset folder") from None
    except NotADirectoryError:
        raise AtlasFormatError(f"{root}: not a folder") from None
    except OSError as exc:
        raise AtlasFormatError(f"{root}: cannot list ({exc.strerror})") from None
    found: dict[int, str] = {}
    for name, is_dir in entries:
        if name.startswith(".") or not is_dir:
            continue
        if not _SHARD_NAME.fullmatch(name):
            raise AtlasFormatError(f"{os.path.join(root, name)}: shard folder name is not a number")
        number = int(name)
        if number in found:
            raise AtlasFormatError(
                f"{os.path.join(root, name)}: same shard number as {os.path.join(root, found[number])}")
        found[number] = name
    return sorted(found.items())


def shared_dictionary(root: str, meta: RootMeta, storage: Storage = LOCAL) -> ZstdDictionary | None:
    """The root ``zstd_dict.bin`` (strategy 2), or None if there is none.

    Raises :class:`AtlasFormatError` if the root meta says strategy 2 and it is missing, not
    a regular file (a FIFO...) or past :data:`~.codec.MAX_DICTIONARY_BYTES`. Under another
    root strategy such a file fails only the shards of strategy 2 (:meth:`Shard._dictionary`).
    """
    path = os.path.join(root, DICT_NAME)
    shared = meta.compression_strategy == CompressionStrategy.SHARED_DICTIONARY_COMPRESSION
    if storage.stat(path) is not None:  # there is something (a FIFO too; a dangling link is nothing)
        dictionary = ZstdDictionary(path, storage)
        if shared:
            dictionary.check()
        return dictionary
    if shared:
        raise AtlasFormatError(f"{path}: missing (meta.json says compression strategy 2, shared dictionary)")
    return None


class AtlasDataset(Source):
    """A read-only Atlas v1 dataset.

    ``len(ds)``, ``ds[i]`` (negative indices wrap once; out of range raises
    :class:`IndexError`), iteration in order, and ``ds.shards`` for per-shard
    access. Any malformed part raises :class:`AtlasFormatError` naming the
    file: cheap checks at open, block checks when a block is decoded.

    Parameters:
        root: the dataset folder (holding the root ``meta.json``).
        cache_bytes: bound of the decoded-block cache, in bytes of decoded pickle.
        trust_pickle: unpickle blocks without the allow-list (runs code from the data).
        max_block_bytes: refuse blocks that decompress to more than this.
        mmap_index: memory-map ``index.npy`` instead of reading it into memory.
        tolerate_broken_shards: instead of raising, stand a :class:`BrokenShard`
            in ``shards`` for each shard folder that cannot be opened, so that
            the others stay usable (the mount and ``verify`` use this). Root
            problems (meta.json, folder names, shared dictionary) still raise.
        check_data_size: refuse a shard whose ``data.bin`` is not the size its
            ``index.npy`` says (truncated, trailing data, missing) at open. False:
            open it anyway; a block past a truncation fails when read, and the
            blocks before it read (``atlasfs show`` reads any intact block).
        storage: where the files are read from (:mod:`atlasfs.storage`); None: the
            local file system, or for a URL root (``s3://bucket/prefix``) an object
            store with default options. A store that does not answer while the
            dataset is opened raises :class:`AtlasFormatError` (one line).
    """

    def __init__(self, root: str | os.PathLike[str], *, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 trust_pickle: bool = False, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES,
                 mmap_index: bool = True, tolerate_broken_shards: bool = False,
                 storage: Storage | None = None, check_data_size: bool = True) -> None:
        if storage is None:
            storage, root = open_storage(root)
        self.storage = storage
        self.root = os.fspath(root).rstrip("/") if storage.remote else os.fspath(root)
        self.trust_pickle = trust_pickle
        with refused_in_one_line(self.root, storage):
            self._open(cache_bytes, trust_pickle, max_block_bytes, mmap_index, tolerate_broken_shards,
                       check_data_size)

    def _open(self, cache_bytes: int, trust_pickle: bool, max_block_bytes: int, mmap_index: bool,
              tolerate_broken_shards: bool, check_data_size: bool) -> None:
        storage = self.storage
        if not storage.isdir(self.root):
            raise AtlasFormatError(f"{self.root}: no such dataset folder")
        self.meta: RootMeta = parse_root_meta(self.root, storage)
        self.cache: BlockCache[list[Any]] = BlockCache(cache_bytes)
        shard_dirs = find_shard_dirs(self.root, storage)
        shared = shared_dictionary(self.root, self.meta, storage)
        self.shards: list[Shard] = []
        for position, (number, name) in enumerate(shard_dirs):
            path = os.path.join(self.root, name)
            try:
                shard = Shard(path, number, shared, self.cache, trust_pickle=trust_pickle,
                              max_block_bytes=max_block_bytes, mmap_index=mmap_index, storage=storage,
                              check_data_size=check_data_size)
            except AtlasFormatError as exc:
                if not tolerate_broken_shards:
                    raise
                # The root's shard_sizes keeps later shards' global indices right.
                sizes = self.meta.shard_sizes
                shard = BrokenShard(path, number, exc, sizes[position] if position < len(sizes) else 0)
            self.shards.append(shard)
        self._ends = list(itertools.accumulate(len(s) for s in self.shards))
        width = index_key_width(len(self))
        for position, shard in enumerate(self.shards):
            shard.first_index = self.shard_start(position)
            shard.key_width = width

    kind = "atlas"
    checked = "metadata, indexes and frame headers"

    def info(self) -> list[str]:
        return summary.dataset_info(self)

    def warnings(self) -> list[str]:
        return summary.shard_sizes_note(self)

    @property
    def mtime(self) -> float:
        """Modification time of the root ``meta.json``."""
        if self.storage.remote:
            found = self.storage.stat(os.path.join(self.root, "meta.json"))
            return found[1] / 1e9 if found else 0.0
        return os.stat(os.path.join(self.root, "meta.json")).st_mtime

    def __len__(self) -> int:
        return self._ends[-1] if self._ends else 0

    def locate(self, i: int) -> tuple[int, int, int]:
        """``(shard position, block, position in block)`` of global example ``i``."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index out of range ({n} examples)")
        s = bisect.bisect_right(self._ends, i)
        start = self._ends[s - 1] if s else 0
        block, pos = self.shards[s].locate(i - start)
        return s, block, pos

    def shard_start(self, s: int) -> int:
        """Global index of the first example of shard position ``s``."""
        return self._ends[s - 1] if s else 0

    def __getitem__(self, i: int) -> Any:
        if not isinstance(i, (int, np.integer)) or isinstance(i, bool):
            raise TypeError(f"dataset indices must be integers, not {type(i).__name__}")
        s, block, pos = self.locate(int(i))
        return self.shards[s].block(block)[pos]

    def __iter__(self) -> Iterator[Any]:
        for shard in self.shards:
            yield from shard

    @property
    def num_blocks(self) -> int:
        """Blocks over all shards."""
        return sum(s.num_blocks for s in self.shards)

    def close(self) -> None:
        """Release file descriptors and cached blocks."""
        for shard in self.shards:
            shard.close()
        self.cache.clear()

    def __enter__(self) -> "AtlasDataset":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"AtlasDataset({self.root!r}, examples={len(self)}, shards={len(self.shards)})"

