"""Parquet decompression bombs for the tests, made by pyarrow itself: kilobytes on disk that
decode to gigabytes, and footers that understate their sizes."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Sequence

import pyarrow as pa
import pyarrow.parquet as pq


def dictionary_bomb(path: Path, uids: Sequence[str], value_bytes: int = 1 << 20, column: str = "text",
                    binary: bool = False) -> Path:
    """A parquet file of ``uids`` and a column whose every cell is one ``value_bytes`` string
    (a dictionary page of one value, indices a run): 5,400 rows of 1 MiB are ~15 KB on disk and
    5.4 GB decoded. No Arrow schema is stored, so pyarrow decodes the column as plain strings."""
    value = b"x" * value_bytes if binary else "x" * value_bytes
    cells = pa.DictionaryArray.from_arrays(pa.array([0] * len(uids), pa.int32()), pa.array([value]))
    pq.write_table(pa.table({"uid": list(uids), column: cells}), path, compression="zstd", store_schema=False)
    return path


def page_bomb(path: Path, uids: Sequence[str], value_bytes: int) -> Path:
    """A parquet file whose last row holds one ``value_bytes`` string in one zstd page (no
    dictionary): a page header stating ``value_bytes``, a few KB on disk."""
    values = [""] * (len(uids) - 1) + ["x" * value_bytes]
    pq.write_table(pa.table({"uid": list(uids), "text": values}), path, compression="zstd", use_dictionary=False,
                   store_schema=False)
    return path


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            out.append(low)
            return bytes(out)
        out.append(low | 0x80)


def understate_footer(path: Path) -> list[tuple[int, int]]:
    """Rewrite ``path``'s footer in place so that every row group's ``total_byte_size`` and every
    column chunk's ``total_uncompressed_size`` state the least value of the same encoded length
    (e.g. 8192 for ~1 MB): the pages are unchanged. Returns ``(stated before, after)`` pairs."""
    data = bytearray(path.read_bytes())
    length = struct.unpack("<I", data[-8:-4])[0]
    start = len(data) - 8 - length
    metadata = pq.ParquetFile(path).metadata
    sizes = set()
    for g in range(metadata.num_row_groups):
        group = metadata.row_group(g)
        sizes.add(group.total_byte_size)
        sizes.update(group.column(j).total_uncompressed_size for j in range(group.num_columns))
    changed = []
    for size in sorted(sizes, reverse=True):
        if size < 1 << 14:
            continue  # a varint of one or two bytes could be found elsewhere in the footer
        encoded = _varint(size << 1)  # zigzag of a positive i64
        least = 1
        while len(_varint(least << 1)) < len(encoded):
            least <<= 1
        if least >= size:
            continue
        footer = bytes(data[start:])
        assert footer.count(encoded) >= 1
        data[start:] = footer.replace(encoded, _varint(least << 1))
        changed.append((size, least))
    path.write_bytes(bytes(data))
    return changed


def understate_first_page(path: Path, column: int, stated: int) -> int:
    """Rewrite, in place, the size the first data page of ``column`` (in row group 0) states it
    decompresses to as ``stated`` (of the same encoded length as the true one); returns the
    true one. The page's bytes are unchanged."""
    data = bytearray(path.read_bytes())
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(column)
    start = chunk.data_page_offset
    header = bytes(data[start:start + 64])
    assert header[0] == 0x15  # field 1 (type), an i32
    at = 2  # the type's one-byte varint, then field 2 (uncompressed_page_size)
    assert header[at] == 0x15
    end = at + 1
    while header[end] & 0x80:
        end += 1
    true = _unvarint(header[at + 1:end + 1]) >> 1
    new = _varint(stated << 1)
    assert len(new) == end - at, "the stated size must have the true one's encoded length"
    data[start + at + 1:start + end + 1] = new
    path.write_bytes(bytes(data))
    return true


def _unvarint(data: bytes) -> int:
    return sum((b & 0x7F) << (7 * i) for i, b in enumerate(data))



def _rewrite_footer(data: bytearray, replacements: list[tuple[bytes, bytes]]) -> bytes:
    """``data`` with each ``(old, new)`` replaced in its footer, where ``old`` occurs once (the
    footer may change length: nothing in it points into it)."""
    length = struct.unpack("<I", data[-8:-4])[0]
    start = len(data) - 8 - length
    footer = bytes(data[start:len(data) - 8])
    for old, new in replacements:
        assert footer.count(old) == 1, "the footer must hold the value once"
        footer = footer.replace(old, new)
    return bytes(data[:start]) + footer + struct.pack("<I", len(footer)) + b"PAR1"


def _chunk_sizes(chunk: pq.ColumnChunkMetaData, compressed: int) -> tuple[bytes, bytes]:
    """The footer's bytes of ``chunk``'s ``total_uncompressed_size`` and ``total_compressed_size``
    (ColumnMetaData fields 6 and 7, i64s), and the same with ``compressed`` instead."""
    head = b"\x16" + _varint(chunk.total_uncompressed_size << 1) + b"\x16"
    return head + _varint(chunk.total_compressed_size << 1), head + _varint(compressed << 1)


def padding_bomb(path: Path, uids: Sequence[str], value_bytes: int = 1 << 20) -> Path:
    """:func:`dictionary_bomb`, its footer rewritten in place as an old parquet-mr's (1.2.8) with
    the ``text`` chunk's ``total_compressed_size`` ending before its data page: pyarrow reads up
    to 100 bytes past such a writer's chunks (PARQUET-816), so it decodes that page all the
    same, while a walk of the stated chunk sees the dictionary page alone."""
    dictionary_bomb(path, uids, value_bytes)
    metadata = pq.ParquetFile(path).metadata
    chunk = metadata.row_group(0).column(1)
    hidden = chunk.dictionary_page_offset + chunk.total_compressed_size - chunk.data_page_offset
    assert 0 < hidden <= 100, "the data page must fit in the 100 bytes pyarrow reads past"
    data = bytearray(path.read_bytes())
    path.write_bytes(_rewrite_footer(data, [(metadata.created_by.encode(), b"parquet-mr version 1.2.8 (build 0)"),
                                            _chunk_sizes(chunk, chunk.total_compressed_size - hidden)]))
    return path


def retyped_page_size(path: Path, column: int, stated: int) -> int:
    """Insert, in the first data page header of ``column`` (row group 0, the file's last chunk),
    a second field 2 (``uncompressed_page_size``) as an i64 stating ``stated``, after the true one
    (an i32), and grow the chunk's footer size to match; returns the bytes inserted. Thrift's
    reader (pyarrow's) skips a field of another type than the declared one: the page
    decompresses to its true size."""
    data = bytearray(path.read_bytes())
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(column)
    at = chunk.data_page_offset
    header = bytes(data[at:at + 64])
    assert header[0] == 0x15 and header[2] == 0x15  # field 1 (type), then 2: i32s
    i = 3
    while header[i] & 0x80:  # past field 2's varint
        i += 1
    assert header[i + 1] == 0x15  # field 3, an i32
    i += 2
    while header[i] & 0x80:
        i += 1
    i += 1
    following = header[i]
    assert following >> 4 == 2, "field 5 (the data page header) follows field 3"
    inserted = bytes([0x06]) + _varint(2 << 1) + _varint(stated << 1)  # field id given: 2, an i64
    data[at + i:at + i + 1] = inserted + bytes([(3 << 4) | (following & 0x0F)])  # field 5: now 3 after 2
    path.write_bytes(_rewrite_footer(data, [_chunk_sizes(chunk, chunk.total_compressed_size + len(inserted))]))
    return len(inserted)
