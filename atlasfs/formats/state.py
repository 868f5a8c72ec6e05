"""The saved state of a source's shard: one small, strict, versioned binary format.

What a shard's :meth:`~atlasfs.formats.source.SourceShard.prepare` learned is stored
with its file table and handed back to :meth:`~atlasfs.formats.source.SourceShard.restore`
on a later mount. Every format (Dolma, Lavender, ``.pbin``) writes it with
:func:`encode` and reads it with :func:`decode`, and keeps only its own fields and its
own checks of what they mean. Layout (integers little endian)::

    MAGIC | u8 len, kind (ascii) | u32 version | u32 entries | entry...

    entry = u16 len, name (UTF-8) | u8 tag | value
      INT    i64
      TEXT   u32 len, UTF-8
      BYTES  u64 len, bytes
      TEXTS  u32 count | count x u32 length in characters | u64 len, the texts' UTF-8 joined
      ARRAY  u8 len, dtype (numpy's ``str``: ``<u8``) | u8 ndim | ndim x u64 | zero padding
             to a multiple of 8 from the blob's start | the C-order data

A stored table may have been written by another user, so the blob is untrusted input:
:func:`decode` checks every length and count against the bytes that are left before
it slices or allocates anything, accepts only the dtypes of :data:`DTYPES`, refuses
repeated names and bytes left over, and raises :class:`StateError` (a ``ValueError``,
what ``restore`` raises for a state that does not fit) with one line for anything else.
Nothing is unpickled. Arrays come back as read-only views over the blob (no copy).
"""

from __future__ import annotations

import struct
from typing import Any, Union

import numpy as np

MAGIC = b"atlasfs-state\0"
#: The dtypes an array may have (little endian, so a state reads the same on any host).
DTYPES = frozenset({"|u1", "|i1", "|b1", "<u2", "<i2", "<u4", "<i4", "<u8", "<i8", "<f4", "<f8"})
#: Most dimensions an array may declare.
MAX_NDIM = 4
# text is encoded with surrogatepass: file names that are not UTF-8 (os.listdir's
# surrogateescape) round-trip, and bytes that are no UTF-8 at all are refused
_TEXT_ERRORS = "surrogatepass"

INT, TEXT, BYTES, TEXTS, ARRAY = range(1, 6)
_HEAD = struct.Struct("<II")  # version, entries
_I64 = struct.Struct("<q")

Value = Union[int, str, bytes, list[str], np.ndarray]


class StateError(ValueError):
    """A stored state that is malformed or is not the one asked for; the message says why."""


# ---------------------------------------------------------------- writing


def encode(kind: str, version: int, fields: dict[str, Value]) -> bytes:
    """``fields`` as one blob of ``kind``'s state ``version``: each value an ``int``
    (signed 64-bit), a ``str``, ``bytes``, a ``list`` of ``str`` or a numpy array
    (stored little endian, of a dtype in :data:`DTYPES`). Order is kept."""
    out = bytearray(MAGIC)
    kind_bytes = kind.encode("ascii")
    out += bytes([len(kind_bytes)]) + kind_bytes + _HEAD.pack(version, len(fields))
    for name, value in fields.items():
        raw_name = name.encode("utf-8", _TEXT_ERRORS)
        out += struct.pack("<H", len(raw_name)) + raw_name
        if isinstance(value, bool) or not isinstance(value, (int, str, bytes, bytearray, list, np.ndarray)):
            raise TypeError(f"state field {name!r}: cannot store a {type(value).__name__}")
        if isinstance(value, int):
            out += bytes([INT]) + _I64.pack(value)
        elif isinstance(value, str):
            raw = value.encode("utf-8", _TEXT_ERRORS)
            out += bytes([TEXT]) + struct.pack("<I", len(raw)) + raw
        elif isinstance(value, (bytes, bytearray)):
            out += bytes([BYTES]) + struct.pack("<Q", len(value)) + value
        elif isinstance(value, list):
            raw = "".join(value).encode("utf-8", _TEXT_ERRORS)
            out += bytes([TEXTS]) + struct.pack("<I", len(value)) + np.array([len(t) for t in value], "<u4").tobytes()
            out += struct.pack("<Q", len(raw)) + raw
        else:
            array = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
            dtype = array.dtype.str.encode("ascii")
            if array.dtype.str not in DTYPES or array.ndim > MAX_NDIM:
                raise TypeError(f"state field {name!r}: cannot store a {array.dtype.str} array of {array.ndim} dims")
            out += bytes([ARRAY, len(dtype)]) + dtype + bytes([array.ndim])
            out += b"".join(struct.pack("<Q", n) for n in array.shape)
            out += bytes(-len(out) % 8)
            out += array.tobytes()
    return bytes(out)


