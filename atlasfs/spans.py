"""Where a file's bytes already lie, verbatim, in its block's decompressed pickle.

A cold read of one file through the block path pays for the whole block:
decompress it, unpickle every example, name and encode the example. Yet most
file bytes are already in the decompressed block as one run: the pickle
stores a ``bytes`` value and the UTF-8 of a ``str`` as length-prefixed runs
(``SHORT_BINBYTES``/``BINBYTES``/``BINBYTES8``,
``SHORT_BINUNICODE``/``BINUNICODE``/``BINUNICODE8``), and a contiguous numpy
array's data as one run too (``BINBYTES``..., or ``BYTEARRAY8`` under
protocol 5), so that a ``.npy`` file is a small header followed by that run.

:func:`find_spans` records, when a block is decoded anyway (while a shard's
file table is built), where each such file's run lies in the decompressed
block, as a :class:`Span`; it keeps a span only after checking that the
bytes there equal the file's real encoding (:func:`atlasfs.naming.encode_as`).
:func:`read_span` then serves the file from the block's stored bytes alone:
strategy 0 needs just a ``pread`` of the run; a zstd frame is decompressed
only as far as the end of the run; nothing is unpickled. Every span carries
a checksum of its run (CRC-32), compared on every read, so that a block that changed
since the span was recorded raises :class:`SpanMismatch` instead of serving
wrong bytes.

:class:`SpanColumns` packs a table's spans into fixed-width columns (10
bytes a file) plus the distinct ``.npy`` headers, for :mod:`atlasfs.filetable`.

Pure functions and small value types: no FUSE, no tree, no cache.
"""

from __future__ import annotations

import functools
import os
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import zstandard

from .errors import AtlasFormatError
from .filetable import UNKNOWN_SIZE
from .sources.atlas.meta import CompressionStrategy
from .naming import TEXT_EXTS, encode_as

#: Pickle protocols whose runs this module knows: 3 added ``BINBYTES``, 4 the
#: short and 8-byte forms, 5 ``BYTEARRAY8`` (numpy arrays' data). Blocks in
#: older protocols store bytes through ``_codecs.encode`` and get no spans.
PROTOCOLS = frozenset({3, 4, 5})
#: Leading run bytes searched for together with the opcode and length; the
#: rest is compared in place, so that a search never copies or preprocesses a
#: long run.
_HEAD = 48
#: How much of a block the searches that leave :func:`find_spans`'s quick path
#: may scan, as a multiple of its length (plus :data:`_BUDGET_SLACK`). A search
#: that fails (a value first pickled inside an earlier example's other field,
#: an array numpy converted while unpickling) scans to the block's end; this
#: bound keeps a block full of them from costing one scan per file.
SCAN_BUDGET = 3
_BUDGET_SLACK = 1 << 16
#: How many stored bytes the zstd stream reader asks a :class:`BlockReader` for
#: at a time: a frame is read (and decompressed) only as far as a span needs.
_READ_SIZE = 1 << 17
_NPY_MAGIC = b"\x93NUMPY"
#: The checksum of a run, kept with its span and compared on every read: 32 bits.
#: CRC-32 (zlib, ~2-4 GB/s) is the one the standard library has; a faster hash
#: (xxhash's XXH3, ~10x) would cut what spans cost to build and read. Tables
#: must record which one made their checksums.
run_checksum: Callable[[bytes | memoryview], int] = zlib.crc32
#: Fixed-width columns of :class:`SpanColumns`.
NO_SPAN = 0xFFFFFFFF
MAX_HEADERS = 0xFFFF
#: Bound on the distinct ``.npy`` headers a table keeps (~128 bytes each): arrays of
#: many shapes (token arrays of every length) would otherwise grow it by 8 MiB.
MAX_HEADER_BYTES = 1 << 20

_RAW, _TEXT, _NPY = 0, 1, 2


class SpanMismatch(AtlasFormatError):
    """A span's bytes are not what they were when the span was recorded (the block
    changed, or a stored table lies). The file must be read through its block."""


