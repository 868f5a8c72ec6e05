"""Lavender Data shardsets: reading, and mounting as a source.

A Lavender dataset is a folder of shardsets, each a folder of
``shard.NNNNN.csv`` or ``shard.NNNNN.parquet`` files holding some of the
dataset's columns, and all holding the uid column (``uid`` unless told
otherwise: ``-o uid_column=COLUMN``). A sample is the join by uid of the rows of
the shards with the same index in every shardset; a uid missing from a
shardset lacks that shardset's columns.

Mounted, shard index ``N`` is the folder ``shard.NNNNN`` and each sample the
files ``<uid>.<column>...`` of the naming contract (a csv cell is a string:
``<uid>.caption.txt``; parquet cells keep their types: an int is
``<uid>.score.cls``, a float ``.json``, binary data keeps the column's name
as it is; a parquet null is no file). The uid column is the key, not a file,
except for a sample whose uid cannot be a file name (it has a ``.`` or a
``/``...): that sample gets an index key, and its uid a file, so it is not lost.

Order: the rows of the first shardset (by folder name) that has the shard
index, in file order, then the uids only later shardsets have, in theirs. A
block is a run of :data:`BLOCK_ROWS` samples or fewer (for parquet, a row
group of the first shardset, or an even part of one, when they are of one
size); :meth:`LavenderShard.prepare` reads the uid column of every file of the
shard once and keeps where each sample's row is in every shardset (and, for
csv, where every row starts), so a block reads only its rows: for parquet its
row groups (a few kept in memory for the neighbouring blocks), for csv the
byte range of its rows.

A column name found in more than one shardset (other than the uid column;
letter case aside, as WebDataset folds it) would give two files one name:
each of them is named ``<shardset>.<column>`` instead (``<uid>.captions_v2.
caption.txt``), in every shardset that has it, and the renaming is logged
once.

Broken rules are named one line each (file and row, or uid) and left out,
while the rest serves: a shard file without the uid column is left out of its
shard; a row without a uid, or repeating one already in its file, is left
out; a uid in shard N of one shardset and in shard M of another cannot be
joined, and stays unjoined in each (``Source.problems`` finds every case for
``verify``; a mount logs those it meets in the shards it opens).
"""

from __future__ import annotations

import csv
import io
import logging
import os
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterator

import numpy as np

from ..errors import AtlasFormatError
from ..naming import INDEX_KEY_MIN_WIDTH, index_key_width, key_problem
from . import state
from .source import Source, SourceShard

log = logging.getLogger("atlasfs")

SHARD_FILE = re.compile(r"shard\.([0-9]+)\.(csv|parquet)")
#: Uids surely safe as keys, told apart without :func:`naming.key_problem`'s full check.
_PLAIN_UID = re.compile(r"(?!__)[A-Za-z0-9_+=,@:~-]{1,200}")
DEFAULT_UID = "uid"
#: Most samples in a block.
BLOCK_ROWS = 2048
#: Bytes of parquet row groups kept decoded (per source) for the blocks that share them.
ROW_GROUP_CACHE_BYTES = 64 << 20
#: Two rows of a csv file closer than this are read in one range when a block needs both.
CSV_GAP_ROWS = 64
#: Version of what :meth:`LavenderShard.prepare` returns (:mod:`.state`); a stored state of another is not restored.
STATE_VERSION = 2
#: Unjoinable uids logged per shard at most (``verify`` lists all of them).
LOGGED_PROBLEMS = 20


class LavenderError(AtlasFormatError):
    """A shardset, shard, row or uid that breaks the rules; the message names it."""


