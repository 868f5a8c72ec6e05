"""One shard file of one shardset (``shard.NNNNN.csv`` or ``.parquet``): :class:`ShardFile`,
the pass over its uid column (:meth:`ShardFile.scan`; for csv, where every row starts too) and
reads of chosen rows only (:meth:`ShardFile.read_rows`), each failure one
:class:`LavenderError` naming the file. How a csv file is read is :mod:`.csvrows`'s job; a
parquet file, :mod:`.parquetrows`'s (its row groups through a bounded :class:`RowGroupCache`).
Nothing here joins shardsets.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from atlasfs.formats.lavender.csvrows import CSV_GAP_ROWS, MAX_CSV_LINE_BYTES, WHOLE_CSV_BYTES, CsvRows
from atlasfs.formats.lavender.errors import LavenderError, Problems, failed, reason, too_wide
from atlasfs.formats.lavender.parquetrows import MAX_PARQUET_FOOTER_BYTES, ParquetRows, RowGroupCache
from atlasfs.storage import LOCAL, Storage

__all__ = ["CSV_GAP_ROWS", "MAX_COLUMNS", "MAX_CSV_LINE_BYTES", "MAX_ROWS", "MAX_UID_BYTES", "MAX_PARQUET_FOOTER_BYTES", "SHARD_FILE", "WHOLE_CSV_BYTES",
           "LavenderError", "RowGroupCache", "ScanResult", "ShardFile", "uid_text"]

SHARD_FILE = re.compile(r"shard\.([0-9]+)\.(csv|parquet)")
#: Most columns a shard file may have. Each is a file of every sample: a csv of 19 MiB, a
#: header of 100,000 columns and 200 rows of commas, made a block of 20 million files (942 MB
#: decoded, before the tree saw it). Real shardsets have a few.
MAX_COLUMNS = 4096
#: Most rows a shard file may have, and most bytes its uids may take: the pass holds about 160
#: bytes a row (4 million rows of a csv: 656 MB). A parquet file states rows at no cost (57 KB
#: of 20 million rows of one uid took the pass to 1.7 GB); a real shard has thousands.
MAX_ROWS = 1 << 22
MAX_UID_BYTES = 256 << 20


def uid_text(value: Any) -> str:
    """A uid cell as text (a parquet uid column may hold ints)."""
    return value if isinstance(value, str) else str(value)


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
        self._csv = CsvRows(self.path, self.storage) if self.kind == "csv" else None
        self._parquet = ParquetRows(self.path, self.storage) if self.kind != "csv" else None

    def columns(self) -> list[str]:
        """The column names, in file order (raises :class:`LavenderError` if unreadable)."""
        if self._columns is None:
            try:
                columns = self._csv.header(MAX_COLUMNS) if self._csv is not None else self._parquet_rows().columns()
                if len(columns) > MAX_COLUMNS:
                    raise too_wide(self.path, len(columns), MAX_COLUMNS)
                self._columns = columns
            except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
                raise failed(exc, f"{self.path}: cannot be read ({reason(exc)})") from None
        return self._columns

    def _parquet_rows(self) -> ParquetRows:
        assert self._parquet is not None
        return self._parquet

    def binary_columns(self) -> list[str]:
        """The parquet columns of binary cells (none for csv: its cells are strings)."""
        return [] if self._parquet is None else self._parquet.binary_columns()

    def first_cell(self, column: str) -> bytes | None:
        """The first non-empty cell of a binary parquet column (None: every cell is null or
        empty), read a small batch at a time so a column of big images is not read whole (each
        row group's pages checked first: :mod:`.bounds`)."""
        try:
            return self._parquet_rows().first_cell(column)
        except LavenderError:
            raise
        except Exception as exc:
            raise failed(exc, f"{self.path}: column {column!r} cannot be read ({reason(exc)})") from None

    def row_groups(self) -> list[int]:
        """Rows in each parquet row group (an empty list for csv)."""
        return [] if self._parquet is None else self._parquet.row_groups()

    def scan(self, uid: str) -> ScanResult:
        """Every row's uid (and for csv where rows start), in one pass; raises
        :class:`LavenderError` if the file has no ``uid`` column or cannot be read."""
        header = self.columns()
        if uid not in header:
            raise LavenderError(f"{self.path}: no {uid!r} column (choose it with -o uid_column=COLUMN or --uid-column)")
        try:
            if self._csv is not None:
                uids, offsets, problems = self._csv.scan(header, uid, MAX_ROWS, MAX_UID_BYTES)
                self._csv.offsets = offsets
                return ScanResult(uids, offsets, problems)
            problems = Problems()
            uids: list[str | None] = []
            for row, value in enumerate(self._parquet_rows().column_values(uid, MAX_ROWS, MAX_UID_BYTES)):
                if value is None:
                    problems.add(self.path, f"{self.path} row {row + 1}: no uid (null)")
                    uids.append(None)
                else:
                    uids.append(uid_text(value))
            return ScanResult(uids, None, problems.lines())
        except LavenderError:
            raise
        except Exception as exc:  # csv.Error, OSError, pyarrow's errors: the file as a whole fails
            raise failed(exc, f"{self.path}: cannot be read ({reason(exc)})") from None

    def set_offsets(self, offsets: np.ndarray) -> None:
        """Where the csv rows start, from a stored state (instead of :meth:`scan`)."""
        if self._csv is not None:
            self._csv.offsets = offsets

    def read_rows(self, rows: np.ndarray, cache: RowGroupCache,
                  max_bytes: int | None = None) -> tuple[dict[int, Any], int]:
        """Rows ``rows`` (row numbers, in any order) as sequences of values in
        :meth:`columns` order (csv cells as strings, parquet cells as Python values), and
        about the bytes read. Reads only the byte ranges (csv) or row groups (parquet) that
        hold them; :class:`.errors.TooLarge` once they take more than ``max_bytes`` (None: no
        bound)."""
        wanted = np.unique(rows)
        if len(wanted) == 0:
            return {}, 0
        try:
            if self._csv is not None:
                return self._csv.read(wanted, len(self.columns()), max_bytes)
            return self._parquet_rows().read(wanted, cache, max_bytes)
        except LavenderError:
            raise
        except Exception as exc:
            raise failed(exc, f"{self.path}: rows {int(wanted[0]) + 1}..{int(wanted[-1]) + 1} cannot be read "
                              f"({reason(exc)})") from None

    def close(self) -> None:
        """Forget the open parquet file (reopened on the next read)."""
        if self._parquet is not None:
            self._parquet.close()
