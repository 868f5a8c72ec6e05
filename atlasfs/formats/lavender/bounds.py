"""How much a parquet row group may decode to, and the check that it does not, made before
pyarrow decodes it: a parquet file of a few kilobytes can decode to gigabytes (one long string
in a dictionary page, repeated by a run-length of row indices; a page compressed a thousand
times over), and pyarrow reads whatever it is given.

The footer's sizes cannot be believed: pyarrow never compares a column chunk's
``total_uncompressed_size`` with its pages (a footer stating 8 KiB over pages of 1 MB reads as
well). So the check reads what pyarrow itself obeys, every page header of the column chunks
read (:func:`page_sizes`: each states the bytes its page decompresses to, and pyarrow fails a
page that decompresses to more), read as pyarrow's Thrift reader reads them (a field of another
wire type than the declared one skipped), up to where pyarrow stops: when the data pages' values
add up to the chunk's ``num_values``. A chunk whose walked pages hold fewer is refused, so that no
page pyarrow decodes goes unseen (it reads up to 100 bytes past an old parquet-mr's chunk,
PARQUET-816). It bounds:

- the pages' decompressed bytes, the rows times their narrowest width, and the pages' values
  times the bytes of their levels, before anything is decoded (:func:`batch_rows`);
- what the rows decode to, in one of three ways (:func:`batch_rows` chooses, :func:`bounded_read`
  reads): plain and whole where the pages bound it (a plain value lies in its page; a
  dictionary-encoded page's values are counted at the dictionary page's size each); else plain,
  a batch of rows at a time, counted as it comes, where a batch of values as large as the
  largest dictionary page stays within an eighth of the bound, and always where a byte array
  has a ``DELTA_BYTE_ARRAY`` page (each value a prefix of the one before and a suffix: rebuilt
  from a few bytes, and pyarrow cannot read it as a dictionary); else with strings and binary
  read as Arrow dictionaries, so that a value a dictionary repeats is decoded once, and the
  rows' bytes (each index's value length) summed before the column is decoded into them.

Either past :data:`MAX_ROW_GROUP_BYTES` is one :class:`~.files.LavenderError` naming the file and
the row group, and nothing more is read of it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

#: Most bytes the columns read of one parquet row group may decode to (as Arrow arrays, a
#: dictionary column counted as its values repeated): twice the bytes of row groups a source
#: keeps decoded (``source.ROW_GROUP_CACHE_BYTES``, 64 MiB), a fixed bound beside the block
#: cache's, as ``max_block_bytes`` is for an Atlas block. Decoding holds up to about twice this
#: (Arrow's builders grow by doubling), so a refused row group costs at most ~300 MB of memory.
#: A real shard's groups are far smaller (pyarrow's writer: 1 MiB pages, row groups of the rows
#: written together); a group past it is refused: write it with smaller ``row_group_size``.
MAX_ROW_GROUP_BYTES = 128 << 20
#: Rows decoded in one batch at most where a ``DELTA_BYTE_ARRAY`` page could expand (fewer
#: when its pages are large: see :func:`batch_rows`).
BATCH_ROWS = 1024
#: Fewest rows a batch of plain arrays is worth (fewer: read as dictionaries instead).
MIN_BATCH_ROWS = 16
#: Parquet's ``Encoding.DELTA_BYTE_ARRAY``, its dictionary encodings (``PLAIN_DICTIONARY``,
#: ``RLE_DICTIONARY``) and ``PageType.DICTIONARY_PAGE``.
DELTA_BYTE_ARRAY = 7
DICTIONARY_ENCODINGS = (2, 8)
DICTIONARY_PAGE = 2
#: Parquet's ``PageType.DATA_PAGE`` and ``DATA_PAGE_V2``: the pages whose values pyarrow counts.
DATA_PAGES = (0, 3)
#: Bytes pyarrow decodes for each value of a data page besides the value itself: its definition
#: and repetition levels (two bytes each). A bool in a list is a bit in its page and 4 bytes of
#: levels, 8 once a Python value: 2,048 lists of 50,000 bools, 6 KiB on disk and 13 MB in their
#: pages, took a block to 1.7 GB.
LEVEL_BYTES = 4
#: Most pages one column chunk may have: parsing a header is ~10 µs of Python, with the file's
#: lock held, so a footer stating millions of values over millions of empty pages must not
#: buy that many (~0.7 s at most here). Writers make far fewer: pyarrow's pages are 1 MiB,
#: parquet-mr's at most 20,000 rows; pages of 2 KiB would fill the row-group bound at 65,536.
MAX_PAGES = 1 << 16
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


def byte_array_columns(schema: Any) -> list[str]:
    """The top-level columns of an Arrow ``schema`` read as dictionaries (strings and binary)."""
    import pyarrow as pa

    kinds = (pa.types.is_binary, pa.types.is_string, pa.types.is_large_binary, pa.types.is_large_string)
    return [f.name for f in schema if any(kind(f.type) for kind in kinds)]


def batch_rows(metadata: Any, group: int, columns: list[str], pread: Callable[[int, int], bytes],
               file_size: int) -> tuple[int, bool]:
    """How :func:`bounded_read` reads ``columns`` of row group ``group``, once its page headers
    are read and within bounds (:class:`Refused` else): ``(rows per batch, 0 for all at once;
    byte arrays as dictionaries)``.

    - Plain and whole, when the pages bound what the rows decode to: each dictionary-encoded
      page's values counted as the dictionary page's size each, every other page as its size
      (a plain value lies in its page), within the bound. The usual case, and the cheapest
      (pyarrow would hash a plain page's values to make a dictionary of them).
    - Else plain, a batch of rows at a time, counted, when a batch stays within an eighth of
      the bound with each value as large as the largest dictionary page (a dictionary of a few
      images, then plain pages: what pyarrow writes for large images), or when a byte array
      has a ``DELTA_BYTE_ARRAY`` page (whatever the batch: pyarrow cannot read those pages as
      dictionaries).
    - Else whole, as dictionaries: a value a dictionary repeats is decoded once, and the rows'
      bytes are summed before they are made (a dictionary page of many large images)."""
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
    total = delta = largest = 0  # largest DELTA_BYTE_ARRAY page of a byte array; largest such page or dictionary
    expanded = rows * width  # what the rows decode to at most, as plain arrays
    values = 0  # the data pages' values (a list's each), levels decoded for each
    for j in chosen:
        chunk = rg.column(j)
        start = chunk.data_page_offset
        if chunk.has_dictionary_page and 0 < chunk.dictionary_page_offset < start:
            start = chunk.dictionary_page_offset
        end = start + chunk.total_compressed_size
        where = f"row group {group} column {chunk.path_in_schema!r}"
        if start < 0 or end > file_size or end < start:
            raise Refused(f"{where} lies past the file's end; not read")
        byte_array = metadata.schema.column(j).physical_type == "BYTE_ARRAY"
        dictionary = 0
        # pyarrow reads a chunk's pages until their values add up to the footer's (none for 0:
        # an empty chunk's data_page_offset may be 0), and then no more: so does the walk
        stated = max(chunk.num_values, 0)
        counted = 0
        for uncompressed, encoding, values, kind in _pages(pread, start, end, min(stated + 1, MAX_PAGES), where) if stated else ():
            total += uncompressed
            if kind in DATA_PAGES:
                counted += max(values, 0)
            if kind == DICTIONARY_PAGE:
                dictionary = max(dictionary, uncompressed)
                if byte_array:
                    largest = max(largest, uncompressed)
            elif byte_array and encoding in DICTIONARY_ENCODINGS:
                expanded += max(values, 0) * dictionary
            else:
                expanded += uncompressed
            if byte_array and encoding == DELTA_BYTE_ARRAY:
                delta = max(delta, uncompressed)
                largest = max(largest, uncompressed)
            if total > MAX_ROW_GROUP_BYTES:
                raise Refused(f"row group {group}'s pages decompress to more than the row-group bound of "
                              f"{MAX_ROW_GROUP_BYTES} bytes; not read")
            if counted >= stated:
                break
        if counted < stated:  # a page the walk did not see (pyarrow reads past a chunk's end: PARQUET-816)
            raise Refused(f"{where}: its data pages hold {counted} values, fewer than the {stated} the footer "
                          "states; not read")
        values += counted
        if values * LEVEL_BYTES > MAX_ROW_GROUP_BYTES:
            raise Refused(f"row group {group} holds {values} values (its lists' each), more than the row-group bound "
                          f"of {MAX_ROW_GROUP_BYTES} bytes allows at {LEVEL_BYTES} bytes a value; not read")
    if expanded <= MAX_ROW_GROUP_BYTES and not delta:
        return 0, False
    batch = MAX_ROW_GROUP_BYTES // (8 * max(largest, 1))
    if delta or batch >= MIN_BATCH_ROWS:
        return max(1, min(BATCH_ROWS, batch)), False
    return 0, True


def bounded_read(parquet: Any, group: int, columns: list[str] | None, rows: int, schema: Any) -> Any:
    """Row group ``group`` of ``parquet`` (a ``pq.ParquetFile``, reading byte arrays as
    dictionaries or not, as :func:`batch_rows` said), ``columns`` of it (None: all), read
    whole (``rows`` 0) or ``rows`` rows at a time, counting what it decodes to:
    :class:`Refused` as soon as that passes :data:`MAX_ROW_GROUP_BYTES` (a dictionary of one long
    string repeated); else the table, of the file's own Arrow ``schema``."""
    import pyarrow as pa

    batches = []
    held = 0
    size = rows or max(parquet.metadata.row_group(group).num_rows, 1)
    for batch in parquet.iter_batches(batch_size=size, row_groups=[group], columns=columns, use_threads=False):
        held += sum(_decoded_bytes(column) for column in batch.columns)
        if held > MAX_ROW_GROUP_BYTES:
            raise Refused(f"row group {group} decodes to more than the row-group bound of {MAX_ROW_GROUP_BYTES} "
                          "bytes (a decompression bomb?); not read")
        batches.append(batch)
    whole = parquet.schema_arrow
    read = pa.Table.from_batches(batches, schema=batches[0].schema if batches else pa.schema(
        [whole.field(name) for name in (columns if columns is not None else whole.names)]))
    out = []
    for name, column in zip(read.column_names, read.columns):
        wanted = schema.field(name).type
        if pa.types.is_dictionary(column.type) and not pa.types.is_dictionary(wanted):  # within the bound: decoded
            column = pa.chunked_array([chunk.dictionary_decode() for chunk in column.chunks], column.type.value_type)
            if column.type != wanted:
                column = column.cast(wanted)
        out.append(column)
    return pa.table(out, names=read.column_names)


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


def page_sizes(pread: Callable[[int, int], bytes], start: int, end: int,
               max_pages: int | None = None) -> Iterator[tuple[int, int, int, int]]:
    """``(decompressed size, encoding, values, page type)`` each page header from ``start`` to
    ``end`` states, one at a time (pages follow each other: a header, then its compressed
    bytes; a data page's encoding and number of values, -1 for other pages); a refusal (a
    :class:`Refused`) for a header that cannot be read, that lies past ``end``, or past
    ``max_pages`` pages (None: no bound; a chunk holds at most one data page a value and a
    dictionary page, so that an empty page cannot be repeated without bound)."""
    pos = start
    pages = 0
    window_at, window = start, b""
    while pos < end:
        pages += 1
        if max_pages is not None and pages > max_pages:
            raise Refused(f"more than {max_pages} pages (one a value and a dictionary page); not read")
        want = _WINDOW
        while True:
            if not window_at <= pos or pos - window_at + 64 > len(window):
                window_at, window = pos, pread(pos, min(want, end - pos))
            try:
                length, uncompressed, compressed, encoding, values, kind = _page_header(window, pos - window_at)
                break
            except _Short:
                if len(window) >= end - pos or want >= MAX_PAGE_HEADER_BYTES:
                    raise Refused(f"a page header at byte {pos} cannot be read; not read") from None
                want *= 4
                window = b""  # read again, wider
        if uncompressed < 0 or compressed < 0 or pos + length + compressed > end:
            raise Refused(f"a page header at byte {pos} states sizes past its column chunk; not read")
        yield uncompressed, encoding, values, kind
        pos += length + compressed


def _pages(pread: Callable[[int, int], bytes], start: int, end: int, max_pages: int,
           where: str) -> Iterator[tuple[int, int, int, int]]:
    """:func:`page_sizes`, its refusals saying ``where`` (the row group and column)."""
    try:
        yield from page_sizes(pread, start, end, max_pages)
    except Refused as exc:
        raise Refused(f"{where}: {exc}") from None


class _Short(Exception):
    """The header goes on past the bytes at hand."""


def _page_header(data: bytes, at: int) -> tuple[int, int, int, int, int, int]:
    """``(header length, uncompressed_page_size, compressed_page_size, encoding, num_values,
    type)`` of the Thrift compact ``PageHeader`` at ``data[at:]`` (fields 1, 2 and 3; the
    encoding and values from field 5, a ``DataPageHeader`` (fields 2 and 1), or 8, a
    ``DataPageHeaderV2`` (fields 4 and 1); -1 where absent; the rest skipped)."""
    reader = _Compact(data, at)
    found = reader.struct(want=(1, 2, 3), nested={5: (1, 2), 8: (1, 4)})
    if not isinstance(found.get(2), int) or not isinstance(found.get(3), int):
        raise Refused("a page header without its sizes; not read")
    encoding = values = -1
    if isinstance(found.get(5), dict):
        encoding, values = found[5].get(2, -1), found[5].get(1, -1)
    elif isinstance(found.get(8), dict):
        encoding, values = found[8].get(4, -1), found[8].get(1, -1)
    kind = found.get(1, -1)
    return reader.pos - at, found[2], found[3], encoding, values, kind if isinstance(kind, int) else -1


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

    def i32(self) -> int:
        """An i32 as Thrift's C++ reader makes it: the varint cut to its low 32 bits, then unzigzagged."""
        n = self.varint() & 0xFFFFFFFF
        return (n >> 1) ^ -(n & 1)

    def skip_bytes(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.data):
            raise _Short
        self.pos += n

    def struct(self, want: tuple[int, ...] = (), depth: int = 0,
               nested: dict[int, tuple[int, ...]] | None = None) -> dict[int, Any]:
        """The integer fields ``want`` of the struct here, and the structs ``nested`` names (field
        -> the integer fields wanted of it) as dicts; everything else skipped."""
        if depth > 32:
            raise Refused("a page header nested too deep; not read")
        found: dict[int, Any] = {}
        field = 0
        while True:
            head = self.byte()
            if head == 0:
                return found
            kind, delta = head & 0x0F, head >> 4
            field = field + delta if delta else self.zigzag()
            # Thrift's C++ reader (pyarrow's) skips a field of another wire type than the declared
            # one: the fields read here are i32 (5) or a struct (12), and read as it reads them
            if field in want and kind == 5:
                found[field] = self.i32()
            elif nested and field in nested and kind == 12:
                inner = self.struct(want=nested[field], depth=depth + 1)
                # a repeated struct field is read into the same struct: its fields kept, others replaced
                found[field] = {**found[field], **inner} if isinstance(found.get(field), dict) else inner
            else:
                self.skip(kind, depth)

    def skip(self, kind: int, depth: int) -> None:
        """Past a value of wire type ``kind`` (a bool field's value is in its type: nothing)."""
        if depth > 32:
            raise Refused("a page header nested too deep; not read")
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
            if size > len(self.data) - self.pos:  # each element takes a byte at least
                raise _Short
            for _ in range(size):
                self.skip(3 if element in (1, 2) else element, depth + 1)  # list bools are a byte each
        elif kind == 11:
            size = self.varint()
            if size:
                types = self.byte()
                if 2 * size > len(self.data) - self.pos:  # each key and value takes a byte at least
                    raise _Short
                key, value = types >> 4, types & 0x0F
                for _ in range(size):  # in a collection a bool is a byte
                    self.skip(3 if key in (1, 2) else key, depth + 1)
                    self.skip(3 if value in (1, 2) else value, depth + 1)
        elif kind == 12:
            self.struct(depth=depth + 1)
        else:
            raise Refused(f"a page header of unknown field type {kind}; not read")
