"""The saved-state codec every format stores its shard's state with (atlasfs/formats/state.py).

A stored state is untrusted input (another user may have written the table): every blob
that is not exactly what ``encode`` made for that kind and version is refused with one
``StateError``, never a crash, never a read past its end, never a giant allocation.
"""

from __future__ import annotations

import struct
import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from atlasfs.formats import state
from atlasfs.formats.state import MAGIC, StateError, decode, encode

FIELDS: dict[str, state.Value] = {
    "count": 3,
    "negative": -(1 << 63),
    "name": "café \udcff",  # a file name that is not UTF-8 (surrogateescape) round-trips
    "blob": b"\x00\x01\xff" * 5,
    "empty": b"",
    "problems": ["one", "", "two \u2603"],
    "starts": np.array([0, 5, 1 << 62], dtype="<u8"),
    "pairs": np.arange(6, dtype="<i4").reshape(3, 2),
    "flags": np.array([True, False]),
    "none": np.zeros(0, dtype="<i8"),
}


def _blob() -> bytes:
    return encode("demo", 3, FIELDS)


def test_round_trip_keeps_every_value_type_and_order() -> None:
    fields = decode(_blob(), "demo", 3)
    assert fields.names() == list(FIELDS)
    assert fields.names("n") == ["negative", "name", "none"]
    assert fields.integer("count") == 3 and fields.integer("negative", lo=-(1 << 63)) == -(1 << 63)
    assert fields.text("name") == "café \udcff" and fields.blob("blob") == FIELDS["blob"]
    assert fields.texts("problems") == ["one", "", "two \u2603"]
    assert fields.array("starts", "<u8", (3,)).tolist() == [0, 5, 1 << 62]
    pairs = fields.array("pairs", "<i4", (None, 2))
    assert pairs.tolist() == [[0, 1], [2, 3], [4, 5]] and not pairs.flags.writeable
    assert fields.array("flags", "|b1").tolist() == [True, False] and len(fields.array("none", "<i8")) == 0
    assert fields.optional_text("absent") is None and "count" in fields and "absent" not in fields
    assert encode("demo", 3, fields.values()) == _blob()  # values() re-encodes to the same bytes
    # a big-endian array is stored little endian, so a state reads the same on any host
    big = decode(encode("demo", 3, {"a": np.array([1, 2], dtype=">i8")}), "demo", 3)
    assert big.array("a", "<i8").tolist() == [1, 2]


def test_arrays_are_aligned_views_of_the_blob() -> None:
    fields = decode(_blob(), "demo", 3)
    assert all(fields.array(n, d, s).ctypes.data % 8 == 0 for n, d, s in
               [("starts", "<u8", (None,)), ("pairs", "<i4", (None, 2))])


@pytest.mark.parametrize("blob, why", [
    (b"", "not an atlasfs state"),
    (b"atlasfs-dolma\n{}", "not an atlasfs state"),
    (MAGIC, "cut short"),
    (encode("other", 3, FIELDS), "not of 'demo'"),
    (encode("demo", 4, FIELDS), "version 4, not 3"),
    (encode("demo", 3, FIELDS) + b"\0", "bytes after its last field"),
])
def test_another_kind_version_or_trailing_bytes_are_refused(blob: bytes, why: str) -> None:
    with pytest.raises(StateError, match=why):
        decode(blob, "demo", 3)


def test_every_truncation_is_refused() -> None:
    blob = _blob()
    for end in range(len(blob)):
        with pytest.raises(StateError):
            decode(blob[:end], "demo", 3)


def _one(tag: int, value: bytes, name: bytes = b"x") -> bytes:
    """A blob of one field whose value bytes are given raw (for forged lengths)."""
    return MAGIC + b"\x04demo" + struct.pack("<II", 3, 1) + struct.pack("<H", len(name)) + name + bytes([tag]) + value


