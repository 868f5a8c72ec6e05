"""Finding where an Atlas block's files lie, verbatim, in its decompressed pickle (*spans*,
:func:`find_spans`), and the small files kept whole instead (*inline* locators,
:func:`file_locators`), tied to the block by its fingerprint (:func:`block_fingerprint`).
Every locator carries a check (:func:`run_check`, :func:`inline_check`) that reads compare.
Nothing is unpickled, nothing read from disk: the block's pickle and its unpickled
examples' files are given.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zstandard

from atlasfs.formats.atlas.meta import CompressionStrategy
from atlasfs.formats.naming import TEXT_EXTS, encode_as
from atlasfs.formats.source import Locator

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
_NPY_MAGIC = b"\x93NUMPY"
#: Files of at most this many bytes are kept whole in the file table (inline
#: locators) instead of located in their block: a read of one needs no
#: decompression. 128 covers ``cls`` files and small ``json`` dicts (a URL and a few
#: numbers); the table keeps at most :data:`atlasfs.tree.table.filetable.INLINE_AVERAGE` bytes a
#: file of them in all.
INLINE_MAX = 128
#: Files with no run (a JSON of a dict: no bytes of the pickle are its encoding) of at most
#: this many bytes are given whole too, as inline locators: the table keeps them
#: compressed a block at a time (:data:`atlasfs.tree.table.layout.KEPT`), so that a random
#: read of one needs neither the block nor Python.
WHOLE_MAX = 16 << 10
#: Pieces in which a block's stored bytes are read for :func:`stored_crc_of` (memory, not
#: the block's size, bounds what a fingerprint costs).
FINGERPRINT_PIECE = 1 << 20

_RAW, _TEXT, _NPY = 0, 1, 2
_crc32 = zlib.crc32


def run_check(prefix: bytes, run: bytes | memoryview) -> int:
    """The 32-bit check a span carries: CRC-32 of its prefix and run together, so that
    neither can change unnoticed (a stored table's prefix is untrusted too)."""
    return _crc32(run, _crc32(prefix)) if prefix else _crc32(run)


def inline_check(data: bytes, fingerprint: int) -> int:
    """The check of an inline file: its bytes and its block's fingerprint together."""
    return _crc32(data, fingerprint)


def stored_crc(stored: bytes) -> int:
    """The CRC-32 of a block's stored bytes: the fingerprint of a block whose frame has no
    content checksum (:func:`block_fingerprint`)."""
    return _crc32(stored)


def stored_crc_of(pread: Callable[[int, int], bytes], length: int) -> int | None:
    """:func:`stored_crc` of a block of ``length`` stored bytes read through ``pread(size,
    offset)`` a piece at a time, or None if fewer bytes than that could be read."""
    crc = 0
    for offset in range(0, length, FINGERPRINT_PIECE):
        size = min(FINGERPRINT_PIECE, length - offset)
        piece = pread(size, offset)
        if len(piece) != size:
            return None
        crc = _crc32(piece, crc)
    return crc


def stored_bound(max_block_bytes: int, compressed: bool) -> int:
    """Most stored bytes a block fingerprinted by :func:`stored_crc` may have: a block of no
    compression is its pickle, within ``max_block_bytes``; a zstd frame of at most that
    much content is within zstd's compress bound of it (``ZSTD_COMPRESSBOUND``). Readers
    refuse larger ones before reading them (an index that lies costs no long read)."""
    if not compressed:
        return max_block_bytes
    small = ((128 << 10) - max_block_bytes) >> 11 if max_block_bytes < 128 << 10 else 0
    return max_block_bytes + (max_block_bytes >> 8) + small


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
    of its example ``i`` as :func:`~atlasfs.formats.naming.example_fields` names them
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
    """Every file's locator in a block, when the block has a ``fingerprint``: inline for
    files of :data:`INLINE_MAX` bytes or less, and for files of no run up to
    :data:`WHOLE_MAX`; a span (:func:`find_spans`) for the others whose bytes are one run;
    None for the rest. Without a fingerprint, spans only."""
    found = find_spans(payload, fields)
    if fingerprint is None:
        return found
    for files, located in zip(fields, found):
        for j, (suffix, value) in enumerate(files):
            span = located[j]
            if span is not None and span.size > INLINE_MAX:
                continue
            bound = INLINE_MAX if span is not None else WHOLE_MAX
            if span is None and not _maybe_small(value, bound):
                continue
            try:
                data = encode_as(suffix, value)
            except Exception:  # the tree reports what cannot be encoded when it reads it
                continue
            if len(data) <= bound:
                located[j] = Locator(0, 0, inline_check(data, fingerprint), data, True)
    return found


def block_fingerprint(stored: bytes, strategy: CompressionStrategy) -> int | None:
    """What ties a block's inline files to it, from the block as stored: a frame's own
    content checksum (XXH64 of the decompressed block, its low 32 bits: the frame's last
    4 bytes) when it has one, else the CRC-32 of the stored bytes (strategy 0, frames of
    writers that omit the checksum), whatever the block's size: a reader computes it once
    a block and remembers it while ``data.bin`` stays the same file (:mod:`.located`, and
    ``located.c`` in C). None for a compressed block that is not a zstd frame."""
    if strategy != CompressionStrategy.NO_COMPRESSION:
        try:
            if zstandard.get_frame_parameters(stored[:18]).has_checksum and len(stored) >= 4:
                return int.from_bytes(stored[-4:], "little")
        except zstandard.ZstdError:
            return None
    return _crc32(stored)
