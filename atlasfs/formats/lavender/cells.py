"""What a binary cell holds, told from its bytes: the extension its files get, decided once per
column (:func:`column_kind`, from its first non-empty cell), and each cell's bytes under it
(:func:`cell_bytes`, which refuses a cell of another kind rather than naming it wrongly).

A cell written by ``lavender_data.serialize.serialize_ndarray`` (a big-endian ``uint32`` header
length; a header of three items, each a big-endian ``uint32`` length, the tag ``js`` and JSON:
the shape, the dtype as ``str(dtype)``, the strides; then the array's raw bytes) becomes an
``.npy`` file that ``numpy.load`` reads as ``deserialize_ndarray`` returns it. Other bytes are
sniffed by their magic numbers; bytes of no known kind keep the column's name as it is.
"""

from __future__ import annotations

import io
import json
import re
from typing import Any

import numpy as np

#: The kind of bytes lavender-data's ``serialize_ndarray`` writes; shown as ``.npy``.
NDARRAY = "lavender-ndarray"
#: Extension per kind (a kind is an extension but for :data:`NDARRAY`).
EXTENSIONS = {NDARRAY: "npy"}
#: Names that already say a kind (``<uid>.jpeg`` stays).
SAME = {"jpg": {"jpg", "jpeg"}, "tiff": {"tif", "tiff"}}
#: Header items and bytes a serialized ndarray may have at most (a forged header is refused).
MAX_HEADER_BYTES = 1 << 16
MAX_DIMS = 32

_MAGIC: tuple[tuple[bytes, int, str], ...] = (  # (magic, where, kind)
    (b"\x89PNG\r\n\x1a\n", 0, "png"),
    (b"\xff\xd8\xff", 0, "jpg"),
    (b"GIF87a", 0, "gif"),
    (b"GIF89a", 0, "gif"),
    (b"II*\x00", 0, "tiff"),
    (b"MM\x00*", 0, "tiff"),
    (b"\x93NUMPY", 0, "npy"),
    (b"fLaC", 0, "flac"),
    (b"OggS", 0, "ogg"),
    (b"ID3", 0, "mp3"),
    (b"%PDF-", 0, "pdf"),
    (b"\x1f\x8b", 0, "gz"),
    (b"\x28\xb5\x2f\xfd", 0, "zst"),
)
_RIFF = {b"WEBP": "webp", b"WAVE": "wav", b"AVI ": "avi"}
_DTYPE = re.compile(r"(bool|u?int(8|16|32|64)|float(16|32|64)|complex(64|128))")


def sniff(data: bytes) -> str | None:
    """The kind of ``data`` (an extension, or :data:`NDARRAY`), or None for bytes of no known kind."""
    if data[:4] == b"RIFF" and data[8:12] in _RIFF:
        return _RIFF[data[8:12]]
    if data[4:8] == b"ftyp":  # ISO media: mp4, and AVIF/HEIF images
        brand = data[8:12]
        return "avif" if brand in (b"avif", b"avis") else "heic" if brand in (b"heic", b"heix", b"mif1") else "mp4"
    for magic, where, kind in _MAGIC:
        if data[where:where + len(magic)] == magic:
            return kind
    try:
        ndarray(data)
    except ValueError:
        return None
    return NDARRAY


def ndarray(data: bytes) -> np.ndarray:
    """A serialized ndarray read as ``deserialize_ndarray`` reads it (a view of ``data``);
    ``ValueError`` if ``data`` is not exactly one (or asks for an object dtype)."""
    if len(data) < 4:
        raise ValueError("shorter than its header length")
    size = int.from_bytes(data[:4], "big")
    if size > min(MAX_HEADER_BYTES, len(data) - 4):
        raise ValueError("its header is longer than the cell")
    header = data[4:4 + size]
    items: list[Any] = []
    at = 0
    while at < size:
        length = int.from_bytes(header[at:at + 4], "big")
        item = header[at + 4:at + 4 + length]
        if at + 4 > size or len(item) != length or item[:2] != b"js" or len(items) == 3:
            raise ValueError("its header is not three js items")
        try:
            items.append(json.loads(item[2:].decode("utf-8")))
        except (UnicodeDecodeError, ValueError):
            raise ValueError("a header item is not JSON") from None
        at += 4 + length
    if len(items) != 3:
        raise ValueError("its header is not three js items")
    shape, dtype, strides = items
    if (not isinstance(dtype, str) or not _DTYPE.fullmatch(dtype)
            or not _ints(shape) or not _ints(strides) or len(shape) != len(strides) or len(shape) > MAX_DIMS
            or any(n < 0 for n in shape)):
        raise ValueError("its header is not a shape, a numeric dtype and strides")
    try:
        array = np.ndarray(tuple(shape), np.dtype(dtype), buffer=data, offset=4 + size, strides=tuple(strides))
    except (TypeError, ValueError) as exc:  # strides or shape past the buffer
        raise ValueError(f"its shape and strides do not fit its bytes ({exc})") from None
    # serialize_ndarray writes every element; strides of 0 would let a cell of a few bytes state
    # exabytes, which .npy (np.save) writes out in full
    if array.nbytes > len(data) - 4 - size:
        raise ValueError(f"its shape states {array.nbytes} bytes, more than the {len(data) - 4 - size} it holds")
    return array


def _ints(value: Any) -> bool:
    return isinstance(value, list) and all(type(v) is int for v in value)


def extension(kind: str) -> str:
    """The file extension of a kind."""
    return EXTENSIONS.get(kind, kind)


def field_name(column: str, kind: str | None) -> str:
    """The field (file suffix) of a column whose cells are of ``kind``: the column's own name
    when it already ends in that extension (or for bytes of no known kind), else
    ``<column>.<extension>``."""
    if kind is None:
        return column
    ext = extension(kind)
    if column.rsplit(".", 1)[-1].lower() in SAME.get(ext, {ext}):  # WebDataset lower-cases extensions
        return column
    return f"{column}.{ext}"


def cell_bytes(kind: str | None, data: bytes) -> bytes:
    """The bytes of a cell of a column of ``kind``: an ndarray as ``.npy``, others as they are;
    ``ValueError`` (saying what it holds) for a cell of another kind."""
    if kind is None:
        return data
    if kind == NDARRAY:
        try:
            array = ndarray(data)
        except ValueError as exc:
            found = sniff(data)
            raise ValueError(f"not a lavender serialized ndarray ({exc}; it holds {found or 'unknown bytes'})") from None
        out = io.BytesIO()
        np.save(out, array, allow_pickle=False)
        return out.getvalue()
    found = sniff(data)
    if found != kind:
        raise ValueError(f"holds {found or 'bytes of no known kind'}, not {kind}")
    return data
