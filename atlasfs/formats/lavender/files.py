"""One shard file of one shardset (``shard.NNNNN.csv`` or ``.parquet``): the pass over its
uid column (:meth:`ShardFile.scan`; for csv, where every row starts too) and reads of
chosen rows only (:meth:`ShardFile.read_rows`: a csv file's byte ranges, a parquet file's
row groups through a bounded :class:`RowGroupCache`). Nothing here joins shardsets.
"""

from __future__ import annotations

import csv
import io
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.lavender import bounds
from atlasfs.storage import LOCAL, Storage, open_regular
from atlasfs.storage.files import transient_failure

SHARD_FILE = re.compile(r"shard\.([0-9]+)\.(csv|parquet)")
#: Two rows of a csv file closer than this are read in one range when a block needs both.
CSV_GAP_ROWS = 64
#: Most bytes one csv line may take (a quoted cell spanning lines: each of its lines). A line is
#: read whole before csv parses it: a sparse csv (gigabytes of NULs, no newline) was one line
#: read into memory (3 GiB took info and verify to 6.3 GB); past this it is one error naming it.
MAX_CSV_LINE_BYTES = 64 << 20
#: A csv file up to this size is scanned in memory (split on newlines: fast); a larger one a
#: line at a time, each line bounded by MAX_CSV_LINE_BYTES.
WHOLE_CSV_BYTES = 64 << 20
#: Most bytes a parquet file's footer (its metadata) may state. pyarrow reads the footer whole by
#: the length in the file's last 8 bytes: a sparse 3 GiB parquet stating a 3 GiB footer took
#: info and verify to 3.2 GB. Real footers are kilobytes to a few megabytes.
MAX_PARQUET_FOOTER_BYTES = 64 << 20


class LavenderError(AtlasFormatError):
    """A shardset, shard, row or uid that breaks the rules; the message names it."""


def uid_text(value: Any) -> str:
    """A uid cell as text (a parquet uid column may hold ints)."""
    return value if isinstance(value, str) else str(value)


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
        size = table.nbytes
        if size > self.max_bytes // 2:
            return  # one such group would push out every other
        with self._lock:
            if key in self._groups:
                return
            self._groups[key] = table
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, old = self._groups.popitem(last=False)
                self._bytes -= old.nbytes


@dataclass
class ScanResult:
    """What one pass over a shard file's rows found."""

    uids: list[str | None]  # per row; None: the row has no usable uid (named in problems)
    offsets: np.ndarray | None  # csv: byte offset where each row starts, and the end (rows + 1)
    problems: list[str]


