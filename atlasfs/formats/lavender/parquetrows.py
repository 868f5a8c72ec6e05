"""The rows of one parquet shard file (:class:`ParquetRows`): its schema and row groups, each
row group read only once its page headers show it within :data:`.bounds.MAX_ROW_GROUP_BYTES`,
and decoded row groups kept in a bounded :class:`RowGroupCache`."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from atlasfs.formats.lavender import bounds
from atlasfs.formats.lavender.errors import LavenderError, TooLarge, failed, reason
from atlasfs.storage import Storage, open_regular

#: Most bytes a parquet file's footer (its metadata) may state. pyarrow reads the footer whole by
#: the length in the file's last 8 bytes: a sparse 3 GiB parquet stating a 3 GiB footer took
#: info and verify to 3.2 GB. Real footers are kilobytes to a few megabytes.
MAX_PARQUET_FOOTER_BYTES = 64 << 20
#: What a cell's value, and each value of its lists and structs, costs once a Python object (a
#: reference and most often an object of its own), counted with its Arrow bytes against the
#: bounds of :meth:`ParquetRows.read` and :meth:`ParquetRows.column_values`: a list of a
#: million bools is 125 KB of Arrow and 8 MB of Python (a 6 KiB file's block took 1.7 GB).
PYTHON_VALUE_BYTES = 16


class RowGroupCache:
    """Decoded parquet row groups, least recently used first out, bounded in bytes."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._groups: OrderedDict[tuple[str, int], Any] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: tuple[str, int]) -> Any:
        with self._lock:
            table = self._groups.get(key)
            if table is not None:
                self._groups.move_to_end(key)
            return table

    def put(self, key: tuple[str, int], table: Any) -> None:
        """Keep ``table``, pushing out the least recently used; one larger than the whole bound is
        not kept. A group of half the bound or more is kept too, alone if it must: a pass reads a
        group's blocks one after another, and pyarrow's writer puts up to 1,048,576 rows in a
        group (a 10 MB file of 1M captions, 59 MB decoded, was decoded again for each of its 500
        blocks: 190 s for one pass)."""
        size = table.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self._groups:
                return
            self._groups[key] = table
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._groups.popitem(last=False)
                self._bytes -= old.nbytes


