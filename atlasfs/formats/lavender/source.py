"""A folder of Lavender shardsets as a source (:class:`LavenderSource`): its shard files found
by name, the uid column found from their headers, the main shardset the others join onto, the
extension of each binary column, a :class:`.shard.LavenderShard` per shard index of the main
shardset, and the checks across shards (a uid in one shard index here and another there)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from atlasfs.formats.lavender import cells
from atlasfs.formats.lavender.errors import Problems
from atlasfs.formats.lavender.files import SHARD_FILE, LavenderError, RowGroupCache, ShardFile
from atlasfs.formats.lavender.shard import LavenderShard
from atlasfs.formats.source import Source
from atlasfs.storage import LOCAL, Storage, StorageUnavailableError
from atlasfs.storage.files import listdir_or_empty

log = logging.getLogger("atlasfs")

#: The uid column when none is given: None, found from the data (:meth:`LavenderSource.find_uid`).
DEFAULT_UID: str | None = None
#: Uid columns preferred, in this order, when the shardsets share more than one column.
UID_NAMES = ("uid", "id", "__key__")
#: How feature shardsets join onto the main one: lavender-data's ``ServerSideReader.get_sample``
#: default and what its iterations use (``inner``), or its ``left`` (its dataset preview's).
JOINS = ("inner", "left")
DEFAULT_JOIN = "inner"
#: Bytes of parquet row groups kept decoded (per source) for the blocks that share them.
ROW_GROUP_CACHE_BYTES = 64 << 20
#: Unjoinable uids logged per shard at most (``verify`` lists all of them).
LOGGED_PROBLEMS = 20


class LavenderSource(Source):
    """A folder of shardsets, each shard index a :class:`LavenderShard`."""

    kind = "lavender"

    def __init__(self, root: str, uid: str | None = DEFAULT_UID, join: str = DEFAULT_JOIN,
                 main: str | None = None, storage: Storage = LOCAL) -> None:
        self.root = os.fspath(root)
        self.storage = storage
        if join not in JOINS:
            raise LavenderError(f"unknown join {join!r} (choose one of: {', '.join(JOINS)})")
        self.join = join
        self._kinds: dict[tuple[str, str], str | None] | None = None  # (shardset, column) -> cell kind
        self.row_groups = RowGroupCache(ROW_GROUP_CACHE_BYTES)
        self.layout_problems: list[str] = []
        self._logged: set[str] = set()
        self._where: dict[str, tuple[str, int]] = {}  # a partial uid -> (shardset, shard index) first seen
        self._lock = threading.Lock()
        self.shardsets: dict[str, dict[int, ShardFile]] = {}
        try:
            names = sorted(n for n, is_dir in storage.listdir(self.root) if is_dir and not n.startswith("."))
        except StorageUnavailableError:
            raise
        except OSError as exc:
            raise LavenderError(f"{self.root}: cannot list ({exc.strerror})") from None
        for name in names:
            folder = os.path.join(self.root, name)
            found: dict[int, ShardFile] = {}
            for file in sorted(n for n, _ in listdir_or_empty(storage, folder)):
                match = SHARD_FILE.fullmatch(file)
                if not match:
                    continue
                index = int(match.group(1))
                if index in found:  # shard.1.csv beside shard.00001.parquet: which one is meant?
                    self.layout_problems.append(f"{os.path.join(folder, file)}: a second shard {index} in {name} "
                                                f"(beside {os.path.basename(found[index].path)}); left out")
                    continue
                found[index] = ShardFile(name, os.path.join(folder, file), index, match.group(2), storage)
            if found:
                self.shardsets[name] = found
        if not self.shardsets:
            raise LavenderError(f"{self.root}: no shardset folder with shard.NNNNN.csv or .parquet files")
        self.uid = uid or self.find_uid()
        self.main = main or self._pick_main()
        if self.main not in self.shardsets:
            raise LavenderError(f"{self.root}: no shardset {self.main!r} (shardsets: {', '.join(self.shardsets)})")
        mains = self.shardsets[self.main]
        for name, files in self.shardsets.items():
            for index, file in files.items():
                if index not in mains:  # lavender reads a feature shard only through its main shard
                    self.layout_problems.append(f"{file.path}: shard {index} is not in the main shardset "
                                                f"{self.main!r}; its rows are not shown")
        for problem in self.layout_problems:
            log.warning("%s", problem)
        # the main shardset first: its rows are the samples, the others join onto them
        order = [self.main] + [n for n in self.shardsets if n != self.main]
        self._shards = [LavenderShard(self, i, {name: self.shardsets[name][i] for name in order
                                                if i in self.shardsets[name]}) for i in sorted(mains)]

    def _first_columns(self) -> dict[str, list[str]]:
        """Each shardset's columns, from the header (csv) or schema (parquet) of its first
        readable file (a shardset with none is left to its files' own errors)."""
        found: dict[str, list[str]] = {}
        for name, files in self.shardsets.items():
            for index in sorted(files):
                try:
                    found[name] = files[index].columns()
                    break
                except LavenderError:
                    continue
        return found

    def find_uid(self) -> str:
        """The uid column: the one column every shardset has (``uid``, then ``id``, then
        ``__key__`` where they share more); :class:`LavenderError` naming the candidates if
        that does not decide it. Reads only headers and schemas."""
        columns = self._first_columns()
        if not columns:
            return UID_NAMES[0]  # no file can be read: each says so when its shard opens
        shared = set.intersection(*(set(c) for c in columns.values()))
        candidates = [c for c in next(iter(columns.values())) if c in shared]
        if len(candidates) == 1:
            return candidates[0]
        preferred = next((name for name in UID_NAMES if name in shared), None)
        if preferred is not None:
            return preferred
        if not candidates:
            raise LavenderError(f"{self.root}: no column is in every shardset ({', '.join(columns)}), so none can "
                                "join them: choose the uid column with -o uid_column=COLUMN")
        return self._undecided(candidates)

    def _undecided(self, candidates: list[str]) -> str:
        shown = ", ".join(repr(c) for c in candidates[:10]) + (" ..." if len(candidates) > 10 else "")
        raise LavenderError(f"{self.root}: the uid column could be any of {shown}: choose it with "
                            "-o uid_column=COLUMN")

    def _pick_main(self) -> str:
        """The shardset the others join onto when none is named: the one with the most shards,
        then the most columns, then the first by folder name (lavender-data's main shardset is
        a setting of its server's database, not of the files)."""
        columns = self._first_columns()
        names = list(self.shardsets)
        return max(names, key=lambda n: (len(self.shardsets[n]), len(columns.get(n, ())), -names.index(n)))

    def kinds(self) -> dict[tuple[str, str], str | None]:
        """The kind of cell (:func:`.cells.sniff`) of every binary parquet column, per shardset:
        decided once, from its first non-empty cell in the shardset's first shard that has one,
        so a column's files have one extension in every sample."""
        with self._lock:
            if self._kinds is not None:
                return self._kinds
        kinds: dict[tuple[str, str], str | None] = {}
        for name, files in self.shardsets.items():
            for column in self._binary_columns(files):
                kinds[(name, column)] = None
                for index in sorted(files):
                    try:
                        cell = files[index].first_cell(column) if column in files[index].binary_columns() else None
                    except LavenderError:
                        continue  # its shard says so when it opens
                    if cell is not None:
                        kinds[(name, column)] = cells.sniff(cell)
                        break
        with self._lock:
            self._kinds = kinds
        return kinds

    @staticmethod
    def _binary_columns(files: dict[int, ShardFile]) -> list[str]:
        for index in sorted(files):
            try:
                return files[index].binary_columns()
            except LavenderError:
                continue
        return []

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
        shards of one shardset, or in one shard index here and another there (the first
        :data:`.errors.MAX_PROBLEMS` lines of a file, then a count)."""
        problems = Problems()  # a line each, up to MAX_PROBLEMS a file (a shard repeating another's every uid)
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
                        problems.add(file.path, f"{file.path} row {row + 1}: uid {uid!r} is also in shard {seen[uid]} of "
                                                f"{name}")
                        continue
                    seen[uid] = shard.index
        home: dict[str, tuple[str, int]] = {}
        for name in sorted(where):
            for uid, index in where[name].items():
                first = home.setdefault(uid, (name, index))
                if first[1] != index:
                    problems.add(self.root, f"uid {uid!r} is in shard {first[1]} of {first[0]} but in shard {index} of "
                                            f"{name}")
        return self.layout_problems + problems.lines()

    def info(self) -> list[str]:
        sets = ", ".join(f"{name} ({len(files)} shards)" for name, files in self.shardsets.items())
        return [f"format       lavender: shardsets {sets}; {self.join} join onto {self.main!r} by column {self.uid!r}"]


def looks_like(path: str, storage: Storage = LOCAL) -> bool:
    """A folder with a sub-folder holding a ``shard.NNNNN.csv`` or ``.parquet`` (names only)."""
    folders = [os.path.join(path, n) for n, is_dir in listdir_or_empty(storage, path) if is_dir and not n.startswith(".")]
    return any(SHARD_FILE.fullmatch(n) for folder in folders for n, _ in listdir_or_empty(storage, folder))


def open_source(path: str, options: Any, storage: Storage = LOCAL) -> LavenderSource:
    """The Lavender dataset at ``path``, joined as ``options`` say (:class:`~.factory.SourceOptions`:
    ``uid_column``, ``join``, ``main_shardset``)."""
    return LavenderSource(os.fspath(path), uid=options.uid_column or DEFAULT_UID,
                          join=getattr(options, "join", None) or DEFAULT_JOIN,
                          main=getattr(options, "main_shardset", None), storage=storage)