@dataclass
class ShardFile:
    """One ``shard.NNNNN.<csv|parquet>`` of one shardset."""

    shardset: str
    path: str
    index: int
    kind: str  # "csv" or "parquet"
    storage: Storage = LOCAL  # where it is read from

    def __post_init__(self) -> None:
        self._columns: list[str] | None = None
        self._offsets: np.ndarray | None = None  # csv row offsets, from the scan or a stored state
        self._parquet: Any = None  # byte arrays read as dictionaries (bounds)
        self._plain: Any = None  # the same file read as it is (a DELTA_BYTE_ARRAY page cannot be a dictionary)
        self._schema: Any = None  # the file's Arrow schema (the reader's has byte arrays as dictionaries)
        self._group_starts: np.ndarray | None = None
        self._batch_rows: dict[tuple[int, tuple[str, ...] | None], tuple[int, bool]] = {}  # checked (bounds)
        self._refused: dict[tuple[int, tuple[str, ...] | None], str] = {}  # read past its bound: why
        self._lock = threading.Lock()

    def columns(self) -> list[str]:
        """The column names, in file order (raises :class:`LavenderError` if unreadable)."""
        if self._columns is None:
            try:
                if self.kind == "csv":
                    with self.storage.open(self.path) as f:  # its first line, bounded (a sparse csv is one line)
                        header = (raw.decode("utf-8-sig") for _, raw in _csv_lines(f, self.path))
                        self._columns = next(csv.reader(header), [])
                else:
                    self._parquet_file()
                    self._columns = list(self._schema.names)
            except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
                raise _failed(exc, f"{self.path}: cannot be read ({_reason(exc)})") from None
        return self._columns

    def _parquet_file(self) -> Any:
        if self._parquet is None:
            import pyarrow.parquet as pq
            try:
                plain = parquet = self._open_parquet(pq, {})
                schema = parquet.schema_arrow
                strings = bounds.byte_array_columns(schema)
                if strings:  # read as dictionaries: a value repeated is decoded once (bounds.bounded_read)
                    parquet = self._open_parquet(pq, {"read_dictionary": strings, "metadata": parquet.metadata})
            except Exception as exc:  # pyarrow raises its own ArrowInvalid/OSError kinds
                raise _failed(exc, f"{self.path}: cannot be read ({_reason(exc)})") from None
            self._schema = schema
            self._plain = plain
            metadata = parquet.metadata
            sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            self._group_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
            self._parquet = parquet
        return self._parquet

    def _open_parquet(self, pq: Any, options: dict[str, Any]) -> Any:
        """``pq.ParquetFile`` of the file, with ``options``; its footer's stated length checked first."""
        if self.storage.remote:  # a file in a store is read by ranges (its footer, then the row groups asked for)
            found = self.storage.stat(self.path)
            size = found[0] if found else 0
            _check_footer(size, self.storage.pread(self.path, max(size - 8, 0), 8))
            return pq.ParquetFile(self.storage.open(self.path), **options)
        return _local_parquet(pq, self.path, options)

    def binary_columns(self) -> list[str]:
        """The parquet columns of binary cells (none for csv: its cells are strings)."""
        if self.kind == "csv":
            return []
        import pyarrow as pa
        with self._lock:
            self._parquet_file()
        return [f.name for f in self._schema
                if pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) or pa.types.is_fixed_size_binary(f.type)]

    def first_cell(self, column: str) -> bytes | None:
        """The first non-empty cell of a binary parquet column (None: every cell is null or
        empty), read a small batch at a time so a column of big images is not read whole (each
        row group's pages checked first: :mod:`.bounds`)."""
        try:
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
        except LavenderError:
            raise
        except Exception as exc:
            raise _failed(exc, f"{self.path}: column {column!r} cannot be read ({_reason(exc)})") from None
        return None

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
            found = self.storage.stat(self.path)
            with self.storage.open(self.path, ranged=True) as f:
                def pread(offset: int, size: int) -> bytes:
                    f.seek(offset)
                    return f.read(size)
                try:
                    rows = bounds.batch_rows(parquet.metadata, group, names, pread, found[0] if found else 0)
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

    def row_groups(self) -> list[int]:
        """Rows in each parquet row group (an empty list for csv)."""
        if self.kind == "csv":
            return []
        with self._lock:
            self._parquet_file()
        assert self._group_starts is not None
        return np.diff(self._group_starts).tolist()

    def scan(self, uid: str) -> ScanResult:
        """Every row's uid (and for csv where rows start), in one pass; raises
        :class:`LavenderError` if the file has no ``uid`` column or cannot be read."""
        if uid not in self.columns():
            raise LavenderError(f"{self.path}: no {uid!r} column (choose it with -o uid_column=COLUMN or --uid-column)")
        try:
            if self.kind == "csv":
                result = self._scan_csv(uid)
                self._offsets = result.offsets
                return result
            values: list[Any] = []
            with self._lock:  # a row group at a time, each within its bound
                for group in range(self._parquet_file().metadata.num_row_groups):
                    values.extend(self._read_group(group, [uid]).column(0).to_pylist())
            problems = []
            uids: list[str | None] = []
            for row, value in enumerate(values):
                if value is None:
                    problems.append(f"{self.path} row {row + 1}: no uid (null)")
                    uids.append(None)
                else:
                    uids.append(uid_text(value))
            return ScanResult(uids, None, problems)
        except LavenderError:
            raise
        except Exception as exc:  # csv.Error, OSError, pyarrow's errors: the file as a whole fails
            raise _failed(exc, f"{self.path}: cannot be read ({_reason(exc)})") from None

    def _scan_csv(self, uid: str) -> ScanResult:
        """The csv pass: where every row starts and its uid. A file without a quote character
        (the usual case) has a row per line, found by splitting; any other goes through
        :mod:`csv` one line at a time (a quoted cell may span lines)."""
        with self.storage.open(self.path, 1 << 20) as f:
            data = f.read(WHOLE_CSV_BYTES + 1)
        if len(data) > WHOLE_CSV_BYTES:  # too large to hold whole: a line at a time, each bounded
            del data
            return self._scan_quoted_csv(uid)
        if b'"' not in data and b"\r" not in data.replace(b"\r\n", b"\n"):
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                pass  # the slow pass names the line
            else:
                return self._scan_plain_csv(data, uid)
        del data
        return self._scan_quoted_csv(uid)

    def _scan_plain_csv(self, data: bytes, uid: str) -> ScanResult:
        header = self.columns()
        column = header.index(uid)
        width = len(header)
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()  # the file ends with a newline
        sizes = np.fromiter((len(line) + 1 for line in lines), dtype=np.int64, count=len(lines))
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        offsets[-1] = min(int(offsets[-1]), len(data))
        uids: list[str | None] = []
        problems: list[str] = []
        for number, line in enumerate(lines[1:], start=2):
            cells = line.rstrip(b"\r").split(b",") if line not in (b"", b"\r") else []
            if len(cells) != width:
                problems.append(f"{self.path} line {number}: {len(cells)} cells, the header has {width}")
                uids.append(None)
            else:
                uids.append(cells[column].decode("utf-8"))
        return ScanResult(uids, offsets[1:], problems)

    def _scan_quoted_csv(self, uid: str) -> ScanResult:
        header = self.columns()
        column = header.index(uid)
        width = len(header)
        uids: list[str | None] = []
        offsets = [0]
        problems: list[str] = []
        position = 0
        line = 0
        with self.storage.open(self.path, 1 << 20) as f:
            def lines() -> Iterator[str]:
                nonlocal position, line
                for line, raw in _csv_lines(f, self.path):
                    position += len(raw)
                    try:
                        yield raw.decode("utf-8")
                    except UnicodeDecodeError:
                        raise LavenderError(f"{self.path} line {line}: not UTF-8 text") from None
            reader = csv.reader(lines())
            next(reader, None)  # the header
            offsets[0] = position
            first_line = line + 1
            for record in reader:
                if len(record) != width:
                    problems.append(f"{self.path} line {first_line}: {len(record)} cells, the header has {width}")
                    uids.append(None)
                else:
                    uids.append(record[column])
                offsets.append(position)
                first_line = line + 1
        return ScanResult(uids, np.array(offsets, dtype=np.int64), problems)

    def set_offsets(self, offsets: np.ndarray) -> None:
        """Where the csv rows start, from a stored state (instead of :meth:`scan`)."""
        self._offsets = offsets

    def read_rows(self, rows: np.ndarray, cache: RowGroupCache) -> tuple[dict[int, Any], int]:
        """Rows ``rows`` (row numbers, in any order) as sequences of values in
        :meth:`columns` order (csv cells as strings, parquet cells as Python values), and
        about the bytes read. Reads only the byte ranges (csv) or row groups (parquet) that
        hold them."""
        wanted = np.unique(rows)
        if len(wanted) == 0:
            return {}, 0
        try:
            return self._read_csv(wanted) if self.kind == "csv" else self._read_parquet(wanted, cache)
        except LavenderError:
            raise
        except Exception as exc:
            raise _failed(exc, f"{self.path}: rows {int(wanted[0]) + 1}..{int(wanted[-1]) + 1} cannot be read "
                                f"({_reason(exc)})") from None

    def _read_csv(self, wanted: np.ndarray) -> tuple[dict[int, Any], int]:
        offsets = self._offsets
        if offsets is None:
            raise LavenderError(f"{self.path}: read before its rows were scanned")
        width = len(self.columns())
        out: dict[int, Any] = {}
        read = 0
        # runs of rows near each other: one read and one parse each
        breaks = np.flatnonzero(np.diff(wanted) > CSV_GAP_ROWS) + 1
        with self.storage.open(self.path, 1 << 20) as f:
            for run in np.split(wanted, breaks):
                first, last = int(run[0]), int(run[-1])
                f.seek(int(offsets[first]))
                text = f.read(int(offsets[last + 1] - offsets[first])).decode("utf-8")
                read += len(text)
                records = list(csv.reader(io.StringIO(text, newline="")))
                if len(records) != last - first + 1:
                    raise LavenderError(f"{self.path}: rows {first + 1}..{last + 1} are not where the scan found "
                                        "them (the file changed?)")
                for row in run.tolist():
                    record = records[row - first]
                    if len(record) == width:
                        out[row] = record
        return out, read

    def _read_parquet(self, wanted: np.ndarray, cache: RowGroupCache) -> tuple[dict[int, Any], int]:
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
            read += part.nbytes
            # a column at a time, then zipped: much cheaper than a dict per row
            out.update(zip(rows.tolist(), zip(*(column.to_pylist() for column in part.columns))))
        return out, read

    def close(self) -> None:
        """Forget the open parquet file (reopened on the next read)."""
        with self._lock:
            self._parquet = self._plain = None
            self._batch_rows = {}
            self._refused = {}