class ParquetRows:
    """``shard.NNNNN.parquet`` of ``storage``, opened on first use (and again after
    :meth:`close`); thread-safe (one lock a file: pyarrow's readers are not)."""

    def __init__(self, path: str, storage: Storage) -> None:
        self.path = path
        self.storage = storage
        self._opened: _Opened | None = None  # the file pyarrow reads, as the page walk reads it
        self._parquet: Any = None  # byte arrays read as dictionaries (bounds)
        self._plain: Any = None  # the same file read as it is (a DELTA_BYTE_ARRAY page cannot be a dictionary)
        self._schema: Any = None  # the file's Arrow schema (the reader's has byte arrays as dictionaries)
        self._group_starts: np.ndarray | None = None
        self._batch_rows: dict[tuple[int, tuple[str, ...] | None], tuple[int, bool]] = {}  # checked (bounds)
        self._refused: dict[tuple[int, tuple[str, ...] | None], str] = {}  # read past its bound: why
        self._lock = threading.Lock()

    def columns(self) -> list[str]:
        """The column names, in file order."""
        with self._lock:
            self._parquet_file()
            return list(self._schema.names)

    def _parquet_file(self) -> Any:
        """The file opened (raises :class:`LavenderError` if it cannot be). Called with the lock held."""
        if self._parquet is None:
            import pyarrow.parquet as pq
            opened = None
            try:
                opened = _Opened(self.path, self.storage)
                plain = parquet = pq.ParquetFile(opened.source())
                schema = parquet.schema_arrow
                strings = bounds.byte_array_columns(schema)
                if strings:  # read as dictionaries: a value repeated is decoded once (bounds.bounded_read)
                    parquet = pq.ParquetFile(opened.source(), read_dictionary=strings, metadata=parquet.metadata)
            except Exception as exc:  # pyarrow raises its own ArrowInvalid/OSError kinds
                if opened is not None:
                    opened.close()
                raise failed(exc, f"{self.path}: cannot be read ({reason(exc)})") from None
            self._opened = opened
            self._schema = schema
            self._plain = plain
            metadata = parquet.metadata
            sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            self._group_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
            self._parquet = parquet
        return self._parquet

    def binary_columns(self) -> list[str]:
        """The columns of binary cells."""
        import pyarrow as pa
        with self._lock:
            self._parquet_file()
        return [f.name for f in self._schema
                if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) or pa.types.is_fixed_size_binary(f.type)]

    def row_groups(self) -> list[int]:
        """Rows in each row group."""
        with self._lock:
            self._parquet_file()
        assert self._group_starts is not None
        return np.diff(self._group_starts).tolist()

    def first_cell(self, column: str) -> bytes | None:
        """The first non-empty cell of binary ``column`` (None: every cell is null or empty),
        read a small batch at a time so a column of big images is not read whole (each row
        group's pages checked first: :mod:`.bounds`)."""
        with self._lock:
            parquet = self._parquet_file()
            for group in range(parquet.metadata.num_row_groups):
                rows, dictionaries = self._checked(group, [column])
                reader = parquet if dictionaries else self._plain
                for batch in reader.iter_batches(batch_size=min(16, rows or 16), row_groups=[group],
                                                 columns=[column], use_threads=False):
                    for value in batch.column(0).to_pylist():
                        if value:
                            return value
        return None

    def column_values(self, column: str, max_rows: int, max_bytes: int) -> list[Any]:
        """Every cell of ``column``, a row group at a time, each within its bound;
        :class:`LavenderError` for a file of more than ``max_rows`` rows (its footer says) or
        cells of more than ``max_bytes`` in all (:func:`python_bytes`, before they become Python
        values)."""
        values: list[Any] = []
        held = 0
        with self._lock:
            metadata = self._parquet_file().metadata
            if metadata.num_rows > max_rows:
                raise LavenderError(f"{self.path}: {metadata.num_rows} rows, more than {max_rows}; not read")
            for group in range(metadata.num_row_groups):
                cells = self._read_group(group, [column]).column(0)
                held += python_bytes(cells)
                if held > max_bytes:
                    raise LavenderError(f"{self.path}: its {column!r} cells take more than {max_bytes} bytes; not read")
                values.extend(cells.to_pylist())
        return values

    def _checked(self, group: int, columns: list[str] | None) -> tuple[int, bool]:
        """How row group ``group`` of ``columns`` (None: all) is read (:func:`.bounds.batch_rows`:
        rows a batch, 0 for all; byte arrays as dictionaries), once its page headers show it
        within :data:`.bounds.MAX_ROW_GROUP_BYTES`; :class:`LavenderError` naming the file and
        the row group else. Called with the lock held."""
        key = (group, tuple(columns) if columns is not None else None)
        if key in self._refused:
            raise LavenderError(self._refused[key])
        rows = self._batch_rows.get(key)
        if rows is None:
            parquet = self._parquet_file()
            names = columns if columns is not None else list(self._schema.names)
            opened = self._opened
            assert opened is not None
            try:  # the pages of the file pyarrow reads, within its size when opened (not the path's now)
                rows = bounds.batch_rows(parquet.metadata, group, names, opened.pread, opened.size)
            except bounds.Refused as exc:
                raise self._refuse(key, exc) from None
            self._batch_rows[key] = rows
        return rows

    def _read_group(self, group: int, columns: list[str] | None) -> Any:
        """Row group ``group`` (``columns`` of it; None: all), decoded within
        :data:`.bounds.MAX_ROW_GROUP_BYTES` (:class:`LavenderError` past it). Called with the lock held."""
        rows, dictionaries = self._checked(group, columns)
        try:
            parquet = self._parquet_file() if dictionaries else self._plain
            return bounds.bounded_read(parquet, group, columns, rows, self._schema)
        except bounds.Refused as exc:
            raise self._refuse((group, tuple(columns) if columns is not None else None), exc) from None

    def _refuse(self, key: tuple[int, tuple[str, ...] | None], exc: Exception) -> LavenderError:
        """The error for row group ``key[0]`` (columns ``key[1]``), remembered: every later read of
        it fails at once (the blocks sharing a bomb's row group would each decode it to the bound)."""
        self._refused[key] = f"{self.path}: {exc}"
        return LavenderError(self._refused[key])

    def read(self, wanted: np.ndarray, cache: RowGroupCache, max_bytes: int | None = None) -> tuple[dict[int, Any], int]:
        """Rows ``wanted`` (sorted, unique row numbers) as tuples of Python values in column
        order, and about the bytes they take (:func:`python_bytes`): only the row groups that
        hold them are read, through ``cache``. :class:`TooLarge` once the rows taken pass
        ``max_bytes`` (None: no bound), before they become Python values."""
        import pyarrow as pa
        with self._lock:
            self._parquet_file()
        starts = self._group_starts
        assert starts is not None
        groups = np.searchsorted(starts, wanted, side="right") - 1
        out: dict[int, Any] = {}
        read = 0
        for group in np.unique(groups).tolist():
            if group >= len(starts) - 1:
                raise LavenderError(f"{self.path}: row {int(wanted[-1]) + 1} is past its end (the file changed?)")
            table = cache.get((self.path, group))
            if table is None:
                with self._lock:
                    table = self._read_group(group, None)
                cache.put((self.path, group), table)
            rows = wanted[groups == group]
            local = rows - starts[group]
            if local[-1] - local[0] + 1 == len(local):  # a run: slicing copies nothing
                part = table.slice(int(local[0]), len(local))
            else:
                part = table.take(pa.array(local))
            read += python_bytes(part)
            if max_bytes is not None and read > max_bytes:  # a row group each within its bound, many of them
                raise TooLarge(f"{self.path} rows {int(wanted[0]) + 1}..{int(wanted[-1]) + 1}: more than {read} bytes")
            # a column at a time, then zipped: much cheaper than a dict per row
            out.update(zip(rows.tolist(), zip(*(column.to_pylist() for column in part.columns))))
        return out, read

    def close(self) -> None:
        """Forget the open file (reopened on the next read)."""
        with self._lock:
            if self._opened is not None:
                self._opened.close()
            self._opened = self._parquet = self._plain = None
            self._batch_rows = {}
            self._refused = {}