class Span(NamedTuple):
    """Where the bytes of one file lie in its block's decompressed pickle.

    The file is ``header + block[offset:offset + length]``. ``header`` is empty
    except for ``.npy`` files, where it is the ``.npy`` header (the run is the
    array's data); ``checksum`` is :data:`run_checksum` of the run, compared on every read.
    """

    offset: int
    length: int
    checksum: int
    header: bytes = b""

    @property
    def end(self) -> int:
        """Where the run ends in the decompressed block: what a read must decompress."""
        return self.offset + self.length

    @property
    def size(self) -> int:
        """The file's size."""
        return len(self.header) + self.length


# ---------------------------------------------------------------- finding spans


def pickle_protocol(payload: bytes) -> int | None:
    """The protocol a pickle declares (``PROTO`` opcode), or None if it has none (0 or 1)."""
    if len(payload) >= 2 and payload[0] == 0x80:
        return payload[1]
    return None


@functools.lru_cache(maxsize=4096)  # suffixes repeat from example to example
def _suffix_kind(suffix: str) -> int | None:
    """Which run a non-bytes value of a file ``<key>.<suffix>`` can be: its encoding
    is the UTF-8 of a ``str`` under a text extension, ``.npy`` under ``npy``."""
    ext = suffix.rsplit(".", 1)[-1].lower()  # naming's rule: the last part, lower-cased
    if ext in TEXT_EXTS:
        return _TEXT
    return _NPY if ext == "npy" else None


#: The value types whose files may be runs (exact types, as naming's are).
_VALUE_KINDS = {bytes: _RAW, str: _TEXT, np.ndarray: _NPY}
#: Opcodes of runs with 1-byte and 4-byte lengths, by kind (_RAW, _TEXT).
_SHORT_OPCODES = (b"C", b"\x8c")  # SHORT_BINBYTES, SHORT_BINUNICODE
_LONG_OPCODES = (b"B", b"X")  # BINBYTES, BINUNICODE


def _opcodes(kind: int, n: int, protocol: int) -> tuple[bytes, ...]:
    """The opcode-and-length prefixes a run of ``n`` bytes of ``kind`` may follow,
    likeliest first: CPython's picklers (C and Python) take the 1-byte form up to 255
    bytes (for text from protocol 4 on), then the 4-byte one, then the 8-byte one."""
    text = kind == _TEXT
    if n <= 0xFF and (not text or protocol >= 4):
        form = _SHORT_OPCODES[text] + n.to_bytes(1, "little")
    elif n <= 0xFFFFFFFF:
        form = _LONG_OPCODES[text] + n.to_bytes(4, "little")
    else:
        form = (b"\x8d" if text else b"\x8e") + n.to_bytes(8, "little")  # BINUNICODE8, BINBYTES8
    if kind == _NPY and protocol >= 5:
        # numpy pickles a contiguous array's data as an in-band PickleBuffer (BYTEARRAY8)
        # under protocol 5, and as bytes otherwise (non-contiguous arrays, older numpy).
        return (b"\x96" + n.to_bytes(8, "little"), form)
    return (form,)


class _Search:
    """The searches of one block that the quick path of :func:`find_spans` leaves: every
    ``.npy`` file, and runs not found at the first place their head was. Bounded."""

    def __init__(self, payload: bytes, protocol: int) -> None:
        self.payload = payload
        self.protocol = protocol
        self.budget = SCAN_BUDGET * len(payload) + _BUDGET_SLACK

    def run_at(self, opcode: bytes, run: bytes | memoryview, start: int) -> int | None:
        """The offset of the first copy of ``run`` preceded by ``opcode`` at or after
        ``start``, or None. Every byte of it is compared."""
        payload = self.payload
        needle = opcode + bytes(run[:_HEAD])
        at = start
        while self.budget > 0:
            found = payload.find(needle, at)
            if found < 0:
                self.budget -= len(payload) - at
                return None
            self.budget -= found + len(needle) - at
            offset = found + len(opcode)
            if len(run) <= _HEAD or payload.startswith(run, offset):
                return offset
            at = found + 1  # the head matched but not the rest: look further
        return None

    def span(self, kind: int, suffix: str, value: Any, start: int) -> Span | None:
        """The span of the file ``<key>.<suffix>`` of ``value``, a value first met
        in the example whose runs start at ``start``."""
        if kind == _RAW:
            header, run = b"", value  # bytes are served unchanged (encode_as returns them as they are)
        else:
            encoded = encode_as(suffix, value)
            if kind == _TEXT:
                header, run = b"", encoded
            else:
                cut = len(encoded) - value.nbytes
                if cut <= 0 or not encoded.startswith(_NPY_MAGIC):
                    return None
                header, run = encoded[:cut], memoryview(encoded)[cut:]
        if not len(run):
            return Span(0, 0, 0, header)  # nothing to read: any place will do
        for opcode in _opcodes(kind, len(run), self.protocol):
            offset = self.run_at(opcode, run, start)
            if offset is not None:
                return Span(offset, len(run), run_checksum(run), header)
        return None


