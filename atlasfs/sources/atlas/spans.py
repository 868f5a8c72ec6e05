"""Where an Atlas file's bytes already lie, verbatim, in its block's decompressed
pickle, and reading them from there without unpickling (issue #18).

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
block, as a :class:`~atlasfs.sources.source.Locator` (here called a *span*);
it keeps a span only after checking that the bytes there equal the file's real
encoding (:func:`atlasfs.naming.encode_as`). :func:`file_locators` adds the
small files (:data:`INLINE_MAX` bytes or less: ``cls`` ints, small ``json``
dicts), which are no run, as *inline* locators holding their bytes, tied to the
block by its fingerprint (:func:`block_fingerprint`). :func:`read_span` then
serves a file from the block's stored bytes alone: strategy 0 needs just a
``pread`` of the run; a zstd frame is decompressed only as far as the end of
the run; an inline file needs the block's fingerprint (4 bytes of its frame);
nothing is unpickled, so no pickle code runs. The mount's reads go through
:class:`LocatedReads` (the shard's side), which reads runs over raw zstd blocks alone but
decompresses any other compressed block whole at its first read and keeps it for the next:
random readers come back to blocks, and in the benchmark's cold pass that cost 20-30% less
in all than decompressing each time only up to a run's end (docs/performance.md).
Every span carries a check (CRC-32 of its prefix and run), compared on every
read, so that a block that changed since the span was recorded raises
:class:`SpanMismatch` instead of serving wrong bytes.

No FUSE and no tree: functions, small value types, and two small process-wide
caches of decompressed blocks (:data:`PAYLOADS`, :data:`JUST_DECODED`). The
shard (:class:`~atlasfs.sources.atlas.dataset.Shard`) calls them.
"""

from __future__ import annotations

import functools
import threading
import zlib
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import zstandard

from ...errors import AtlasFormatError
from ...naming import TEXT_EXTS, encode_as
from ..source import Locator, SpanMismatch
from .meta import CompressionStrategy

__all__ = ["Span", "SpanMismatch", "BlockReader", "BlockStore", "LocatedReads", "run_in", "find_spans",
           "file_locators", "block_fingerprint", "read_span", "check_run", "run_check"]

#: A span is a locator of a run (the tree's name for what a source records).
Span = Locator

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
#: Files of at most this many bytes are kept whole in the file table (inline
#: locators) instead of located in their block: a read of one needs no
#: decompression. 128 covers ``cls`` files and small ``json`` dicts (a URL and a few
#: numbers); the table keeps at most :data:`atlasfs.filetable.INLINE_AVERAGE` bytes a
#: file of them in all.
INLINE_MAX = 128
#: Blocks whose frame has no content checksum (strategy 0, frames of writers that
#: omit it) are fingerprinted by the CRC-32 of their stored bytes, read whole on
#: every inline read: only up to this size (larger ones get no inline locators).
FINGERPRINT_READ_MAX = 256 << 10

_RAW, _TEXT, _NPY = 0, 1, 2
_crc32 = zlib.crc32


def run_check(prefix: bytes, run: bytes | memoryview) -> int:
    """The 32-bit check a span carries: CRC-32 of its prefix and run together, so that
    neither can change unnoticed (a stored table's prefix is untrusted too)."""
    return _crc32(run, _crc32(prefix)) if prefix else _crc32(run)


def inline_check(data: bytes, fingerprint: int) -> int:
    """The check of an inline file: its bytes and its block's fingerprint together."""
    return _crc32(data, fingerprint)


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
            prefix, run = b"", value  # bytes are served unchanged (encode_as returns them as they are)
        else:
            encoded = encode_as(suffix, value)
            if kind == _TEXT:
                prefix, run = b"", encoded
            else:
                cut = len(encoded) - value.nbytes
                if cut <= 0 or not encoded.startswith(_NPY_MAGIC):
                    return None
                prefix, run = encoded[:cut], memoryview(encoded)[cut:]
        if not len(run):
            return Span(0, 0, run_check(prefix, b""), prefix)  # nothing to read: any place will do
        for opcode in _opcodes(kind, len(run), self.protocol):
            offset = self.run_at(opcode, run, start)
            if offset is not None:
                return Span(offset, len(run), run_check(prefix, run), prefix)
        return None