def _local_parquet(pq: Any, path: str, options: dict[str, Any]) -> Any:
    """``pq.ParquetFile`` of the local file ``path`` (``options``: its keyword arguments), read
    by pyarrow's own file (no Python in its reads), opened only once ``path`` is known to be a
    regular file: pyarrow's open would wait forever on a FIFO. It opens the descriptor checked
    (``/proc/self/fd/N``, the same file, whatever ``path`` names meanwhile); without ``/proc``,
    ``path`` itself, just checked."""
    fd, st = open_regular(path)
    try:
        _check_footer(st.st_size, os.pread(fd, 8, max(st.st_size - 8, 0)))
        alias = f"/proc/self/fd/{fd}"
        return pq.ParquetFile(alias if os.path.exists(alias) else path, **options)
    finally:
        os.close(fd)


def _check_footer(size: int, tail: bytes) -> None:
    """ValueError if ``tail``, the last 8 bytes of a parquet file of ``size`` bytes, states a
    footer past :data:`MAX_PARQUET_FOOTER_BYTES` (pyarrow would read it whole first); pyarrow
    says what else is wrong."""
    if len(tail) == 8 and tail[4:] == b"PAR1":
        stated = int.from_bytes(tail[:4], "little")
        if stated > MAX_PARQUET_FOOTER_BYTES:
            raise ValueError(f"its footer states {stated} bytes of metadata, more than {MAX_PARQUET_FOOTER_BYTES}; "
                             "not read")


def _csv_lines(f: Any, path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of each line of the binary file ``f``, each read within
    :data:`MAX_CSV_LINE_BYTES` (:class:`LavenderError` naming the line past it)."""
    number = 0
    while raw := f.readline(MAX_CSV_LINE_BYTES + 1):
        number += 1
        if len(raw) > MAX_CSV_LINE_BYTES:
            raise LavenderError(f"{path} line {number}: longer than {MAX_CSV_LINE_BYTES} bytes")
        yield number, raw


def _failed(exc: BaseException, message: str) -> Exception:
    """What to raise for ``exc``: the store's own error if it did not answer (transient:
    the file is not bad), else a :class:`LavenderError` saying ``message``."""
    return transient_failure(exc) or LavenderError(message)


def _reason(exc: BaseException) -> str:
    """An exception as a few words on one line."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())[:300]

