"""How much a parquet row group may decode to, and the check that it does not, made before
pyarrow decodes it: a parquet file of a few kilobytes can decode to gigabytes (one long string
in a dictionary page, repeated by a run-length of row indices; a page compressed a thousand
times over), and pyarrow reads whatever it is given.

The footer's sizes cannot be believed: pyarrow never compares a column chunk's
``total_uncompressed_size`` with its pages (a footer stating 8 KiB over pages of 1 MB reads as
well). So the check reads what pyarrow itself obeys, every page header of the column chunks
read (:func:`page_sizes`: each states the bytes its page decompresses to, and pyarrow fails a
page that decompresses to more), and bounds:

- the pages' decompressed bytes, and the rows times their narrowest width, before anything is
  decoded (:func:`batch_rows`);
- what the rows decode to, as they are decoded: a batch of rows at a time, each value at most
  the largest page (a dictionary page holds every value a dictionary repeats; a delta-encoded
  value is built within its page), batches small enough that one stays within an eighth of
  the bound, the sum within the bound (:func:`bounded_read`).

Either past :data:`MAX_ROW_GROUP_BYTES` is one :class:`~.files.LavenderError` naming the file and
the row group, and nothing more is read of it.
"""

from __future__ import annotations

from typing import Any, Callable

#: Most bytes the columns read of one parquet row group may decode to (as Arrow arrays, a
#: dictionary column counted as its values repeated): twice the bytes of row groups a source
#: keeps decoded (``source.ROW_GROUP_CACHE_BYTES``, 64 MiB), a fixed bound beside the block
#: cache's, as ``max_block_bytes`` is for an Atlas block. Decoding holds up to about twice this
#: (Arrow's builders grow by doubling), so a refused row group costs at most ~300 MB of memory.
#: A real shard's groups are far smaller (pyarrow's writer: 1 MiB pages, row groups of the rows
#: written together); a group past it is refused: write it with smaller ``row_group_size``.
MAX_ROW_GROUP_BYTES = 128 << 20
#: Rows decoded in one batch at most (fewer when pages are large: see :func:`batch_rows`).
BATCH_ROWS = 1024
#: Most bytes one page header may take (pyarrow's own default bound).
MAX_PAGE_HEADER_BYTES = 16 << 20
#: Narrowest decoded width of a value, by parquet physical type (a byte array: its offset).
_WIDTHS = {"BOOLEAN": 0, "INT32": 4, "INT64": 8, "INT96": 8, "FLOAT": 4, "DOUBLE": 8, "BYTE_ARRAY": 4}
_WINDOW = 64 << 10


class Refused(ValueError):
    """What a row group would decode to is past the bound; the message says how."""


def leaves(metadata: Any, columns: list[str]) -> list[int]:
    """The leaf column indices of the top-level ``columns`` (a nested column has several)."""
    schema = metadata.schema
    wanted = set(columns)
    return [j for j in range(metadata.num_columns)
            if schema.column(j).path.split(".")[0] in wanted or schema.column(j).path in wanted]


