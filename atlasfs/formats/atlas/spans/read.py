"""Reading a located file back from its block as stored, with its checks: :func:`read_span`
(a ``pread`` of the run, raw zstd blocks read in place, or a frame decompressed up to the
run's end; an inline file against its block's fingerprint), :func:`check_run` and
:func:`run_in` for runs got some other way. A run that is not the span's raises
:class:`SpanMismatch`; nothing is unpickled.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import zstandard

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.atlas.meta import CompressionStrategy
from atlasfs.formats.atlas.spans.find import Span, inline_check, run_check, stored_bound, stored_crc, stored_crc_of
from atlasfs.formats.source import SpanMismatch

#: How many stored bytes the zstd stream reader asks a :class:`BlockReader` for
#: at a time: a frame is read (and decompressed) only as far as a span needs.
_READ_SIZE = 1 << 17


class BlockReader:
    """The stored bytes of one block as a file object, read through ``read_at(offset,
    size)`` (offsets in the block) only as far as asked: a span near a block's start
    reads little of it."""

    def __init__(self, read_at: Callable[[int, int], bytes], length: int) -> None:
        self.read_at = read_at
        self.length = length
        self._pos = 0

    def __len__(self) -> int:
        return self.length

    def pread(self, size: int, offset: int) -> bytes:
        """``size`` bytes at ``offset`` in the block (fewer past its end)."""
        size = max(0, min(size, self.length - offset))
        return self.read_at(offset, size) if size else b""

    def read(self, size: int = -1) -> bytes:
        """The next ``size`` bytes (all the rest if negative); zstandard's stream reader calls this."""
        if size < 0:
            size = self.length - self._pos
        data = self.pread(size, self._pos)
        self._pos += len(data)
        return data

    def rewound(self) -> "BlockReader":
        """A reader of the same block from its start."""
        return BlockReader(self.read_at, self.length)


#: Bytes of a block :func:`stored_block` reads at a time: under glibc's threshold for mapping an
#: allocation afresh (128 KiB), so that a pass reading block after block reuses memory (read
#: whole, each block would cost a page fault every 4 KiB: 8,000 for a 26 MB tar).
STORED_PIECE = 120 << 10


class StoredBlock(BlockReader):
    """A block's ``length`` stored bytes read whole at once through ``read_at(offset, size)``,
    :data:`STORED_PIECE` bytes at a time; its reads are views of those pieces where a read lies
    in one (a file's bytes are then copied once, into its own: :meth:`parts`). Raises
    :class:`SpanMismatch` (naming ``where``) if fewer bytes could be read."""

    def __init__(self, read_at: Callable[[int, int], bytes], length: int, where: str) -> None:
        self.pieces = [read_at(at, min(STORED_PIECE, length - at)) for at in range(0, length, STORED_PIECE)]
        if sum(map(len, self.pieces)) != length:
            raise SpanMismatch(f"{where}: fewer than its {length} stored bytes could be read")
        self._views = views = [memoryview(piece) for piece in self.pieces]
        #: The zstd block headers :func:`_stored_run` read in it: offset -> value.
        self.headers: dict[int, int] = {}
        # (no reference back to self: a cycle would keep the pieces until the collector runs, and a
        # pass's next blocks would take fresh memory, a page fault every 4 KiB)
        super().__init__(functools.partial(_view, views), length)

    def parts(self, offset: int, size: int) -> list[memoryview]:
        """Bytes ``[offset, offset + size)`` of the block (within it) as views of its pieces."""
        return _parts(self._views, offset, size)

    def rewound(self) -> BlockReader:
        return BlockReader(self.read_at, self.length)


def _parts(views: list[memoryview], offset: int, size: int) -> list[memoryview]:
    first, at = divmod(offset, STORED_PIECE)
    parts = []
    while size > 0 and first < len(views):
        part = views[first][at:at + size]
        parts.append(part)
        size -= len(part)
        first, at = first + 1, 0
    return parts


def _view(views: list[memoryview], offset: int, size: int) -> bytes | memoryview:
    parts = _parts(views, offset, size)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def _stored(source: bytes | BlockReader, offset: int, size: int) -> bytes:
    if isinstance(source, BlockReader):
        return source.pread(size, offset)
    return source[offset:offset + size]