def python_bytes(cells: Any) -> int:
    """About the bytes ``cells`` (an Arrow table, array or chunked array) take once Python values:
    their Arrow bytes and :data:`PYTHON_VALUE_BYTES` a value (a list's each, a struct's each)."""
    import pyarrow as pa

    columns = cells.columns if isinstance(cells, pa.Table) else [cells]
    return int(cells.nbytes) + PYTHON_VALUE_BYTES * sum(_values(column) for column in columns)


def _values(array: Any) -> int:
    """How many values ``array`` holds, counting those of its lists, maps and structs."""
    import pyarrow as pa

    if isinstance(array, pa.ChunkedArray):
        return sum(_values(chunk) for chunk in array.chunks)
    kind = array.type
    count = len(array)
    if count and (pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_map(kind)):
        start, end = array.offsets[0].as_py(), array.offsets[-1].as_py()  # the offsets of a slice are its own
        count += _values(array.values.slice(start, end - start))
    elif count and pa.types.is_fixed_size_list(kind):
        count += _values(array.flatten())
    elif count and pa.types.is_struct(kind):
        count += sum(_values(field) for field in array.flatten())
    return count


class _Opened:
    """File ``path`` of ``storage`` as pyarrow reads it, and as the page walk reads it, with its
    size: a local file is one descriptor, pyarrow's own (``/proc/self/fd/N`` of the descriptor
    :func:`open_regular` checked: the same file, whatever ``path`` names meanwhile; no Python in
    its reads), shared by the file's readers, its size its ``fstat``; a store's object is opened
    for each reader, its size as it was when first opened. Its footer's stated length is
    checked first (:func:`check_footer`)."""

    def __init__(self, path: str, storage: Storage) -> None:
        self.path = path
        self.storage = storage
        self._file: Any = None  # a local file: pyarrow's file of the checked descriptor
        self._first: Any = None  # a store's object, opened for the first reader
        if storage.remote:  # read by ranges (its footer, then the row groups asked for)
            self._first = storage.open(path)
            self.size: int = self._first.raw.size
        else:  # opened only once known to be a regular file: pyarrow's open would wait forever on a FIFO
            import pyarrow as pa
            fd, _ = open_regular(path)
            alias = f"/proc/self/fd/{fd}"
            if os.path.exists(alias):
                try:
                    self._file = pa.OSFile(alias)
                finally:
                    os.close(fd)
            else:  # no /proc: the descriptor itself, read through Python
                self._file = pa.PythonFile(os.fdopen(fd, "rb"), mode="r")
            self.size = self._file.size()
        try:
            check_footer(self.size, self.pread(max(self.size - 8, 0), 8))
        except BaseException:
            self.close()
            raise

    def source(self) -> Any:
        """What one ``pq.ParquetFile`` reads (its reads are made with the file's lock held)."""
        if self._file is not None:
            return self._file
        first, self._first = self._first, None
        return first if first is not None else self.storage.open(self.path)

    def pread(self, offset: int, size: int) -> bytes:
        """``size`` bytes from ``offset`` (fewer at its end) of the file pyarrow reads."""
        size = min(size, self.size - offset)  # as the file pyarrow reads ends
        if size <= 0:
            return b""
        if self._file is not None:
            return bytes(self._file.read_at(size, offset))
        return self.storage.read_ranges(self.path, [(offset, size)])[0]

    def close(self) -> None:
        """Let go of the file (pyarrow's readers of it fail after)."""
        for file in (self._file, self._first):
            if file is not None:
                file.close()
        self._file = self._first = None


def check_footer(size: int, tail: bytes) -> None:
    """ValueError if ``tail``, the last 8 bytes of a parquet file of ``size`` bytes, states a
    footer past :data:`MAX_PARQUET_FOOTER_BYTES` (pyarrow would read it whole first); pyarrow
    says what else is wrong."""
    if len(tail) == 8 and tail[4:] == b"PAR1":
        stated = int.from_bytes(tail[:4], "little")
        if stated > MAX_PARQUET_FOOTER_BYTES:
            raise ValueError(f"its footer states {stated} bytes of metadata, more than {MAX_PARQUET_FOOTER_BYTES}; "
                             "not read")