def batch_rows(metadata: Any, group: int, columns: list[str], pread: Callable[[int, int], bytes],
               file_size: int) -> int:
    """Rows per batch for :func:`bounded_read` of ``columns`` of row group ``group``, once its
    page headers are read and within bounds; :class:`Refused` else."""
    rg = metadata.row_group(group)
    rows = rg.num_rows
    chosen = leaves(metadata, columns)
    width = 0
    for j in chosen:
        column = metadata.schema.column(j)
        width += _WIDTHS.get(column.physical_type, column.length or 0)
    if rows * width > MAX_ROW_GROUP_BYTES:
        raise Refused(f"row group {group} states {rows} rows, at least {rows * width} bytes decoded, more than "
                      f"the row-group bound of {MAX_ROW_GROUP_BYTES} bytes; not read")
    total = largest = 0
    for j in chosen:
        chunk = rg.column(j)
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
            start = chunk.dictionary_page_offset
        end = start + chunk.total_compressed_size
        if start < 0 or end > file_size or end < start:
            raise Refused(f"row group {group} column {chunk.path_in_schema!r} lies past the file's end; not read")
        for uncompressed in page_sizes(pread, start, end):
            total += uncompressed
            largest = max(largest, uncompressed)
            if total > MAX_ROW_GROUP_BYTES:
                raise Refused(f"row group {group}'s pages decompress to more than the row-group bound of "
                              f"{MAX_ROW_GROUP_BYTES} bytes; not read")
    return max(1, min(BATCH_ROWS, MAX_ROW_GROUP_BYTES // (8 * max(largest, 1))))


def bounded_read(parquet: Any, group: int, columns: list[str] | None, rows: int) -> Any:
    """Row group ``group`` of ``parquet`` (a ``pq.ParquetFile``), ``columns`` of it, as a table
    decoded ``rows`` rows at a time, counting the bytes: :class:`Refused` as soon as they pass
    :data:`MAX_ROW_GROUP_BYTES` (a dictionary of one long string repeated)."""
    import pyarrow as pa

    batches = []
    held = 0
    for batch in parquet.iter_batches(batch_size=rows, row_groups=[group], columns=columns, use_threads=False):
        held += sum(_decoded_bytes(column) for column in batch.columns)
        if held > MAX_ROW_GROUP_BYTES:
            raise Refused(f"row group {group} decodes to more than the row-group bound of {MAX_ROW_GROUP_BYTES} "
                          "bytes (a decompression bomb?); not read")
        batches.append(batch)
    schema = parquet.schema_arrow
    if columns is not None:
        schema = pa.schema([schema.field(name) for name in columns])
    return pa.Table.from_batches(batches, schema=batches[0].schema if batches else schema)


def _decoded_bytes(array: Any) -> int:
    """What ``array`` takes, with a dictionary column counted as its values repeated (the
    rows become that many Python values: a dictionary of one long string is the bomb)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not pa.types.is_dictionary(array.type):
        return int(array.nbytes)
    values = array.dictionary
    if pa.types.is_binary(values.type) or pa.types.is_string(values.type) \
            or pa.types.is_large_binary(values.type) or pa.types.is_large_string(values.type):
        lengths = pc.fill_null(pc.binary_length(values), 0)
        repeated = pc.sum(pc.take(lengths, array.indices)).as_py() or 0
    else:
        repeated = (values.nbytes // max(len(values), 1)) * len(array)
    return int(array.indices.nbytes) + int(repeated)


def page_sizes(pread: Callable[[int, int], bytes], start: int, end: int) -> list[int]:
    """The decompressed size each page header from ``start`` to ``end`` states (pages follow
    each other: a header, then its compressed bytes); :class:`Refused` for a header that cannot
    be read or that lies past ``end``."""
    sizes = []
    pos = start
    window_at, window = start, b""
    while pos < end:
        want = _WINDOW
        while True:
            if not window_at <= pos or pos - window_at + 64 > len(window):
                window_at, window = pos, pread(pos, min(want, end - pos))
            try:
                length, uncompressed, compressed = _page_header(window, pos - window_at)
                break
            except _Short:
                if len(window) >= end - pos or want >= MAX_PAGE_HEADER_BYTES:
                    raise Refused(f"a page header at byte {pos} cannot be read; not read") from None
                want *= 4
                window = b""  # read again, wider
        if uncompressed < 0 or compressed < 0 or pos + length + compressed > end:
            raise Refused(f"a page header at byte {pos} states sizes past its column chunk; not read")
        sizes.append(uncompressed)
        pos += length + compressed
    return sizes


class _Short(Exception):
    """The header goes on past the bytes at hand."""


def _page_header(data: bytes, at: int) -> tuple[int, int, int]:
    """``(header length, uncompressed_page_size, compressed_page_size)`` of the Thrift compact
    ``PageHeader`` at ``data[at:]`` (fields 2 and 3; the rest skipped)."""
    reader = _Compact(data, at)
    found = reader.struct(want=(2, 3))
    if 2 not in found or 3 not in found:
        raise Refused("a page header without its sizes; not read")
    return reader.pos - at, found[2], found[3]


class _Compact:
    """Just enough of Thrift's compact protocol to read a struct's integers and skip the rest."""

    def __init__(self, data: bytes, pos: int) -> None:
        self.data, self.pos = data, pos

    def byte(self) -> int:
        if self.pos >= len(self.data):
            raise _Short
        self.pos += 1
        return self.data[self.pos - 1]

    def varint(self) -> int:
        value = shift = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if not b & 0x80:
                return value
            shift += 7
            if shift > 63:
                raise Refused("a page header's integer is too long; not read")

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def skip_bytes(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise _Short
        self.pos += n

    def struct(self, want: tuple[int, ...] = (), depth: int = 0) -> dict[int, int]:
        if depth > 32:
            raise Refused("a page header nested too deep; not read")
        found: dict[int, int] = {}
        field = 0
        while True:
            head = self.byte()
            if head == 0:
                return found
            kind, delta = head & 0x0F, head >> 4
            field = field + delta if delta else self.zigzag()
            if field in want and kind in (4, 5, 6):
                found[field] = self.zigzag()
            else:
                self.skip(kind, depth)

    def skip(self, kind: int, depth: int) -> None:
        if kind in (1, 2):  # a bool field carries its value in its type
            return
        if kind == 3:
            self.skip_bytes(1)
        elif kind in (4, 5, 6):
            self.varint()
        elif kind == 7:
            self.skip_bytes(8)
        elif kind == 8:
            self.skip_bytes(self.varint())
        elif kind in (9, 10):
            head = self.byte()
            size, element = head >> 4, head & 0x0F
            if size == 15:
                size = self.varint()
            for _ in range(size):
                self.skip(3 if element in (1, 2) else element, depth + 1)  # list bools are a byte each
        elif kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                for _ in range(size):
                    self.skip(types >> 4, depth + 1)
                    self.skip(types & 0x0F, depth + 1)
        elif kind == 12:
            self.struct(depth=depth + 1)
        else:
            raise Refused(f"a page header of unknown field type {kind}; not read")