def check_run(span: Span, run: bytes, where: str) -> bytes:
    """The file's bytes, ``span.prefix + run``, if ``run`` is the span's run; raises
    :class:`SpanMismatch` otherwise. Whoever reads a run some other way (a pread of
    a strategy 0 block) must pass it through here."""
    if len(run) != span.length or run_check(span.prefix, run) != span.check:
        raise SpanMismatch(
            f"{where}: the {span.length} bytes at offset {span.offset} of the decompressed block are not "
            "what the file table recorded (the block changed since, or the table is wrong)")
    if span.prefix:
        return span.prefix + run
    return run if type(run) is bytes else bytes(run)  # a view of a stored block's piece: its own bytes


def run_in(span: Span, payload: bytes, where: str) -> bytes:
    """The file ``span`` locates in ``payload``, its block decompressed (whole or its start),
    checked (:func:`check_run`)."""
    if span.end > len(payload):
        raise SpanMismatch(f"{where}: a span ends at {span.end}, past the block's {len(payload)} bytes")
    return check_run(span, payload[span.offset:span.end], where)


def new_decompressor(codec: Any) -> zstandard.ZstdDecompressor:
    """A zstd decompression context for ``codec``'s dictionary (a
    :class:`~atlasfs.formats.atlas.codec.BlockCodec`); one must not serve two threads at once."""
    if codec.dictionary is None:
        return zstandard.ZstdDecompressor()
    try:
        dctx = zstandard.ZstdDecompressor(dict_data=codec.dictionary.get())
        dctx.memory_size()  # loads the dictionary now, where its errors are caught
    except zstandard.ZstdError as exc:
        raise AtlasFormatError(f"{codec.dictionary.path}: not a usable zstd dictionary ({exc})") from None
    return dctx


def _read_inline(source: bytes | BlockReader, span: Span, codec: Any, where: str,
                 fingerprint: Callable[[], int | None] | None) -> bytes:
    """An inline file, once its block's fingerprint is found to be the one it was kept with.
    A compressed block's is tried first as its frame checksum (one 4-byte read, no header:
    a block that changed into one without a checksum would have to end in the very 4 bytes,
    a chance of 2^-32), then as the CRC-32 of its stored bytes: ``fingerprint()`` (a caller's,
    who remembers it), else read here whole, a piece at a time, if the block is within
    :func:`~.find.stored_bound` (None: it is not, or could not be read)."""
    length = len(source)
    compressed = codec.strategy != CompressionStrategy.NO_COMPRESSION
    if compressed and length >= 4:
        if inline_check(span.prefix, int.from_bytes(_stored(source, length - 4, 4), "little")) == span.check:
            return span.prefix
    if fingerprint is None:
        fingerprint = functools.partial(stored_fingerprint, source, codec)
    crc = fingerprint()
    if crc is not None and inline_check(span.prefix, crc) == span.check:
        return span.prefix
    raise SpanMismatch(f"{where}: the block is not the one whose small files the file table keeps "
                       "(it changed since, or the table is wrong)")


def stored_fingerprint(source: bytes | BlockReader, codec: Any) -> int | None:
    """The CRC-32 of a block's stored bytes (``source``), read a piece at a time; None if
    there are more than :func:`~.find.stored_bound` allows, or fewer could be read."""
    length = len(source)
    if length > stored_bound(codec.max_block_bytes, codec.strategy != CompressionStrategy.NO_COMPRESSION):
        return None
    if isinstance(source, BlockReader):
        return stored_crc_of(source.pread, length)
    return stored_crc(source)