_UNSEEN = object()


def find_spans(payload: bytes, fields: Sequence[Sequence[tuple[str, Any]]]) -> list[list[Span | None]]:
    """The span of every file of a block, or None where its bytes are not one run there.

    ``payload`` is the block's decompressed pickle and ``fields[i]`` the files
    of its example ``i`` as :func:`~atlasfs.naming.example_fields` names them
    (``(suffix, value)``, the values being the unpickled example's own
    objects). The result has the shape of ``fields``. Every span found
    satisfies ``span.prefix + payload[span.offset:span.end] ==
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
    find, startswith, checksum, new, to_bytes = payload.find, payload.startswith, _crc32, tuple.__new__, int.to_bytes
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
                            span = new(Span, (at + len(opcode), n, checksum(run), b"", False))
                        else:  # only its head is there: search on, counting the cost
                            span = search.span(kind, suffix, value, start)
                known[id(value)] = span
            found[j] = span
            if span is not None and span[0] + span[1] > cursor:
                cursor = span[0] + span[1]
    return spans




# ---------------------------------------------------------------- small files, inline

def _maybe_small(value: Any, budget: int = INLINE_MAX) -> bool:
    """Whether ``value`` may encode in about ``budget`` bytes, judged without encoding it:
    a container of more scalars or longer strings than that cannot (each takes a byte
    at least). Saves encoding every big ``json`` list at table build only to drop it."""
    stack = [value]
    pop, extend = stack.pop, stack.extend
    while stack:
        item = pop()
        kind = type(item)
        if kind is str or kind is bytes:
            budget -= len(item) + 1
        elif kind is dict:
            budget -= 2 * len(item) + 1
            if budget < 0:
                return False
            extend(item.keys())
            extend(item.values())
        elif kind is list or kind is tuple:
            budget -= len(item) + 1
            if budget < 0:
                return False
            extend(item)
        elif kind is np.ndarray:
            budget -= item.nbytes + 100  # its .npy header alone is ~128 bytes
        else:  # a scalar (an int's digits, a float's repr: short) or anything else
            budget -= 1
        if budget < 0:
            return False
    return True


def file_locators(payload: bytes, fields: Sequence[Sequence[tuple[str, Any]]],
                  fingerprint: int | None) -> list[list[Locator | None]]:
    """Every file's locator in a block: inline for files of :data:`INLINE_MAX` bytes or
    less when the block has a ``fingerprint`` (else they get spans like the others),
    a span (:func:`find_spans`) for the others whose bytes are one run, None for the rest."""
    found = find_spans(payload, fields)
    if fingerprint is None:
        return found
    for files, located in zip(fields, found):
        for j, (suffix, value) in enumerate(files):
            span = located[j]
            if span is not None and span.size > INLINE_MAX:
                continue
            if span is None and not _maybe_small(value):
                continue
            try:
                data = encode_as(suffix, value)
            except Exception:  # the tree reports what cannot be encoded when it reads it
                continue
            if len(data) <= INLINE_MAX:
                located[j] = Locator(0, 0, inline_check(data, fingerprint), data, True)
    return found


def block_fingerprint(stored: bytes, strategy: CompressionStrategy) -> int | None:
    """What ties a block's inline files to it, from the block as stored: a frame's own
    content checksum (XXH64 of the decompressed block, its low 32 bits: the frame's last
    4 bytes) when it has one, else the CRC-32 of the stored bytes if there are at most
    :data:`FINGERPRINT_READ_MAX` of them, else None (no inline files in that block)."""
    if strategy != CompressionStrategy.NO_COMPRESSION:
        try:
            if zstandard.get_frame_parameters(stored[:18]).has_checksum and len(stored) >= 4:
                return int.from_bytes(stored[-4:], "little")
        except zstandard.ZstdError:
            return None
    return _crc32(stored) if len(stored) <= FINGERPRINT_READ_MAX else None


# ---------------------------------------------------------------- reading spans


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
    return span.prefix + run if span.prefix else run


def run_in(span: Span, payload: bytes, where: str) -> bytes:
    """The file ``span`` locates in ``payload``, its block decompressed (whole or its start),
    checked (:func:`check_run`)."""
    if span.end > len(payload):
        raise SpanMismatch(f"{where}: a span ends at {span.end}, past the block's {len(payload)} bytes")
    return check_run(span, payload[span.offset:span.end], where)


def new_decompressor(codec: Any) -> zstandard.ZstdDecompressor:
    """A zstd decompression context for ``codec``'s dictionary (a
    :class:`~atlasfs.sources.atlas.codec.BlockCodec`); one must not serve two threads at once."""
    if codec.dictionary is None:
        return zstandard.ZstdDecompressor()
    try:
        dctx = zstandard.ZstdDecompressor(dict_data=codec.dictionary.get())
        dctx.memory_size()  # loads the dictionary now, where its errors are caught
    except zstandard.ZstdError as exc:
        raise AtlasFormatError(f"{codec.dictionary.path}: not a usable zstd dictionary ({exc})") from None
    return dctx


def _read_inline(source: bytes | BlockReader, span: Span, codec: Any, where: str) -> bytes:
    """An inline file, once its block's fingerprint is found to be the one it was kept with.
    A compressed block's is tried first as its frame checksum (one 4-byte read, no header:
    a block that changed into one without a checksum would have to end in the very 4 bytes,
    a chance of 2^-32), then, for a small block, as the CRC-32 of all of it."""
    length = len(source)
    if codec.strategy != CompressionStrategy.NO_COMPRESSION and length >= 4:
        if inline_check(span.prefix, int.from_bytes(_stored(source, length - 4, 4), "little")) == span.check:
            return span.prefix
    if length <= FINGERPRINT_READ_MAX and inline_check(span.prefix, _crc32(_stored(source, 0, length))) == span.check:
        return span.prefix
    raise SpanMismatch(f"{where}: the block is not the one whose small files the file table keeps "
                       "(it changed since, or the table is wrong)")


def read_span(source: bytes | BlockReader, span: Span, codec: Any, where: str,
              dctx: zstandard.ZstdDecompressor | None = None, keep: Callable[[bytes], None] | None = None,
              whole: Callable[[], bytes] | None = None) -> bytes:
    """The bytes of the file ``span`` locates, from its block as stored.

    ``source`` is the block's stored bytes, or a :class:`BlockReader` over
    them; ``codec`` the shard's :class:`~atlasfs.sources.atlas.codec.BlockCodec` (its
    strategy, dictionary and block bound); ``dctx`` a decompression context
    to use (else a new one). An inline file is checked against the block's
    fingerprint; strategy 0 reads the run alone; a zstd frame is decompressed
    from its start up to the run's end (at zstd block granularity, 128 KiB at
    most), never past ``codec.max_block_bytes``; ``keep``, if given, is handed the
    decompressed block up to the run's end (for later runs within it); ``whole``, if
    given, is called instead of that partial decompression and returns the block
    decompressed whole (which the caller keeps: :meth:`LocatedReads.read_span`). Raises
    :class:`SpanMismatch` if the bytes there are not the span's (:func:`check_run`),
    :class:`AtlasFormatError` if the frame is unusable.
    """
    if span.inline:
        return _read_inline(source, span, codec, where)
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
    for _ in range(STORED_RUN_HEADERS):
        header = _stored(source, pos, 3)
        if len(header) < 3:
            return None
        value = int.from_bytes(header, "little")
        kind, size, last = value >> 1 & 3, value >> 3, value & 1
        if kind not in (_RAW_BLOCK, _RLE_BLOCK):  # compressed: its decompressed size is not told
            return None
        lo, hi = max(start, decoded), min(end, decoded + size)
        if lo < hi:
            if kind == _RAW_BLOCK:
                parts.append(_stored(source, pos + 3 + lo - decoded, hi - lo))
            else:
                parts.append(_stored(source, pos + 3, 1) * (hi - lo))
        decoded += size
        pos += 3 + (size if kind == _RAW_BLOCK else 1)
        if decoded >= end:
            return parts[0] if len(parts) == 1 else b"".join(parts)
        if last:
            return None
    return None


class PayloadCache:
    """Decompressed blocks (or their first bytes) kept for the located reads that follow:
    a random reader that comes back to a block finds its run there and pays a slice, not a
    decompression. Bounded in bytes (:data:`PAYLOAD_KEEP_BYTES`), least recently used
    first out; one for the process, like the zstd contexts' pool. What it holds is checked
    like anything else a span is read from, so a stale entry can only cost a fallback."""

    def __init__(self, max_bytes: int, max_items: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._items: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> bytes | None:
        with self._lock:
            payload = self._items.get(key)
            if payload is not None:
                self._items.move_to_end(key)
            return payload

    def put(self, key: Hashable, payload: bytes) -> None:
        """Keep ``payload`` for ``key`` unless as much of the block is kept already."""
        if len(payload) > self.max_bytes // 4:
            return
        with self._lock:
            old = self._items.get(key)
            if old is not None:
                if len(old) >= len(payload):
                    return
                self._bytes -= len(old)
            self._items[key] = payload
            self._items.move_to_end(key)
            self._bytes += len(payload)
            while self._bytes > self.max_bytes or len(self._items) > self.max_items:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= len(evicted)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


#: What :data:`PAYLOADS` keeps: part of the daemon's stated fixed overhead (docs/performance.md).
#: The mount's located reads keep what they decompress in the tree's cache instead (a
#: :class:`~atlasfs.sources.source.Scratch`); this holds the pickles decodes made for the
#: table builds that follow them, and serves library use.
PAYLOAD_KEEP_BYTES = 16 << 20
PAYLOADS = PayloadCache(PAYLOAD_KEEP_BYTES)
#: The pickles of the last blocks decoded, for the table build that searches them right after
#: (:meth:`LocatedReads.file_spans`): as many as blocks are decoded at once
#: (``blocks.DECODERS``), so that decodes made to serve reads do not push
#: :data:`PAYLOADS` out.
JUST_DECODED = PayloadCache(64 << 20, max_items=2)


# ---------------------------------------------------------------- the shard's side


@runtime_checkable
class BlockStore(Protocol):
    """What :class:`LocatedReads` needs of the shard it is mixed into (an Atlas
    :class:`~atlasfs.sources.atlas.dataset.Shard`): where its blocks are and how to read
    them. ``tests/test_located_reads.py`` checks that a shard is one."""

    data_path: str
    index_path: str
    index: np.ndarray  # block ``b``'s stored bytes are ``index[b]:index[b + 1]`` of data.bin
    codec: Any  # its BlockCodec: strategy, dictionary, bounds, decompress

    @property
    def num_blocks(self) -> int: ...

    def block_where(self, block: int) -> str: ...

    def check_unchanged(self) -> None: ...

    def read_raw(self, block: int) -> bytes: ...

    def read_range(self, block: int, offset: int, size: int) -> bytes: ...


class LocatedReads:
    """:meth:`~atlasfs.sources.source.SourceShard.file_spans` and
    :meth:`~atlasfs.sources.source.SourceShard.read_span` for an Atlas
    :class:`~atlasfs.sources.atlas.dataset.Shard` (mixed into it, so that the
    reader module keeps only what reads blocks): the shard must be a :class:`BlockStore`."""

    def _payload_key(self, block: int) -> tuple[Any, ...]:
        shard = cast(BlockStore, self)
        return (shard.data_path, shard.index_path, block, int(shard.index[block]), int(shard.index[block + 1]))

    def payload_keeper(self, block: int) -> Callable[[bytes], None] | None:
        """What keeps a compressed block's decompressed pickle once decoded (in
        :data:`JUST_DECODED`): :meth:`file_spans`, which the tree asks next when it builds a
        table, then searches it without decompressing the block again."""
        shard = cast(BlockStore, self)
        if shard.codec.strategy == CompressionStrategy.NO_COMPRESSION:
            return None  # its stored bytes are its pickle: read again in place
        return functools.partial(JUST_DECODED.put, self._payload_key(block))

    def kept_payload(self, block: int) -> bytes | None:
        """The decompressed pickle of ``block`` if a located read or a decode made it a moment
        ago (in :data:`PAYLOADS`, which holds whole blocks only), checked unchanged on disk:
        a decode then only unpickles it."""
        shard = cast(BlockStore, self)
        if shard.codec.strategy == CompressionStrategy.NO_COMPRESSION:
            return None
        if isinstance(shard.index, np.memmap):  # first: a mapped index.npy truncated since open would raise SIGBUS
            shard.check_unchanged()
        payload = PAYLOADS.get(self._payload_key(block))
        if payload is not None:
            shard.check_unchanged()
        return payload

    def file_spans(self, block: int, fields: list[list[tuple[str, Any]]]) -> list[list[Locator | None]] | None:
        """The block's decompressed pickle (kept by its decode, or read and decompressed
        again) is searched; nothing is unpickled."""
        shard = cast(BlockStore, self)
        where = shard.block_where(block)
        codec = shard.codec
        if codec.strategy == CompressionStrategy.NO_COMPRESSION:
            raw = shard.read_raw(block)
            return file_locators(raw, fields, block_fingerprint(raw, codec.strategy))
        shard.check_unchanged()
        length = int(shard.index[block + 1]) - int(shard.index[block])
        head = shard.read_range(block, 0, 18)
        content_size = codec.check_header(head, where)
        payload = JUST_DECODED.get(self._payload_key(block)) or PAYLOADS.get(self._payload_key(block))
        raw = None
        if payload is None or len(payload) != content_size:  # not kept whole: decompressed again
            raw = shard.read_raw(block)
            payload = codec.decompress(raw, where)
        if zstandard.get_frame_parameters(head).has_checksum and length >= 4:
            fingerprint: int | None = int.from_bytes(shard.read_range(block, length - 4, 4), "little")
        elif length <= FINGERPRINT_READ_MAX:
            fingerprint = _crc32(raw if raw is not None else shard.read_raw(block))
        else:
            fingerprint = None
        return file_locators(payload, fields, fingerprint)

    def read_span(self, block: int, locator: Locator, size: int, scratch: Any = None) -> bytes | None:
        """A pread of the run (strategy 0, or raw zstd blocks), the frame decompressed up to
        the run's end with a pooled context, or for an inline file the block's fingerprint:
        checked against the locator either way. Nothing is unpickled. What was decompressed
        is kept in ``scratch`` (the tree's cache), or without one in :data:`PAYLOADS`."""
        shard = cast(BlockStore, self)
        where = shard.block_where(block)
        if locator.size != size:
            raise SpanMismatch(f"{where}: a locator of {locator.size} bytes for a file of {size}")
        if not 0 <= block < shard.num_blocks:
            raise SpanMismatch(f"{where}: no such block")
        # As for any read that needs the disk: a data.bin or index.npy changed since the
        # dataset was opened fails the read (EIO through the block path), rather than mixing.
        shard.check_unchanged()
        start, end = int(shard.index[block]), int(shard.index[block + 1])
        reader = BlockReader(functools.partial(shard.read_range, block), end - start)
        codec = shard.codec
        if locator.inline or locator.length == 0 or codec.strategy == CompressionStrategy.NO_COMPRESSION:
            return read_span(reader, locator, codec, where)
        # A run inside a compressed block: read_span takes the run alone if the zstd blocks
        # over it are stored raw; else the block is decompressed whole, once, and kept (the
        # tree's scratch for this block, within its cache bound; and PAYLOADS, where a decode
        # of the block for a file without a locator finds it). Decompressing only up to the
        # run's end costs half a block on average, but random readers come back to a block:
        # in the benchmark's cold pass (8-16 reads a block) a first partial decompression and
        # a later whole one or a decode cost 20-30% more in all than one whole decompression.
        key = self._payload_key(block)
        kept = scratch.get() if scratch is not None else None
        if kept is None:
            kept = PAYLOADS.get(key)
        if kept is not None:
            return run_in(locator, kept, where)

        def decompress_whole() -> bytes:
            payload = codec.decompress(shard.read_raw(block), where)  # bounds checked as any block's
            PAYLOADS.put(key, payload)
            if scratch is not None:
                scratch.put(payload)
            return payload

        return read_span(reader, locator, codec, where, whole=decompress_whole)
