"""The rows of one csv shard file (:class:`CsvRows`): its header, the pass that finds where each
row starts and its uid, and reads of chosen rows by their byte ranges. Every line is read within
:data:`MAX_CSV_LINE_BYTES`."""

from __future__ import annotations

import csv
import io
import itertools
from typing import Any, Iterator

import numpy as np

from atlasfs.formats.lavender.errors import LavenderError, Problems, TooLarge, too_wide
from atlasfs.storage import Storage

#: Two rows of a csv file closer than this are read in one range when a block needs both...
CSV_GAP_ROWS = 64
#: ...and the rows between them take no more bytes than this (rows the block does not need).
CSV_GAP_BYTES = 1 << 20
#: Most bytes one csv line may take, and one row (a quoted cell spanning lines: all its lines). A
#: line is read whole before csv parses it: a sparse csv (gigabytes of NULs, no newline) was one
#: line read into memory (3 GiB took info and verify to 6.3 GB); past this it is one error naming
#: it. A row is parsed whole: lines of empty quoted cells, each line's last cell going on to the
#: next, were one row of as many cells as the file holds (3 bytes a cell, 8 held).
MAX_CSV_LINE_BYTES = 64 << 20
# Python's csv refuses a cell over 131,072 characters by default (a process-wide limit): a
# long text cell, which lavender-data writes and reads, failed its whole file. A row is bounded
# by MAX_CSV_LINE_BYTES already; the limit is only ever raised to that, never lowered.
if csv.field_size_limit() < MAX_CSV_LINE_BYTES:
    csv.field_size_limit(MAX_CSV_LINE_BYTES)
#: A csv file up to this size is scanned in memory (split on newlines: fast); a larger one a
#: line at a time, each line bounded by MAX_CSV_LINE_BYTES.
WHOLE_CSV_BYTES = 64 << 20


