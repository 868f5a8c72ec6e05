"""Lavender Data shardsets: reading, without FUSE.

A Lavender dataset is a folder of shardsets, each a folder of
``shard.NNNNN.csv`` or ``shard.NNNNN.parquet`` files holding some of the
dataset's columns, and all holding the uid column (``uid`` unless told
otherwise). A sample is the join by uid of the rows of the shards with the
same index in every shardset; a uid missing from a shardset lacks that
shardset's columns. The rules are checked when the dataset is scanned: a uid
must sit in the same shard index in every shardset that has it, and only
once in each; every shard must have the uid column.

Samples keep the order of the first shardset (by folder name) that has them,
then the uids only later shardsets have, in theirs. CSV cells are strings;
parquet cells keep their types (read with pyarrow, ``pip install
atlasfs[lavender]``). For now a shard is read whole: its files are loaded
when any of its samples is, not a row group at a time.
"""

from __future__ import annotations

import csv
import io
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ..errors import AtlasFormatError

SHARD_FILE = re.compile(r"shard\.([0-9]+)\.(csv|parquet)")
DEFAULT_UID = "uid"


class LavenderError(AtlasFormatError):
    """A shardset, shard, row or uid that breaks the rules; the message names it."""


def _uid_text(value: Any) -> str:
    return value if isinstance(value, str) else str(value)


@dataclass
class ShardFile:
    """One ``shard.NNNNN.<csv|parquet>`` of one shardset."""

    shardset: str
    path: str
    index: int
    kind: str  # "csv" or "parquet"

    def columns(self) -> list[str]:
        """The column names, in file order."""
        if self.kind == "csv":
            with open(self.path, newline="", encoding="utf-8") as f:
                return next(csv.reader(f), [])
        import pyarrow.parquet as pq
        return list(pq.ParquetFile(self.path).schema_arrow.names)

    def rows(self) -> list[dict[str, Any]]:
        """Every row as a dict (csv cells as strings, parquet cells as Python values)."""
        try:
            if self.kind == "csv":
                with open(self.path, newline="", encoding="utf-8") as f:
                    reader = csv.DictReader(f)
                    rows = []
                    for number, row in enumerate(reader, start=2):
                        if None in row or any(v is None for v in row.values()):
                            raise LavenderError(f"{self.path} line {number}: not as many cells as columns")
                        rows.append(dict(row))
                    return rows
            import pyarrow.parquet as pq
            return pq.read_table(self.path).to_pylist()
        except (OSError, UnicodeDecodeError, csv.Error, ValueError) as exc:
            if isinstance(exc, LavenderError):
                raise
            raise LavenderError(f"{self.path}: cannot be read ({exc})") from None


@dataclass
class Shard:
    """Shard index ``index`` across the shardsets: its samples' uids and where their rows are."""

    index: int
    files: dict[str, ShardFile]  # shardset name -> its file of this index
    uids: list[str] = field(default_factory=list)  # in sample order
    rows: dict[str, dict[str, int]] = field(default_factory=dict)  # shardset -> uid -> row number

    @property
    def name(self) -> str:
        """The folder name: ``shard.NNNNN`` as the files name it."""
        return f"shard.{self.index:05d}"


class LavenderDataset:
    """A folder of shardsets. :meth:`scan` checks the join rules and orders the samples."""

    def __init__(self, root: str, uid: str = DEFAULT_UID) -> None:
        self.root = os.fspath(root)
        self.uid = uid
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
                if match:
                    index = int(match.group(1))
                    if index in found:
                        raise LavenderError(f"{os.path.join(folder, file)}: a second shard {index} in {name}")
                    found[index] = ShardFile(name, os.path.join(folder, file), index, match.group(2))
            if found:
                self.shardsets[name] = found
        if not self.shardsets:
            raise LavenderError(f"{self.root}: no shardset folder with shard.NNNNN.csv or .parquet files")
        indices = sorted({i for files in self.shardsets.values() for i in files})
        self.shards = [Shard(i, {name: files[i] for name, files in self.shardsets.items() if i in files})
                       for i in indices]

    def scan(self) -> list[str]:
        """Read every shard's uids, check the rules, order the samples; returns the problems
        found (one line each). A shard file breaking them is left out of its shard."""
        problems: list[str] = []
        where: dict[str, dict[str, int]] = {}  # shardset -> uid -> shard index
        for shard in self.shards:
            order: dict[str, None] = {}
            for name, file in list(shard.files.items()):
                try:
                    uids = self._uids(file)
                except LavenderError as exc:
                    problems.append(str(exc))
                    del shard.files[name]
                    continue
                seen = where.setdefault(name, {})
                rows: dict[str, int] = {}
                for row, uid in enumerate(uids):
                    if uid in rows:
                        problems.append(f"{file.path} row {row + 1}: uid {uid!r} again (first at row {rows[uid] + 1})")
                        continue
                    if seen.get(uid, shard.index) != shard.index:
                        problems.append(f"{file.path} row {row + 1}: uid {uid!r} is also in shard {seen[uid]} of {name}")
                        continue
                    rows[uid] = row
                    seen[uid] = shard.index
                    order[uid] = None
                shard.rows[name] = rows
            shard.uids = list(order)
        # the same uid in another shard index in another shardset breaks the join
        home: dict[str, tuple[str, int]] = {}
        for name in sorted(where):
            for uid, index in where[name].items():
                first = home.setdefault(uid, (name, index))
                if first[1] != index:
                    problems.append(f"uid {uid!r} is in shard {first[1]} of {first[0]} but in shard {index} of {name}")
        return problems

    def _uids(self, file: ShardFile) -> list[str]:
        if self.uid not in file.columns():
            raise LavenderError(f"{file.path}: no {self.uid!r} column (choose it with -o uid=COLUMN)")
        return [_uid_text(row[self.uid]) for row in file.rows()]

    def samples(self, shard: Shard, first: int, count: int) -> list[dict[str, Any]]:
        """Samples ``first`` to ``first + count`` of ``shard``: the uid as ``__key__`` and every
        shardset's columns for it (the uid column once)."""
        chosen = shard.uids[first:first + count]
        samples: list[dict[str, Any]] = [{"__key__": uid} for uid in chosen]
        for name, file in shard.files.items():
            table = file.rows()
            rows = shard.rows.get(name, {})
            for sample, uid in zip(samples, chosen):
                row = rows.get(uid)
                if row is None:
                    continue
                for column, value in table[row].items():
                    if column != self.uid:
                        sample.setdefault(column, value)
        return samples


def write_csv_shard(path: str, rows: list[dict[str, Any]]) -> None:
    """Write ``rows`` as a Lavender csv shard (for tests and demos)."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    with open(path, "w", newline="", encoding="utf-8") as f:
        f.write(buffer.getvalue())