_UNSEEN = object()


def find_spans(payload: bytes, fields: Sequence[Sequence[tuple[str, Any]]]) -> list[list[Span | None]]:
    """The span of every file of a block, or None where its bytes are not one run there.

    ``payload`` is the block's decompressed pickle and ``fields[i]`` the files
    of its example ``i`` as :func:`~atlasfs.naming.example_fields` names them
    (``(suffix, value)``, the values being the unpickled example's own
    objects). The result has the shape of ``fields``. Every span found
    satisfies ``span.header + payload[span.offset:span.end] ==
    encode_as(suffix, value)``: it is kept only after that comparison.

    Examples are pickled one after the other, so each example's runs are
    searched from where the previous example's last run ended, and a block is
    scanned about once. A value met before (the pickle memo makes objects
    shared when pickled shared again when unpickled) reuses its span. Searching
    is bounded (:data:`SCAN_BUDGET`): files past the bound get None, never a
    wrong span.
    """
    spans: list[list[Span | None]] = [[None] * len(files) for files in fields]
    protocol = pickle_protocol(payload)
    if protocol not in PROTOCOLS:
        return spans
    search = _Search(payload, protocol)
    # This runs over every file of every block when a table is built, so the usual
    # case (bytes or text under 4 GiB, found where its head first appears) is inlined,
    # and Spans are made without NamedTuple's Python-level __new__.
    find, startswith, checksum, new, to_bytes = payload.find, payload.startswith, run_checksum, tuple.__new__, int.to_bytes
    short_text = protocol >= 4
    known: dict[int, Any] = {}  # id of a value -> its span; the values stay alive meanwhile
    value_kinds = _VALUE_KINDS
    cursor = 0  # every run of the examples still to come starts here or later
    for files, found in zip(fields, spans):
        # The example's runs are each searched from its start, not one after the other:
        # files come sorted by suffix, not in the order the pickler met their values.
        start = cursor
        for j, (suffix, value) in enumerate(files):
            kind = value_kinds.get(type(value))
            if kind is None or (kind != _RAW and _suffix_kind(suffix) != kind):
                continue
            span = known.get(id(value), _UNSEEN)
            if span is _UNSEEN:
                if kind == _NPY:
                    span = search.span(kind, suffix, value, start)
                else:
                    run = value if kind == _RAW else encode_as(suffix, value)
                    n = len(run)
                    if not n or n > 0xFFFFFFFF:
                        span = search.span(kind, suffix, value, start)  # empty, or 8-byte lengths
                    elif search.budget <= 0:
                        span = None
                    else:
                        if n <= 0xFF and (short_text or kind == _RAW):
                            opcode = _SHORT_OPCODES[kind] + to_bytes(n, 1, "little")
                        else:
                            opcode = _LONG_OPCODES[kind] + to_bytes(n, 4, "little")
                        # Found, it scanned the example's earlier runs and the gap to this one:
                        # the cursor only moves on, so such scans add up to about one pass over
                        # the block (plus an example's own runs again) and are not counted.
                        # Not found, it scanned to the block's end: that is counted.
                        at = find(opcode + run[:_HEAD], start)
                        if at < 0:
                            search.budget -= len(payload) - start
                            span = None
                        elif n <= _HEAD or startswith(run, at + len(opcode)):
                            span = new(Span, (at + len(opcode), n, checksum(run), b""))
                        else:  # only its head is there: search on, counting the cost
                            span = search.span(kind, suffix, value, start)
                known[id(value)] = span
            found[j] = span
            if span is not None and span[0] + span[1] > cursor:
                cursor = span[0] + span[1]
    return spans