class CsvRows:
    """``shard.NNNNN.csv`` of ``storage``: its header (:meth:`header`), the pass over its rows
    (:meth:`scan`) and reads of chosen rows (:meth:`read`), by where the pass (or a stored
    state, :attr:`offsets`) found them."""

    def __init__(self, path: str, storage: Storage) -> None:
        self.path = path
        self.storage = storage
        #: Byte offset where each row starts, and the end (rows + 1); None before the pass.
        self.offsets: np.ndarray | None = None

    def header(self, max_columns: int) -> list[str]:
        """The column names of the file's first line, read within its bound (a sparse csv is one
        line); :class:`LavenderError` for more than ``max_columns``, counted before a line
        without quotes is split."""
        with self.storage.open(self.path) as f:
            lines = csv_lines(f, self.path)
            first = next(lines, (1, b""))[1]
            if b'"' not in first and first.count(b",") >= max_columns:
                raise too_wide(self.path, first.count(b",") + 1, max_columns)
            raws = itertools.chain([first], (raw for _, raw in lines))  # a quoted name may span lines
            header = next(csv.reader(raw.decode("utf-8-sig") for raw in raws), [])
        if len(header) > max_columns:
            raise too_wide(self.path, len(header), max_columns)
        return header

    def scan(self, header: list[str], uid: str, max_rows: int,
             max_uid_bytes: int) -> tuple[list[str | None], np.ndarray, list[str]]:
        """The pass: every row's uid (None: not usable, named in the problems), where each row
        starts (and the end), and the problems; :class:`LavenderError` past ``max_rows`` rows or
        uids of ``max_uid_bytes`` in all. A file without a quote character (the usual case) has a
        row per line, found by splitting; any other goes through :mod:`csv` one line at a time
        (a quoted cell may span lines)."""
        with self.storage.open(self.path, 1 << 20) as f:
            data = f.read(WHOLE_CSV_BYTES + 1)
        if len(data) > WHOLE_CSV_BYTES:  # too large to hold whole: a line at a time, each bounded
            del data
            return self._scan_quoted(header, uid, max_rows, max_uid_bytes)
        if data.count(b"\n") > max_rows + 1:  # counted before the lines are split (the header, a last line)
            raise _too_long(self.path, max_rows)
        if b'"' not in data and b"\r" not in data.replace(b"\r\n", b"\n"):
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                pass  # the slow pass names the line
            else:
                return self._scan_plain(data, header, uid, max_rows)
        del data
        return self._scan_quoted(header, uid, max_rows, max_uid_bytes)

    def _scan_plain(self, data: bytes, header: list[str], uid: str,
                    max_rows: int) -> tuple[list[str | None], np.ndarray, list[str]]:
        column = header.index(uid)
        width = len(header)
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()  # the file ends with a newline
        if len(lines) - 1 > max_rows:
            raise _too_long(self.path, max_rows)
        sizes = np.fromiter((len(line) + 1 for line in lines), dtype=np.int64, count=len(lines))
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        offsets[-1] = min(int(offsets[-1]), len(data))
        uids: list[str | None] = []
        problems = Problems()
        for number, line in enumerate(lines[1:], start=2):
            # cells counted before the line is split: a line of 64 MiB of commas is not made 64M cells
            count = line.count(b",") + 1 if line not in (b"", b"\r") else 0
            if count != width:
                problems.add(self.path, f"{self.path} line {number}: {count} cells, the header has {width}")
                uids.append(None)
            else:
                uids.append(line.rstrip(b"\r").split(b",")[column].decode("utf-8"))
        return uids, offsets[1:], problems.lines()

    def _scan_quoted(self, header: list[str], uid: str, max_rows: int,
                     max_uid_bytes: int) -> tuple[list[str | None], np.ndarray, list[str]]:
        column = header.index(uid)
        width = len(header)
        uids: list[str | None] = []
        offsets = [0]
        problems = Problems()
        position = 0
        line = 0
        uid_bytes = 0
        with self.storage.open(self.path, 1 << 20) as f:
            def lines() -> Iterator[str]:
                nonlocal position, line
                for line, raw in csv_lines(f, self.path):
                    position += len(raw)
                    if position - offsets[-1] > MAX_CSV_LINE_BYTES:  # a row is bounded as a line is
                        raise LavenderError(f"{self.path} line {line}: a row of more than {MAX_CSV_LINE_BYTES} bytes "
                                            "(a quoted cell spanning lines); not read")
                    try:
                        yield raw.decode("utf-8")
                    except UnicodeDecodeError:
                        raise LavenderError(f"{self.path} line {line}: not UTF-8 text") from None
            reader = csv.reader(lines())
            next(reader, None)  # the header
            offsets[0] = position
            first_line = line + 1
            for record in reader:
                if len(uids) == max_rows:
                    raise _too_long(self.path, max_rows)
                if len(record) != width:
                    problems.add(self.path, f"{self.path} line {first_line}: {len(record)} cells, the header has {width}")
                    uids.append(None)
                else:
                    uids.append(record[column])
                    uid_bytes += len(record[column])
                    if uid_bytes > max_uid_bytes:
                        raise LavenderError(f"{self.path}: its uids take more than {max_uid_bytes} bytes; not read")
                offsets.append(position)
                first_line = line + 1
        return uids, np.array(offsets, dtype=np.int64), problems.lines()

    def read(self, wanted: np.ndarray, width: int, max_bytes: int | None = None) -> tuple[dict[int, Any], int]:
        """Rows ``wanted`` (sorted, unique row numbers) of ``width`` cells as lists of strings
        (a row of another width is left out), and the bytes read: runs of rows near each other
        one range and one parse each. :class:`TooLarge` before anything is read if the ranges
        take more than ``max_bytes`` (None: no bound)."""
        offsets = self.offsets
        if offsets is None:
            raise LavenderError(f"{self.path}: read before its rows were scanned")
        between = offsets[wanted[1:]] - offsets[wanted[:-1] + 1]  # bytes of the rows not wanted in each gap
        breaks = np.flatnonzero((np.diff(wanted) > CSV_GAP_ROWS) | (between > CSV_GAP_BYTES)) + 1
        runs = np.split(wanted, breaks)
        planned = sum(int(offsets[run[-1] + 1] - offsets[run[0]]) for run in runs)
        if max_bytes is not None and planned > max_bytes:
            raise TooLarge(f"{self.path} rows {int(wanted[0]) + 1}..{int(wanted[-1]) + 1}: {planned} bytes")
        out: dict[int, Any] = {}
        read = 0
        with self.storage.open(self.path, 1 << 20) as f:
            for run in runs:
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


def _too_long(path: str, max_rows: int) -> LavenderError:
    return LavenderError(f"{path}: more than {max_rows} rows; not read")




def csv_lines(f: Any, path: str) -> Iterator[tuple[int, bytes]]:
    """``(line number, bytes)`` of each line of the binary file ``f``, each read within
    :data:`MAX_CSV_LINE_BYTES` (:class:`LavenderError` naming the line past it)."""
    number = 0
    while raw := f.readline(MAX_CSV_LINE_BYTES + 1):
        number += 1
        if len(raw) > MAX_CSV_LINE_BYTES:
            raise LavenderError(f"{path} line {number}: longer than {MAX_CSV_LINE_BYTES} bytes")
        yield number, raw