def read_span(source: bytes | BlockReader, span: Span, codec: Any, where: str,
              dctx: zstandard.ZstdDecompressor | None = None, keep: Callable[[bytes], None] | None = None,
              whole: Callable[[], bytes] | None = None,
              fingerprint: Callable[[], int | None] | None = None) -> bytes:
    """The bytes of the file ``span`` locates, from its block as stored.

    ``source`` is the block's stored bytes, or a :class:`BlockReader` over
    them; ``codec`` the shard's :class:`~atlasfs.formats.atlas.codec.BlockCodec` (its
    strategy, dictionary and block bound); ``dctx`` a decompression context
    to use (else a new one). An inline file is checked against the block's
    fingerprint; strategy 0 reads the run alone; a zstd frame is decompressed
    from its start up to the run's end (at zstd block granularity, 128 KiB at
    most), never past ``codec.max_block_bytes``; ``keep``, if given, is handed the
    decompressed block up to the run's end (for later runs within it); ``whole``, if
    given, is called instead of that partial decompression and returns the block
    decompressed whole (which the caller keeps: :meth:`LocatedReads.read_span`);
    ``fingerprint``, if given, returns the CRC-32 of the block's stored bytes for an inline
    file (remembered by the caller: :class:`~.fingerprints.StoredFingerprints`). Raises
    :class:`SpanMismatch` if the bytes there are not the span's (:func:`check_run`),
    :class:`AtlasFormatError` if the frame is unusable.
    """
    if span.inline:
        return _read_inline(source, span, codec, where, fingerprint)
    if span.length == 0:
        return check_run(span, b"", where)
    if span.end > codec.max_block_bytes:
        raise SpanMismatch(f"{where}: a span ends at {span.end}, past the {codec.max_block_bytes}-byte block limit")
    if codec.strategy == CompressionStrategy.NO_COMPRESSION:
        return check_run(span, _stored(source, span.offset, span.length), where)
    head = _stored(source, 0, 18)
    content_size = codec.check_header(head, where)  # magic, dictionary, size within bounds
    if content_size >= 0 and span.end > content_size:
        raise SpanMismatch(f"{where}: a span ends at {span.end}, past the block's {content_size} bytes")
    stored = _stored_run(source, head, span)
    if stored is not None:
        return check_run(span, stored, where)
    if whole is not None:
        return run_in(span, whole(), where)
    if dctx is None:
        dctx = new_decompressor(codec)
    if isinstance(source, BlockReader):  # read from the block's start, whoever used it before
        source = source.rewound()
    try:
        with dctx.stream_reader(source, read_size=_READ_SIZE, read_across_frames=False,
                                closefd=False) as reader:
            if keep is None:
                reader.seek(span.offset)  # decompresses and drops the bytes before the run, a chunk at a time
            parts = []
            left = span.length if keep is None else span.end
            while left:
                part = reader.read(left)
                if not part:
                    break  # the frame ends first: checked below
                parts.append(part)
                left -= len(part)
    except zstandard.ZstdError as exc:
        raise AtlasFormatError(f"{where}: corrupt zstd frame ({exc})") from None
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    if keep is None:
        return check_run(span, data, where)
    keep(data)
    return check_run(span, data[span.offset:span.end], where)


#: Most zstd block headers :func:`_stored_run` reads to find a run (a frame's blocks hold
#: up to 128 KiB each: 64 reach 8 MiB into a block).
STORED_RUN_HEADERS = 64
_RAW_BLOCK, _RLE_BLOCK = 0, 1


def _stored_run(source: bytes | BlockReader, head: bytes, span: Span) -> bytes | None:
    """The run read straight from the frame, without decompressing, if every zstd block
    it overlaps is stored raw (zstd stores a block raw when it would not shrink:
    incompressible data such as JPEG bytes) or as one repeated byte; None otherwise.
    Only block headers (3 bytes every up to 128 KiB) and the run itself are read.
    The caller checks the result like any run (:func:`check_run`)."""
    if len(head) < 6:
        return None
    descriptor = head[4]
    single_segment = descriptor >> 5 & 1
    pos = (5 + (0 if single_segment else 1) + (0, 1, 2, 4)[descriptor & 3]
           + ((1 if single_segment else 0), 2, 4, 8)[descriptor >> 6])
    start, end = span.offset, span.end
    decoded = 0  # decompressed bytes before the block at ``pos``
    parts = []
    known = source.headers if isinstance(source, StoredBlock) else None  # a pass's: each read once a block
    for _ in range(STORED_RUN_HEADERS):
        value = known.get(pos) if known is not None else None
        if value is None:
            header = _stored(source, pos, 3)
            if len(header) < 3:
                return None
            value = int.from_bytes(header, "little")
            if known is not None:
                known[pos] = value
        kind, size, last = value >> 1 & 3, value >> 3, value & 1
        if kind not in (_RAW_BLOCK, _RLE_BLOCK):  # compressed: its decompressed size is not told
            return None
        lo, hi = max(start, decoded), min(end, decoded + size)
        if lo < hi:
            if isinstance(source, StoredBlock) and kind == _RAW_BLOCK:  # views: the run copied once, below
                parts += source.parts(pos + 3 + lo - decoded, hi - lo)
            elif kind == _RAW_BLOCK:
                parts.append(_stored(source, pos + 3 + lo - decoded, hi - lo))
            else:
                parts.append(bytes(_stored(source, pos + 3, 1)) * (hi - lo))
        decoded += size
        pos += 3 + (size if kind == _RAW_BLOCK else 1)
        if decoded >= end:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if last:
            return None
    return None