# ---------------------------------------------------------------- reading spans


class BlockReader:
    """The stored bytes of one block of ``data.bin`` as a file object, read with
    ``pread`` only as far as asked: a span near a block's start reads little of it."""

    def __init__(self, fd: int, start: int, end: int) -> None:
        self.fd = fd
        self.start = start
        self.end = end
        self._pos = start

    def __len__(self) -> int:
        return self.end - self.start

    def pread(self, size: int, offset: int) -> bytes:
        """``size`` bytes at ``offset`` in the block (fewer past its end)."""
        size = max(0, min(size, self.end - self.start - offset))
        return os.pread(self.fd, size, self.start + offset) if size else b""

    def read(self, size: int = -1) -> bytes:
        """The next ``size`` bytes (all the rest if negative); zstandard's stream reader calls this."""
        if size < 0:
            size = self.end - self._pos
        data = self.pread(size, self._pos - self.start)
        self._pos += len(data)
        return data


def _stored(source: bytes | BlockReader, offset: int, size: int) -> bytes:
    if isinstance(source, BlockReader):
        return source.pread(size, offset)
    return source[offset:offset + size]


def check_run(span: Span, run: bytes, where: str) -> bytes:
    """The file's bytes, ``span.header + run``, if ``run`` is the span's run; raises
    :class:`SpanMismatch` otherwise. Whoever reads a run some other way (a pread of
    a strategy 0 block) must pass it through here."""
    if len(run) != span.length or run_checksum(run) != span.checksum:
        raise SpanMismatch(
            f"{where}: the {span.length} bytes at offset {span.offset} of the decompressed block are not "
            "what the file table recorded (the block changed since, or the table is wrong)")
    return span.header + run if span.header else run


def new_decompressor(codec: Any) -> zstandard.ZstdDecompressor:
    """A zstd decompression context for ``codec``'s dictionary (a :class:`~atlasfs.sources.atlas.codec.BlockCodec`).

    A new one costs microseconds (the dictionary is digested once, by its
    :class:`~atlasfs.sources.atlas.codec.ZstdDictionary`); one must not serve two threads at once.
    """
    if codec.dictionary is None:
        return zstandard.ZstdDecompressor()
    try:
        dctx = zstandard.ZstdDecompressor(dict_data=codec.dictionary.get())
        dctx.memory_size()  # loads the dictionary now, where its errors are caught
    except zstandard.ZstdError as exc:
        raise AtlasFormatError(f"{codec.dictionary.path}: not a usable zstd dictionary ({exc})") from None
    return dctx


def read_span(source: bytes | BlockReader, span: Span, codec: Any, where: str,
              dctx: zstandard.ZstdDecompressor | None = None) -> bytes:
    """The bytes of the file ``span`` locates, from its block as stored.

    ``source`` is the block's stored bytes, or a :class:`BlockReader` over
    them; ``codec`` the shard's :class:`~atlasfs.sources.atlas.codec.BlockCodec` (its
    strategy, dictionary and block bound); ``dctx`` a decompression context
    to use (else a new one). Strategy 0 reads the run alone; a zstd frame is
    decompressed from its start up to the run's end (at zstd block
    granularity, 128 KiB at most), never past ``codec.max_block_bytes``.
    Raises :class:`SpanMismatch` if the bytes there are not the span's (check
    with :func:`check_run`), :class:`AtlasFormatError` if the frame is unusable.
    """
    if span.length == 0:
        return span.header
    if span.end > codec.max_block_bytes:
        raise SpanMismatch(f"{where}: a span ends at {span.end}, past the {codec.max_block_bytes}-byte block limit")
    if codec.strategy == CompressionStrategy.NO_COMPRESSION:
        return check_run(span, _stored(source, span.offset, span.length), where)
    content_size = codec.check_header(_stored(source, 0, 18), where)  # magic, dictionary, size within bounds
    if content_size >= 0 and span.end > content_size:
        raise SpanMismatch(f"{where}: a span ends at {span.end}, past the block's {content_size} bytes")
    if dctx is None:
        dctx = new_decompressor(codec)
    if isinstance(source, BlockReader):  # read from the block's start, whoever used it before
        source = BlockReader(source.fd, source.start, source.end)
    try:
        with dctx.stream_reader(source, read_size=_READ_SIZE, read_across_frames=False,
                                closefd=False) as reader:
            reader.seek(span.offset)  # decompresses and drops the bytes before the run, a chunk at a time
            parts = []
            left = span.length
            while left:
                part = reader.read(left)
                if not part:
                    break  # the frame ends first: checked below
                parts.append(part)
                left -= len(part)
    except zstandard.ZstdError as exc:
        raise AtlasFormatError(f"{where}: corrupt zstd frame ({exc})") from None
    return check_run(span, parts[0] if len(parts) == 1 else b"".join(parts), where)