def _uid_text(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


# ---------------------------------------------------------------- one shard file


class _RowGroupCache:
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

    def __post_init__(self) -> None:
        self._columns: list[str] | None = None
        self._offsets: np.ndarray | None = None  # csv row offsets, from the scan or a stored state
        self._parquet: Any = None
        self._group_starts: np.ndarray | None = None
        self._lock = threading.Lock()

    def columns(self) -> list[str]:
        """The column names, in file order (raises :class:`LavenderError` if unreadable)."""
        if self._columns is None:
            try:
                if self.kind == "csv":
                    with open(self.path, newline="", encoding="utf-8-sig") as f:
                        self._columns = next(csv.reader(f), [])
                else:
                    self._columns = list(self._parquet_file().schema_arrow.names)
            except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
                raise LavenderError(f"{self.path}: cannot be read ({_reason(exc)})") from None
        return self._columns

    def _parquet_file(self) -> Any:
        if self._parquet is None:
            import pyarrow.parquet as pq
            try:
                parquet = pq.ParquetFile(self.path)
            except Exception as exc:  # pyarrow raises its own ArrowInvalid/OSError kinds
                raise LavenderError(f"{self.path}: cannot be read ({_reason(exc)})") from None
            metadata = parquet.metadata
            sizes = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
            self._group_starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
            self._parquet = parquet
        return self._parquet

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
            with self._lock:
                table = self._parquet_file().read(columns=[uid])
            problems = []
            uids: list[str | None] = []
            for row, value in enumerate(table.column(0).to_pylist()):
                if value is None:
                    problems.append(f"{self.path} row {row + 1}: no uid (null)")
                    uids.append(None)
                else:
                    uids.append(_uid_text(value))
            return ScanResult(uids, None, problems)
        except LavenderError:
            raise
        except Exception as exc:  # csv.Error, OSError, pyarrow's errors: the file as a whole fails
            raise LavenderError(f"{self.path}: cannot be read ({_reason(exc)})") from None

    def _scan_csv(self, uid: str) -> ScanResult:
        """The csv pass: where every row starts and its uid. A file without a quote character
        (the usual case) has a row per line, found by splitting; any other goes through
        :mod:`csv` one line at a time (a quoted cell may span lines)."""
        with open(self.path, "rb") as f:
            data = f.read()
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
        with open(self.path, "rb") as f:
            def lines() -> Iterator[str]:
                nonlocal position, line
                for raw in f:
                    position += len(raw)
                    line += 1
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

    def read_rows(self, rows: np.ndarray, cache: _RowGroupCache) -> tuple[dict[int, Any], int]:
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
            raise LavenderError(f"{self.path}: rows {int(wanted[0]) + 1}..{int(wanted[-1]) + 1} cannot be read "
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
        with open(self.path, "rb") as f:
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

    def _read_parquet(self, wanted: np.ndarray, cache: _RowGroupCache) -> tuple[dict[int, Any], int]:
        import pyarrow as pa
        with self._lock:
            parquet = self._parquet_file()
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
                    table = parquet.read_row_group(group)
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
            self._parquet = None


def _reason(exc: BaseException) -> str:
    """An exception as a few words on one line."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())[:300]


# ---------------------------------------------------------------- the source


def _block_rows(groups: list[int]) -> int:
    """Samples per block: a parquet row group of the first shardset, or an even part of one,
    when its groups (but the last) are of one size; else :data:`BLOCK_ROWS`."""
    if not groups:
        return BLOCK_ROWS
    size = groups[0]
    if size <= 0 or any(g != size for g in groups[:-1]) or groups[-1] > size:
        return BLOCK_ROWS
    if size <= BLOCK_ROWS:
        return size
    part = next(d for d in range(BLOCK_ROWS, 0, -1) if size % d == 0)
    return part if part >= BLOCK_ROWS // 4 else BLOCK_ROWS


class LavenderShard(SourceShard):
    """Shard index ``index`` across the shardsets: the folder ``shard.NNNNN``."""

    def __init__(self, source: "LavenderSource", index: int, files: dict[str, ShardFile]) -> None:
        self.source = source
        self.index = index
        self.files = files  # shardset name -> its file of this index, in shardset order
        self.name = f"shard.{index:05d}"
        self.path = f"{source.root}/*/{self.name}"
        self.uid = source.uid
        self.first_index = 0  # each shard numbers its samples from 0 (index keys only where a uid cannot be a key)
        self.mtime = 0.0
        self.data_size = 0
        for file in files.values():
            try:
                st = os.stat(file.path)
            except OSError:
                continue
            self.mtime = max(self.mtime, st.st_mtime)
            self.data_size += st.st_size
        self._ready = False
        self._num_samples = 0
        self._block_rows = BLOCK_ROWS
        self._width = INDEX_KEY_MIN_WIDTH
        self._used: list[str] = []  # shardsets joined, in order (files left out are not)
        self._rows: dict[str, np.ndarray] = {}  # shardset -> row of each sample in its file, -1: none
        self._names: dict[str, dict[str, str]] = {}  # shardset -> column -> field name (renamed clashes)
        self._problems: list[str] = []
        self._unsafe: frozenset[int] = frozenset()  # samples whose uid cannot be a key
        self._partial: dict[str, list[str]] = {}  # shardset -> uids it has that another shardset lacks here

    # -- the pass over its files

    def prepare(self) -> bytes:
        """Read the uid column of every file of the shard, join them, note what breaks the
        rules; returns all that (and where csv rows start) for :meth:`restore`."""
        problems: list[str] = []
        uids_of: dict[str, list[str | None]] = {}
        offsets: dict[str, np.ndarray] = {}
        for name, file in self.files.items():
            try:
                scan = file.scan(self.uid)
            except LavenderError as exc:
                problems.append(str(exc))  # the file is left out; the other shardsets serve
                continue
            uids_of[name] = scan.uids
            problems.extend(scan.problems)
            if scan.offsets is not None:
                offsets[name] = scan.offsets
        if not uids_of:
            self._problems = problems
            raise LavenderError(f"{self.path}: no file of this shard can be read ({problems[0] if problems else ''})")
        # the join: sample order is the first shardset's rows, then uids only later ones have
        # (dict operations over whole lists: a Python loop per row would cost more than the parse)
        order: dict[str, int] = {}  # uid -> sample number
        found: dict[str, tuple[list[int], list[int]]] = {}  # shardset -> (sample numbers, rows)
        for name, uids in uids_of.items():
            count = len(uids)
            mine = dict(zip(reversed(uids), range(count - 1, -1, -1)))  # uid -> its first row
            mine.pop(None, None)  # type: ignore[call-overload]
            if len(mine) != count - uids.count(None):
                problems.extend(self._repeated(self.files[name].path, uids))
            new = [uid for uid in mine if uid not in order]  # (reversed order: sorted by row below)
            new.sort(key=mine.__getitem__)
            order.update(zip(new, range(len(order), len(order) + len(new))))
            found[name] = (list(map(order.__getitem__, mine)), list(mine.values()))
        count = len(order)
        arrays = {}
        for name, (samples, rows) in found.items():
            arrays[name] = np.full(count, -1, dtype=np.int64)
            arrays[name][np.array(samples, dtype=np.int64)] = rows
        unsafe = [number for uid, number in order.items()
                  if not _PLAIN_UID.fullmatch(uid) and key_problem(uid, 0) is not None]
        partial = self._partial_uids(order, arrays)
        groups = next(iter(self.files[n].row_groups() for n in arrays), [])
        digits = {len(uid) for uid in order if uid.isdigit() and uid.isascii()}
        fields: dict[str, state.Value] = {
            "uid": self.uid, "count": count, "used": list(arrays), "block_rows": _block_rows(groups),
            "width": self._key_width(count, digits), "problems": problems,
            "unsafe": np.array(unsafe, dtype="<i8"),
            **{f"rows:{name}": array.astype("<i8") for name, array in arrays.items()},
            **{f"offsets:{name}": array.astype("<i8") for name, array in offsets.items()},
            **{f"partial:{name}": uids for name, uids in partial.items()}}
        saved = state.encode("lavender", STATE_VERSION, fields)
        self.restore(saved)
        return saved

    @staticmethod
    def _repeated(path: str, uids: list[str | None]) -> list[str]:
        """One line per row repeating a uid found in an earlier row of the file."""
        first: dict[str, int] = {}
        problems = []
        for row, uid in enumerate(uids):
            if uid is not None and first.setdefault(uid, row) != row:
                problems.append(f"{path} row {row + 1}: uid {uid!r} again (first at row {first[uid] + 1})")
        return problems

    @staticmethod
    def _key_width(count: int, digit_lengths: set[int]) -> int:
        """Index-key digits wider than any all-digit uid of exactly that width: the naming layer
        refuses a ``__key__`` shaped like an index key, so numeric uids would lose their names."""
        width = index_key_width(count)
        while width in digit_lengths:
            width += 1
        return width

    @staticmethod
    def _partial_uids(order: dict[str, int], arrays: dict[str, np.ndarray]) -> dict[str, list[str]]:
        """Per shardset, the uids it has here that another shardset lacks here: the only ones
        that may sit in another shard index elsewhere (checked across shards as they open)."""
        if len(arrays) < 2:
            return {}
        uids = np.array(list(order), dtype=object)
        present = np.stack([a >= 0 for a in arrays.values()])
        lacking = ~present.all(axis=0)
        return {name: uids[lacking & present[i]].tolist() for i, name in enumerate(arrays)
                if (lacking & present[i]).any()}

    def restore(self, saved: bytes) -> None:
        """Take back what :meth:`prepare` returned; ``ValueError`` if it does not fit this shard."""
        fields = state.decode(saved, "lavender", STATE_VERSION)
        fields.only({"uid", "count", "used", "block_rows", "width", "problems", "unsafe"},
                    ("rows:", "offsets:", "partial:"))
        if fields.text("uid", one_line=False, max_len=1 << 16) != self.uid:
            raise state.StateError("the state is for another uid column")
        count = fields.integer("count")
        used = fields.texts("used", max_count=len(self.files), one_line=False)
        if any(name not in self.files for name in used) or len(set(used)) != len(used):
            raise state.StateError("the state's shardsets are not this shard's")
        rows = {name: fields.array(f"rows:{name}", "<i8", (count,)) for name in used}
        for name in used:
            file = self.files[name]
            if file.kind == "csv":
                offsets = self._checked_offsets(fields, name)
                if len(rows[name]) and int(rows[name].max()) >= len(offsets) - 1:
                    raise state.StateError(f"rows of {name} past the rows of {file.path}")
                file.set_offsets(offsets)
            if len(rows[name]) and int(rows[name].min()) < -1:
                raise state.StateError(f"rows of {name} are not row numbers")
        unsafe = fields.array("unsafe", "<i8")
        if len(unsafe) and (int(unsafe.min()) < 0 or int(unsafe.max()) >= count):
            raise state.StateError("unsafe uids that are not samples of the shard")
        self._used = used
        self._num_samples = count
        self._rows = rows
        self._unsafe = frozenset(unsafe.tolist())
        self._block_rows = fields.integer("block_rows", 1)
        self._width = fields.integer("width", 1, 1 << 16)
        self._problems = fields.texts("problems", max_len=1 << 20, one_line=False)
        self._partial = {name[len("partial:"):]: fields.texts(name, max_len=1 << 20, one_line=False)
                         for name in fields.names("partial:")}
        try:
            self._names = self._field_names()
        except LavenderError as exc:  # a file unreadable now: prepare() will say so
            raise ValueError(str(exc)) from None
        self._ready = True
        self.source._opened(self)

    def _checked_offsets(self, fields: state.State, name: str) -> np.ndarray:
        """Where the csv rows of ``name``'s file start, as stored: in order and within the file."""
        offsets = fields.array(f"offsets:{name}", "<i8")
        path = self.files[name].path
        try:
            size = os.path.getsize(path)
        except OSError as exc:
            raise state.StateError(f"{path}: cannot be read ({exc.strerror})") from None
        if len(offsets) == 0 or int(offsets[0]) < 0 or int(offsets[-1]) > size or np.any(np.diff(offsets) < 0):
            raise state.StateError(f"stored row offsets of {path} are out of order or past its end")
        return offsets

    def _field_names(self) -> dict[str, dict[str, str]]:
        """Each used shardset's columns and the field names they get: the column's own, or
        ``<shardset>.<column>`` for a name (case folded) two shardsets have."""
        columns = {name: [c for c in self.files[name].columns() if c != self.uid] for name in self._used}
        seen: dict[str, list[str]] = {}
        for name, names in columns.items():
            for column in names:
                seen.setdefault(column.casefold(), []).append(name)
        clashing = {folded for folded, sets in seen.items() if len(sets) > 1}
        fields = {}
        for name, names in columns.items():
            fields[name] = {c: (f"{name}.{c}" if c.casefold() in clashing else c) for c in names}
            for column in names:
                if column.casefold() in clashing:
                    self.source._log_once(f"{self.source.root}: column {column!r} is in shardsets "
                                          f"{', '.join(seen[column.casefold()])}: shown as <shardset>.{column}")
        return fields

    # -- blocks

    @property
    def num_samples(self) -> int:
        """Samples in the shard (once prepared or restored)."""
        return self._num_samples

    @property
    def block_size(self) -> int:
        return self._block_rows

    @property
    def num_blocks(self) -> int:
        return -(-self._num_samples // self._block_rows)

    def block_length(self, block: int) -> int:
        return max(0, min(self._block_rows, self._num_samples - block * self._block_rows))

    @property
    def key_width(self) -> int:
        return self._width

    def block_where(self, block: int) -> str:
        first = block * self._block_rows
        return f"{self.path} samples {first}..{first + self.block_length(block) - 1}"

    def decode_block(self, block: int) -> tuple[list[Any], int]:
        """The block's samples: ``{"__key__": uid, "<column>": value, ...}`` joined from every
        shardset that has the uid."""
        if not self._ready:
            raise LavenderError(f"{self.path}: read before it was prepared")
        first = block * self._block_rows
        last = first + self.block_length(block)
        samples: list[dict[str, Any] | None] = [None] * (last - first)
        held = 150 * (last - first)
        for name in self._used:
            file = self.files[name]
            wanted = self._rows[name][first:last]
            records, read = file.read_rows(wanted[wanted >= 0], self.source.row_groups)
            held += 2 * read
            columns = file.columns()
            key_at = columns.index(self.uid)
            named = self._names[name]
            # the columns shown, as (position in the row, field name); a "__key__" column is not
            keep = [(i, named[c]) for i, c in enumerate(columns) if c != self.uid and named[c] != "__key__"]
            positions = [i for i, _ in keep]
            fields = [f for _, f in keep]
            for pos, row in enumerate(wanted.tolist()):
                if row < 0:
                    continue
                record = records.get(row)
                if record is None:
                    raise LavenderError(f"{file.path} row {row + 1}: cannot be read (the file changed?)")
                sample = samples[pos]
                if sample is None:
                    uid = record[key_at]
                    sample = samples[pos] = {"__key__": uid if type(uid) is str else _uid_text(uid)}
                    if first + pos in self._unsafe:
                        sample[self.uid] = uid  # it will get an index key: keep the uid as a file
                for field, value in zip(fields, [record[i] for i in positions]):
                    if value is not None:  # a parquet null is no file
                        sample[field] = value
        return samples, held

    # -- what a stored table depends on

    def table_files(self) -> list[str]:
        return [file.path for file in self.files.values()]

    def table_key(self) -> dict[str, Any]:
        """The files' signatures, the uid column (another one joins other samples) and the
        state's version."""
        return {**super().table_key(), "uid": self.uid, "lavender": STATE_VERSION}

    def problems(self) -> list[str]:
        """What the pass over the shard's files found wrong, one line each."""
        return list(self._problems)

    def close(self) -> None:
        for file in self.files.values():
            file.close()


class LavenderSource(Source):
    """A folder of shardsets, each shard index a :class:`LavenderShard`."""

    kind = "lavender"

    def __init__(self, root: str, uid: str = DEFAULT_UID) -> None:
        self.root = os.fspath(root)
        self.uid = uid
        self.row_groups = _RowGroupCache(ROW_GROUP_CACHE_BYTES)
        self.layout_problems: list[str] = []
        self._logged: set[str] = set()
        self._where: dict[str, tuple[str, int]] = {}  # a partial uid -> (shardset, shard index) first seen
        self._lock = threading.Lock()
        self.shardsets: dict[str, dict[int, ShardFile]] = {}
        try:
            names = sorted(n for n in os.listdir(self.root) if not n.startswith("."))
        except OSError as exc:
            raise LavenderError(f"{self.root}: cannot list ({exc.strerror})") from None
        for name in names:
            folder = os.path.join(self.root, name)
            if not os.path.isdir(folder):
                continue
            found: dict[int, ShardFile] = {}
            for file in sorted(os.listdir(folder)):
                match = SHARD_FILE.fullmatch(file)
                if not match:
                    continue
                index = int(match.group(1))
                if index in found:  # shard.1.csv beside shard.00001.parquet: which one is meant?
                    self.layout_problems.append(f"{os.path.join(folder, file)}: a second shard {index} in {name} "
                                                f"(beside {os.path.basename(found[index].path)}); left out")
                    continue
                found[index] = ShardFile(name, os.path.join(folder, file), index, match.group(2))
            if found:
                self.shardsets[name] = found
        if not self.shardsets:
            raise LavenderError(f"{self.root}: no shardset folder with shard.NNNNN.csv or .parquet files")
        for problem in self.layout_problems:
            log.warning("%s", problem)
        indices = sorted({i for files in self.shardsets.values() for i in files})
        self._shards = [LavenderShard(self, i, {name: files[i] for name, files in self.shardsets.items()
                                                if i in files}) for i in indices]

    @property
    def shards(self) -> list[LavenderShard]:  # type: ignore[override]
        """A shard per shard index, in index order."""
        return self._shards

    def _log_once(self, message: str) -> None:
        with self._lock:
            if message in self._logged:
                return
            self._logged.add(message)
        log.warning("%s", message)

    def _opened(self, shard: LavenderShard) -> None:
        """Log any uid a prepared shard has that a shard opened before has in another shard
        index (a join that cannot be made). Its own problems are the tree's to log."""
        with self._lock:
            moved = []
            for name, uids in shard._partial.items():
                for uid in uids:
                    first = self._where.setdefault(uid, (name, shard.index))
                    if first[1] != shard.index:
                        moved.append(f"{self.root}: uid {uid!r} is in shard {first[1]} of {first[0]} but in shard "
                                     f"{shard.index} of {name}; not joined")
        for message in moved[:LOGGED_PROBLEMS]:
            self._log_once(message)

    def problems(self) -> list[str]:
        """Every rule broken across shards, by a pass over every shard's uid column: a uid in two
        shards of one shardset, or in one shard index here and another there."""
        problems = list(self.layout_problems)
        where: dict[str, dict[str, int]] = {}  # shardset -> uid -> shard index
        for shard in self._shards:
            for name, file in shard.files.items():
                try:
                    uids = file.scan(self.uid).uids
                except LavenderError:
                    continue  # the shard's own problems name it
                seen = where.setdefault(name, {})
                mine: set[str] = set()
                for row, uid in enumerate(uids):
                    if uid is None or uid in mine:
                        continue  # the shard's own problems name these
                    mine.add(uid)
                    if seen.get(uid, shard.index) != shard.index:
                        problems.append(f"{file.path} row {row + 1}: uid {uid!r} is also in shard {seen[uid]} of {name}")
                        continue
                    seen[uid] = shard.index
        home: dict[str, tuple[str, int]] = {}
        for name in sorted(where):
            for uid, index in where[name].items():
                first = home.setdefault(uid, (name, index))
                if first[1] != index:
                    problems.append(f"uid {uid!r} is in shard {first[1]} of {first[0]} but in shard {index} of {name}")
        return problems

    def info(self) -> list[str]:
        sets = ", ".join(f"{name} ({len(files)} shards)" for name, files in self.shardsets.items())
        return [f"format       lavender: shardsets {sets}; joined by column {self.uid!r}"]


def looks_like(path: str) -> bool:
    """A folder with a sub-folder holding a ``shard.NNNNN.csv`` or ``.parquet`` (names only)."""
    try:
        with os.scandir(path) as entries:
            folders = [e.path for e in entries if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return False
    for folder in folders:
        try:
            with os.scandir(folder) as entries:
                if any(SHARD_FILE.fullmatch(e.name) for e in entries):
                    return True
        except OSError:
            continue
    return False


def open_source(path: str, options: Any) -> LavenderSource:
    """The Lavender dataset at ``path``, joined by ``options.uid_column`` (:class:`~.factory.SourceOptions`)."""
    return LavenderSource(os.fspath(path), uid=options.uid_column or DEFAULT_UID)


# ---------------------------------------------------------------- without the tree


@dataclass
class Shard:
    """Shard index ``index`` as :class:`LavenderDataset` shows it: its samples' uids in order."""

    index: int
    uids: list[str]
    source_shard: LavenderShard

    @property
    def name(self) -> str:
        """The folder name: ``shard.NNNNN`` as the files name it."""
        return f"shard.{self.index:05d}"


class LavenderDataset:
    """A folder of shardsets read without a mount: :meth:`scan`, then :meth:`samples`."""

    def __init__(self, root: str, uid: str = DEFAULT_UID) -> None:
        self.source = LavenderSource(root, uid)
        self.root = self.source.root
        self.uid = uid
        self.shards: list[Shard] = []

    def scan(self) -> list[str]:
        """Prepare every shard and check the rules across them; returns the problems found."""
        problems: list[str] = []
        self.shards = []
        for shard in self.source.shards:
            try:
                shard.prepare()
            except LavenderError as exc:
                problems.extend(shard.problems() or [str(exc)])
                continue
            problems.extend(shard.problems())
            uids = [s["__key__"] for b in range(shard.num_blocks) for s in shard.decode_block(b)[0]]
            self.shards.append(Shard(shard.index, uids, shard))
        problems.extend(p for p in self.source.problems() if p not in problems)
        return problems

    def samples(self, shard: Shard, first: int, count: int) -> list[dict[str, Any]]:
        """Samples ``first`` to ``first + count`` of ``shard``."""
        source_shard = shard.source_shard
        out: list[dict[str, Any]] = []
        for block in range(first // source_shard.block_size, source_shard.num_blocks):
            start = block * source_shard.block_size
            if start >= first + count:
                break
            samples, _ = source_shard.decode_block(block)
            out.extend(samples[max(0, first - start):first + count - start])
        return out


def write_csv_shard(path: str, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as a Lavender csv shard (for tests and demos)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(buffer.getvalue())