# ---------------------------------------------------------------- reading


class _Cursor:
    """Reads of ``data`` that never pass its end, as views (nothing is copied)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.at = memoryview(data), 0

    def take(self, n: int, what: str) -> memoryview:
        if n > len(self.data) - self.at:
            raise StateError(f"cut short: {what} needs {n} bytes, {len(self.data) - self.at} are left")
        self.at += n
        return self.data[self.at - n:self.at]

    def unpack(self, fmt: str, what: str) -> Any:
        values = struct.unpack(fmt, self.take(struct.calcsize(fmt), what))
        return values[0] if len(values) == 1 else values

    def text(self, size: int, what: str) -> str:
        try:
            return str(self.take(size, what), "utf-8", _TEXT_ERRORS)
        except UnicodeDecodeError:
            raise StateError(f"{what} is not UTF-8") from None


def decode(blob: bytes, kind: str, version: int) -> "State":
    """The fields of a blob :func:`encode` made for ``kind``'s state ``version``;
    :class:`StateError` if it is anything else, malformed, or cut short."""
    data = bytes(blob)
    cursor = _Cursor(data)
    if not data.startswith(MAGIC):
        raise StateError("not an atlasfs state")
    cursor.at = len(MAGIC)
    stored_kind = bytes(cursor.take(cursor.unpack("<B", "the kind's length"), "the kind"))
    if stored_kind != kind.encode("ascii"):
        raise StateError(f"a state of {stored_kind!r}, not of {kind!r}")
    stored_version, entries = cursor.unpack("<II", "the header")
    if stored_version != version:
        raise StateError(f"a {kind} state of version {stored_version}, not {version}")
    fields: dict[str, tuple[int, Any]] = {}
    for number in range(entries):  # each entry takes at least 4 bytes: a huge count is cut short soon
        name = cursor.text(cursor.unpack("<H", f"entry {number}'s name"), f"entry {number}'s name")
        if name in fields:
            raise StateError(f"field {name!r} twice")
        fields[name] = _read_value(cursor, name)
    if cursor.at != len(data):
        raise StateError(f"{len(data) - cursor.at} bytes after its last field")
    return State(kind, fields)


def _read_value(cursor: _Cursor, name: str) -> tuple[int, Any]:
    what = f"field {name!r}"
    tag = cursor.unpack("<B", what)
    if tag == INT:
        return tag, cursor.unpack("<q", what)
    if tag == TEXT:
        return tag, cursor.text(cursor.unpack("<I", what), what)
    if tag == BYTES:
        return tag, bytes(cursor.take(cursor.unpack("<Q", what), what))
    if tag == TEXTS:
        # one UTF-8 run, cut by the texts' lengths in characters: decoded at once, not a text at a time
        lengths = np.frombuffer(cursor.take(4 * cursor.unpack("<I", what), what), "<u4")
        text = cursor.text(cursor.unpack("<Q", what), what)
        ends = np.cumsum(lengths, dtype=np.int64).tolist()
        if (ends[-1] if ends else 0) != len(text):
            raise StateError(f"{what}: its texts' lengths do not add up to its {len(text)} characters")
        return tag, [text[a:b] for a, b in zip([0, *ends], ends)]
    if tag == ARRAY:
        dtype = str(cursor.take(cursor.unpack("<B", what), what), "ascii", "replace")
        ndim = cursor.unpack("<B", what)
        if dtype not in DTYPES or ndim > MAX_NDIM:
            raise StateError(f"{what} is an array of dtype {dtype!r} and {ndim} dims")
        shape = tuple(cursor.unpack("<Q", what) for _ in range(ndim))
        cursor.take(-cursor.at % 8, what)
        count = 1
        for n in shape:
            count *= n  # Python ints: a forged shape cannot overflow, only fail the bound below
        raw = cursor.take(count * np.dtype(dtype).itemsize, what)
        return tag, np.frombuffer(raw, dtype=dtype).reshape(shape)
    raise StateError(f"{what} has an unknown tag {tag}")


_TAG_NAMES = {INT: "an integer", TEXT: "a text", BYTES: "bytes", TEXTS: "a list of texts", ARRAY: "an array"}


class State:
    """The fields of a decoded state, each read with the type and bounds its format expects
    (:class:`StateError` naming the field otherwise)."""

    def __init__(self, kind: str, fields: dict[str, tuple[int, Any]]) -> None:
        self.kind = kind
        self._fields = fields

    def names(self, prefix: str = "") -> list[str]:
        """The names of its fields that start with ``prefix``, in stored order."""
        return [name for name in self._fields if name.startswith(prefix)]

    def values(self) -> dict[str, Value]:
        """Every field as stored, unchecked (for tools and tests that change and re-encode a state)."""
        return {name: value for name, (_, value) in self._fields.items()}

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def only(self, allowed: set[str], prefixes: tuple[str, ...] = ()) -> None:
        """Refuse a field not in ``allowed`` whose name starts with none of ``prefixes``."""
        odd = [n for n in self._fields if n not in allowed and not n.startswith(prefixes)]
        if odd:
            raise StateError(f"unknown fields {odd[:5]} in a {self.kind} state")

    def _get(self, name: str, tag: int) -> Any:
        if name not in self._fields:
            raise StateError(f"no field {name!r} in the {self.kind} state")
        stored, value = self._fields[name]
        if stored != tag:
            raise StateError(f"field {name!r} is {_TAG_NAMES.get(stored)}, not {_TAG_NAMES[tag]}")
        return value

    def integer(self, name: str, lo: int = 0, hi: int = 1 << 62) -> int:
        """An integer in ``lo..hi``."""
        value: int = self._get(name, INT)
        if not lo <= value <= hi:
            raise StateError(f"field {name!r} is {value}, not in {lo}..{hi}")
        return value

    def text(self, name: str, max_len: int = 4096, one_line: bool = True) -> str:
        """A text of at most ``max_len`` characters, on one line unless ``one_line`` is False."""
        return self._check_text(name, self._get(name, TEXT), max_len, one_line)

    def optional_text(self, name: str, max_len: int = 4096) -> str | None:
        """:meth:`text`, or None if the field is absent."""
        return self.text(name, max_len) if name in self._fields else None

    def texts(self, name: str, max_count: int = 1 << 32, max_len: int = 4096, one_line: bool = True) -> list[str]:
        """A list of at most ``max_count`` texts as :meth:`text` checks them."""
        values: list[str] = self._get(name, TEXTS)
        if len(values) > max_count:
            raise StateError(f"field {name!r} holds {len(values)} texts, more than {max_count}")
        # checked over the whole list at once: a state may hold many thousand texts
        if values and (max(map(len, values)) > max_len or (one_line and "\n" in "".join(values))):
            raise StateError(f"field {name!r} holds a text longer than {max_len} characters or not on one line")
        return values

    def blob(self, name: str, max_bytes: int = 1 << 40) -> bytes:
        """Bytes, at most ``max_bytes`` of them."""
        value: bytes = self._get(name, BYTES)
        if len(value) > max_bytes:
            raise StateError(f"field {name!r} holds {len(value)} bytes, more than {max_bytes}")
        return value

    def array(self, name: str, dtype: str, shape: tuple[int | None, ...] = (None,)) -> np.ndarray:
        """An array of ``dtype`` (``"<i8"``) whose shape is ``shape`` (None: any length
        in that dimension); read-only."""
        value: np.ndarray = self._get(name, ARRAY)
        if value.dtype != np.dtype(dtype) or value.ndim != len(shape) \
                or any(want is not None and got != want for got, want in zip(value.shape, shape)):
            raise StateError(f"field {name!r} is a {value.dtype.str} array of shape {value.shape}, "
                             f"not {np.dtype(dtype).str} of {shape}")
        return value

    @staticmethod
    def _check_text(name: str, value: str, max_len: int, one_line: bool) -> str:
        if len(value) > max_len or (one_line and "\n" in value):
            raise StateError(f"field {name!r} holds a text longer than {max_len} characters or not on one line")
        return value
