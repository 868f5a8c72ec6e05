"""A folder of Lavender shardsets as a source (:class:`LavenderSource`): its shard files found
by name, a :class:`.shard.LavenderShard` per shard index, and the checks across shards
(a uid in one shard index here and another there)."""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from atlasfs.formats.lavender.files import SHARD_FILE, LavenderError, RowGroupCache, ShardFile
from atlasfs.formats.lavender.shard import LavenderShard
from atlasfs.formats.source import Source

log = logging.getLogger("atlasfs")

DEFAULT_UID = "uid"
#: Bytes of parquet row groups kept decoded (per source) for the blocks that share them.
ROW_GROUP_CACHE_BYTES = 64 << 20
#: Unjoinable uids logged per shard at most (``verify`` lists all of them).
LOGGED_PROBLEMS = 20


class LavenderSource(Source):
    """A folder of shardsets, each shard index a :class:`LavenderShard`."""

    kind = "lavender"

    def __init__(self, root: str, uid: str = DEFAULT_UID) -> None:
        self.root = os.fspath(root)
        self.uid = uid
        self.row_groups = RowGroupCache(ROW_GROUP_CACHE_BYTES)
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

