"""Turning a block's bytes on disk into its list of examples."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import zstandard

from atlasfs.errors import AtlasFormatError
from atlasfs.formats import safepickle
from atlasfs.formats.atlas.meta import CompressionStrategy, read_file
from atlasfs.storage import LOCAL, Storage, StorageUnavailableError, UnfitFileError

#: Default bound on one decompressed block. Real blocks are KBs to tens of MBs;
#: a frame claiming more is treated as a decompression bomb.
DEFAULT_MAX_BLOCK_BYTES = 1 << 30
_READ_CHUNK = 1 << 20

#: Bound of a ``zstd_dict.bin``, checked before it is read (its size by ``fstat``, or a
#: store's listing), and at open by ``stat``: a larger one fails its shard (strategy 3) or
#: the dataset (strategy 2) in one line naming the file and this bound. Unbounded, a sparse
#: 1 GiB file took a mount's daemon to 2 GiB. Real dictionaries are far smaller: zstd's
#: trainer makes 110 KiB by default, and atlasfs's writer (like the reference's) 1% of a
#: shard's pickled bytes, so 16 MiB is the dictionary of a 1.6 GiB shard. A daemon holds a
#: dictionary it uses about three times (the file's bytes, zstandard's copy, the native
#: engine's), so one at the bound stays within the 100 MiB fixed overhead the daemon states
#: (docs/reliability.md, Load).
MAX_DICTIONARY_BYTES = 16 << 20


#: Idle zstd decompression contexts kept for reuse, over every codec and thread of the
#: process. A new context costs ~4 µs. Kept per thread and per shard (as they were), their
#: number grew with the shards: 10 threads decoding one block of each of 100 shards added
#: 8.6 MiB of RSS, against 1.5 MiB with this pool.
IDLE_CONTEXTS = 4


class _ContextPool:
    """Idle decompression contexts, each bound to its dictionary (None: no dictionary)."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._idle: list[tuple[object, zstandard.ZstdDecompressor]] = []
        self._lock = threading.Lock()

    def take(self, dictionary: object) -> zstandard.ZstdDecompressor | None:
        """An idle context for ``dictionary``, or None."""
        with self._lock:
            for i in range(len(self._idle) - 1, -1, -1):
                if self._idle[i][0] is dictionary:
                    return self._idle.pop(i)[1]
        return None

    def give(self, dictionary: object, dctx: zstandard.ZstdDecompressor) -> None:
        """Keep ``dctx`` for reuse; the oldest idle context goes if there are too many."""
        with self._lock:
            self._idle.append((dictionary, dctx))
            if len(self._idle) > self._size:
                del self._idle[0]

    def __len__(self) -> int:
        return len(self._idle)


_IDLE = _ContextPool(IDLE_CONTEXTS)


class ZstdDictionary:
    """A zstd dictionary file, read (through ``storage``) on first use and shared by every reader.

    Never more than :data:`MAX_DICTIONARY_BYTES` is read, and only from a regular file: a
    FIFO or device put in its place fails every read needing it (:class:`AtlasFormatError`,
    the blocks' EIO in a mount) at once rather than hanging it."""

    #: What the bound's message calls it.
    WHAT = "a zstd dictionary"

    def __init__(self, path: str, storage: Storage = LOCAL) -> None:
        self.path = path
        self._storage = storage
        self._lock = threading.Lock()
        self._dict: zstandard.ZstdCompressionDict | None = None
        self._data = b""
        self._checked: AtlasFormatError | None = None
        self._was_checked = False

    def check(self, missing: str = "") -> None:
        """Raise :class:`AtlasFormatError` now if the file is missing (``missing``: why it is
        needed, for the message), not a regular file, or past the bound, without reading it:
        what a dataset's opening calls, so that the shard (or dataset) fails at once in one
        line rather than at its first read. The answer is kept: one look per file, however
        many shards share it. A store that does not answer stays transient (raised, not kept)."""
        with self._lock:
            if not self._was_checked:
                try:
                    self._storage.check_file(self.path, MAX_DICTIONARY_BYTES, self.WHAT)
                except StorageUnavailableError:
                    raise
                except FileNotFoundError:
                    self._checked = AtlasFormatError(f"{self.path}: missing{missing and f' ({missing})'}")
                except UnfitFileError as exc:
                    self._checked = AtlasFormatError(str(exc))
                except OSError as exc:
                    self._checked = AtlasFormatError(f"{self.path}: cannot read {self.WHAT} ({exc.strerror})")
                self._was_checked = True
            if self._checked is not None:
                raise self._checked

    def get(self) -> zstandard.ZstdCompressionDict:
        """The loaded dictionary; raises :class:`AtlasFormatError` if unreadable (not a
        regular file, past :data:`MAX_DICTIONARY_BYTES`, empty). A failure is not kept: the
        file may be put right while a mount runs, and each try costs a stat and an open."""
        with self._lock:
            if self._dict is None:
                data = read_file(self.path, self._storage, what=self.WHAT, max_bytes=MAX_DICTIONARY_BYTES)
                if not data:
                    raise AtlasFormatError(f"{self.path}: dictionary is empty")
                self._dict = zstandard.ZstdCompressionDict(data)
                self._data = data
            return self._dict

    def data(self) -> bytes:
        """The dictionary file's bytes, one object for every caller (as_bytes() copies them
        each time: ~100 KiB a shard handed to the native engine); raises as :meth:`get`."""
        self.get()
        return self._data