@pytest.mark.parametrize("blob, why", [
    (_one(state.TEXT, struct.pack("<I", 1 << 31) + b"abc"), "cut short"),
    (_one(state.BYTES, struct.pack("<Q", (1 << 64) - 1) + b"abc"), "cut short"),
    (_one(state.TEXTS, struct.pack("<I", (1 << 32) - 1)), "cut short"),  # 4 billion lengths: none there
    (_one(state.TEXTS, struct.pack("<IIQ", 1, 3, 9) + b"abc"), "cut short"),
    (_one(state.TEXTS, struct.pack("<IIIQ", 2, 3, 9, 3) + b"abc"), "do not add up"),
    (_one(state.TEXTS, struct.pack("<IIQ", 1, 2, 2) + "é".encode()), "do not add up"),  # bytes, not characters
    (_one(state.TEXT, struct.pack("<I", 2) + b"\xff\xfe"), "not UTF-8"),
    (_one(9, b""), "unknown tag 9"),
    (_one(state.INT, b"\x01\x02"), "cut short"),
    (_one(state.ARRAY, b"\x03|O8\x01" + struct.pack("<Q", 1)), "dtype '|O8'"),  # objects: would unpickle
    (_one(state.ARRAY, b"\x03<i8\x09"), "9 dims"),
    # a huge declared shape: refused by the bytes left, before any allocation
    (_one(state.ARRAY, b"\x03<u8\x02" + struct.pack("<QQ", 1 << 40, 1 << 40)), "cut short"),
    (_one(state.ARRAY, b"\x03<u8\x01" + struct.pack("<Q", (1 << 64) - 1)), "cut short"),
    (_one(state.INT, struct.pack("<q", 1), b"\xff"), "name is not UTF-8"),
    (MAGIC + b"\x04demo" + struct.pack("<II", 3, 2) + b"\x01\x00x\x01" + bytes(8) + b"\x01\x00x\x01" + bytes(8),
     "field 'x' twice"),
    (MAGIC + b"\x04demo" + struct.pack("<II", 3, (1 << 32) - 1), "cut short"),
])
def test_forged_lengths_dtypes_and_names_are_refused_without_allocating(blob: bytes, why: str) -> None:
    tracemalloc.start()
    try:
        with pytest.raises(StateError, match=why):
            decode(blob, "demo", 3)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_accessors_check_type_bounds_dtype_and_shape() -> None:
    fields = decode(_blob(), "demo", 3)
    for call, why in [
        (lambda: fields.integer("missing"), "no field 'missing'"),
        (lambda: fields.integer("name"), "is a text, not an integer"),
        (lambda: fields.integer("negative"), "not in 0.."),
        (lambda: fields.integer("count", 4, 9), "not in 4..9"),
        (lambda: fields.text("blob"), "is bytes, not a text"),
        (lambda: fields.texts("problems", max_count=2), "more than 2"),
        (lambda: fields.texts("problems", max_len=2), "longer than 2"),
        (lambda: fields.blob("blob", max_bytes=3), "more than 3"),
        (lambda: fields.array("starts", "<i8"), "not <i8"),
        (lambda: fields.array("starts", "<u8", (4,)), "shape"),
        (lambda: fields.array("pairs", "<i4"), "shape"),
        (lambda: fields.array("count", "<i8"), "is an integer, not an array"),
        (lambda: fields.only({"count"}, ("n",)), "unknown fields"),
    ]:
        with pytest.raises(StateError, match=why):
            call()
    fields.only(set(FIELDS))
    with pytest.raises(StateError, match="not on one line"):
        decode(encode("demo", 3, {"t": "two\nlines"}), "demo", 3).text("t")
    assert decode(encode("demo", 3, {"t": "two\nlines"}), "demo", 3).text("t", one_line=False) == "two\nlines"


def test_encode_refuses_what_it_cannot_store() -> None:
    for value in [1.5, True, None, {"a": 1}, np.array([object()]), np.zeros((1,) * 5)]:
        with pytest.raises(TypeError):
            encode("demo", 1, {"x": value})  # type: ignore[dict-item]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_are_refused_cleanly(data: bytes) -> None:
    for blob in (data, MAGIC + b"\x04demo" + struct.pack("<I", 3) + data):
        try:
            decode(blob, "demo", 3)
        except StateError:
            pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mangled_states_decode_or_are_refused_cleanly(data: st.DataObject) -> None:
    blob = bytearray(_blob())
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(blob) - 1))
        blob[at] = data.draw(st.integers(0, 255))
    end = data.draw(st.integers(0, len(blob)))
    try:
        fields = decode(bytes(blob[:end]), "demo", 3)
    except StateError:
        return
    for name in fields.names():  # what decodes is well formed: each value reads back as itself
        value = fields.values()[name]
        assert isinstance(value, (int, str, bytes, list, np.ndarray))