# ---------------------------------------------------------------- storing spans


class SpanColumns:
    """A table's spans as fixed-width columns, one row per file, for
    :mod:`atlasfs.filetable`: 10 bytes a file, plus each distinct ``.npy`` header once.

    ``offset`` (uint32, :data:`NO_SPAN` where a file has none), ``checksum``
    (uint32), ``header`` (uint16: 0 for none, else 1 + its index in
    ``headers``). A span's length is not stored: it is the file's size (which
    the table holds) minus its header's. A table whose files have more distinct
    headers than :data:`MAX_HEADERS`, or more than :data:`MAX_HEADER_BYTES` of
    them (arrays of that many shapes), keeps spans only for the files whose
    header came first.
    """

    def __init__(self, offset: np.ndarray, checksum: np.ndarray, header: np.ndarray, headers: list[bytes]) -> None:
        self.offset = offset
        self.checksum = checksum
        self.header = header
        self.headers = headers

    @classmethod
    def build(cls, spans: Sequence[Span | None]) -> "SpanColumns":
        """Columns for ``spans``, one per table row (None: no span)."""
        n = len(spans)
        offset = np.full(n, NO_SPAN, dtype=np.uint32)
        checksum = np.zeros(n, dtype=np.uint32)
        header = np.zeros(n, dtype=np.uint16)
        numbers: dict[bytes, int] = {}
        header_bytes = 0
        for i, span in enumerate(spans):
            if span is None or span.offset >= NO_SPAN:
                continue
            if span.header:
                number = numbers.get(span.header)
                if number is None:
                    if len(numbers) >= MAX_HEADERS or header_bytes + len(span.header) > MAX_HEADER_BYTES:
                        continue
                    header_bytes += len(span.header)
                    number = numbers[span.header] = len(numbers) + 1
                header[i] = number
            offset[i] = span.offset
            checksum[i] = span.checksum
        return cls(offset, checksum, header, list(numbers))

    def __len__(self) -> int:
        return len(self.offset)

    def span(self, i: int, size: int) -> Span | None:
        """The span of row ``i``, whose file is ``size`` bytes, or None."""
        offset = self.offset.item(i)
        if offset == NO_SPAN:
            return None
        number = self.header.item(i)
        header = self.headers[number - 1] if number else b""
        length = size - len(header)
        if size == UNKNOWN_SIZE or length < 0:  # a size smaller than its header: only if the table lies
            return None
        return Span(offset, length, self.checksum.item(i), header)

    def problem(self) -> str | None:
        """Why stored columns are unusable, or None (they come from an untrusted file)."""
        if not len(self.offset) == len(self.checksum) == len(self.header):
            return "span columns of different lengths"
        if len(self.headers) > MAX_HEADERS or (len(self.header) and int(self.header.max()) > len(self.headers)):
            return "a span header out of range"
        if sum(map(len, self.headers)) > MAX_HEADER_BYTES:
            return "span headers too large"
        if any(not h.startswith(_NPY_MAGIC) for h in self.headers):
            return "a span header that is not a .npy header"
        return None