class BlockCodec:
    """Decompresses and unpickles the blocks of one shard.

    Safe to share between threads: a zstd decompression context must not be used
    by two threads at once, so each decompression takes one from a small pool shared
    by every codec of the process (:data:`IDLE_CONTEXTS`) and gives it back after.
    """

    def __init__(self, strategy: CompressionStrategy, dictionary: ZstdDictionary | None,
                 *, trust_pickle: bool = False, max_block_bytes: int = DEFAULT_MAX_BLOCK_BYTES) -> None:
        self.strategy = strategy
        self.dictionary = dictionary
        self.trust_pickle = trust_pickle
        self.max_block_bytes = max_block_bytes

    def _take_context(self) -> zstandard.ZstdDecompressor:
        """A decompression context for this codec's dictionary: an idle one, or a new one."""
        dctx = _IDLE.take(self.dictionary)
        if dctx is not None:
            return dctx
        if self.dictionary is None:
            return zstandard.ZstdDecompressor()
        try:
            dctx = zstandard.ZstdDecompressor(dict_data=self.dictionary.get())
            dctx.memory_size()  # forces the dictionary to load now, where errors are caught
        except zstandard.ZstdError as exc:
            raise AtlasFormatError(f"{self.dictionary.path}: not a usable zstd dictionary ({exc})") from None
        return dctx

    @contextlib.contextmanager
    def context(self) -> Iterator[zstandard.ZstdDecompressor]:
        """A decompression context for this codec, from the shared pool; given back only
        if the ``with`` body succeeds (a failed one may be mid-frame). A context left in
        the middle of a frame on purpose (a read that stops at a span's end) is reusable:
        every new decompression starts a new frame."""
        dctx = self._take_context()
        yield dctx
        _IDLE.give(self.dictionary, dctx)

    def check_header(self, raw: bytes, where: str) -> int:
        """Validate a zstd frame header (``raw`` may be just the first 18 bytes):
        magic, dictionary id, claimed size within the limit. Returns the claimed
        size, or -1 if the frame does not say."""
        try:
            params = zstandard.get_frame_parameters(raw)
        except zstandard.ZstdError as exc:
            raise AtlasFormatError(f"{where}: not a zstd frame ({exc})") from None
        self._check_dictionary(params.dict_id, where)
        if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:  # 2**64 - 1, not a claim
            return -1  # bounded while it decompresses instead
        if params.content_size > self.max_block_bytes:
            raise AtlasFormatError(
                f"{where}: zstd frame claims {params.content_size} bytes, over the "
                f"{self.max_block_bytes}-byte block limit (corrupt, or a decompression bomb)")
        return params.content_size

    def decompress(self, raw: bytes, where: str) -> bytes:
        """The pickle bytes of a block, never allocating more than ``max_block_bytes``."""
        if self.strategy == CompressionStrategy.NO_COMPRESSION:
            return raw
        content_size = self.check_header(raw, where)
        dctx = self._take_context()
        try:
            if content_size >= 0:
                # A block is exactly one frame: bytes after it (or a second frame) are an error.
                payload = dctx.decompress(raw, allow_extra_data=False)
            else:
                payload = self._decompress_unknown_size(dctx, raw, where)
        except zstandard.ZstdError as exc:
            raise AtlasFormatError(f"{where}: corrupt zstd frame ({exc})") from None
        _IDLE.give(self.dictionary, dctx)  # only after a success: a failed one may be mid-frame
        return payload

    def _check_dictionary(self, frame_dict_id: int, where: str) -> None:
        if frame_dict_id == 0:
            return
        if self.dictionary is None:
            raise AtlasFormatError(
                f"{where}: frame needs zstd dictionary {frame_dict_id}, but compression "
                f"strategy {int(self.strategy)} uses none")
        try:
            own_id = self.dictionary.get().dict_id()
        except AtlasFormatError as exc:  # the dictionary's own problem (a FIFO, past its bound), said of the block
            raise AtlasFormatError(f"{where}: {exc}") from None
        if own_id != frame_dict_id:
            raise AtlasFormatError(
                f"{where}: frame needs zstd dictionary {frame_dict_id}, but "
                f"{self.dictionary.path} is dictionary {own_id}")

    def _decompress_unknown_size(self, dctx: zstandard.ZstdDecompressor, raw: bytes, where: str) -> bytes:
        chunks = []
        total = 0
        with dctx.stream_reader(raw) as reader:
            while chunk := reader.read(_READ_CHUNK):
                total += len(chunk)
                if total > self.max_block_bytes:
                    raise AtlasFormatError(
                        f"{where}: zstd frame expands past the {self.max_block_bytes}-byte block "
                        "limit (corrupt, or a decompression bomb)")
                chunks.append(chunk)
        return b"".join(chunks)

    def decode(self, raw: bytes, expected_len: int, where: str,
               keep: Callable[[bytes], None] | None = None) -> tuple[list[Any], int]:
        """Decode a block to its examples; returns ``(examples, decompressed size)``. ``keep``,
        if given, is handed the decompressed pickle of a block that decoded well (the file
        table's build searches it next: spans.py)."""
        return self.decode_payload(self.decompress(raw, where), expected_len, where, keep)

    def decode_payload(self, payload: bytes, expected_len: int, where: str,
                       keep: Callable[[bytes], None] | None = None) -> tuple[list[Any], int]:
        """:meth:`decode` of a block already decompressed (``payload``: its pickle)."""
        examples = safepickle.loads(payload, trust=self.trust_pickle, where=where)
        if type(examples) is not list:
            raise AtlasFormatError(f"{where}: block is a {type(examples).__name__}, not a list of examples")
        if len(examples) != expected_len:
            raise AtlasFormatError(f"{where}: block holds {len(examples)} examples, expected {expected_len}")
        if keep is not None:
            keep(payload)
        return examples, len(payload)
