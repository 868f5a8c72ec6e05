"""A shard's file table: every folder and file, compact, searchable, storable.

Entries are kept sorted by path bytes in a few numpy arrays and one blob of
names, about 20 bytes per entry plus its path, so that the tables of
millions of files fit in memory. The children of a folder are a contiguous
run of that order (``"d/x"`` sorts between ``"d/"`` and ``"d0"``), so
lookups and listings are binary searches.

A table can be saved to a file and loaded back: the mount keeps one per
shard so that a second mount lists without decoding anything. A stored table
is untrusted input (it may sit inside a downloaded dataset), so loading
validates every path and position before the table is used.
"""

from __future__ import annotations

import json
import operator
import os
import tempfile
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any

import numpy as np

FILE, DIR, UNREADABLE = 0, 1, 2
#: The size of a file whose bytes have not been encoded yet: a table can name
#: files before it knows how big they are (a listing needs no sizes).
UNKNOWN_SIZE = 2**64 - 1
_MAGIC = b"ATLFSTB1"
_HEADER_MAX = 1 << 20
#: (name, dtype) of the per-entry arrays, in file order.
_COLUMNS = (("kind", np.uint8), ("size", np.uint64), ("block", np.uint32), ("pos", np.uint32),
            ("file", np.uint16))


@dataclass(frozen=True)
class Row:
    """One entry of a table."""

    index: int
    path: str
    kind: int
    size: int
    block: int
    pos: int
    file: int


class FileTable:
    """The sorted entries of one shard. Build with :meth:`build`, or :meth:`load`."""

    def __init__(self, names: bytes, offsets: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        self._names = names
        self._offsets = offsets
        self.kind = columns["kind"]
        self.size = columns["size"]
        self.block = columns["block"]
        self.pos = columns["pos"]
        self.file = columns["file"]

    def __len__(self) -> int:
        return len(self.kind)

    @classmethod
    def build(cls, rows: list[tuple[str, int, int, int, int, int]]) -> "FileTable":
        """A table from ``(path, kind, size, block, pos, file)`` rows (``size`` may be
        :data:`UNKNOWN_SIZE`); folders implied by paths are added. Paths must be unique
        (the naming layer guarantees it)."""
        entries = {path.encode("utf-8"): (kind, size, block, pos, file) for path, kind, size, block, pos, file in rows}
        for path in list(entries):
            parent = path.rpartition(b"/")[0]
            while parent and parent not in entries:
                entries[parent] = (DIR, 0, 0, 0, 0)
                parent = parent.rpartition(b"/")[0]
        order = sorted(entries)
        lengths = np.fromiter((len(p) for p in order), dtype=np.uint64, count=len(order))
        offsets = np.zeros(len(order) + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        values = [entries[p] for p in order]
        columns = {name: np.array([v[i] for v in values], dtype=dtype)
                   for i, (name, dtype) in enumerate(_COLUMNS)}
        return cls(b"".join(order), offsets, columns)

    def _path(self, i: int) -> bytes:
        return self._names[int(self._offsets[i]):int(self._offsets[i + 1])]

    def row(self, i: int) -> Row:
        """Entry ``i`` (in path order)."""
        return Row(i, self._path(i).decode("utf-8"), int(self.kind[i]), int(self.size[i]), int(self.block[i]),
                   int(self.pos[i]), int(self.file[i]))

    def find(self, path: str) -> int | None:
        """Index of the entry at ``path`` (relative to the shard folder), or None."""
        target = path.encode("utf-8")
        i = bisect_left(range(len(self)), target, key=self._path)
        return i if i < len(self) and self._path(i) == target else None

    def children(self, folder: str) -> list[tuple[str, int]]:
        """``(name, index)`` of each entry directly in ``folder`` ("" for the shard folder), in byte order."""
        prefix = folder.encode("utf-8") + b"/" if folder else b""
        n = len(self)
        lo, hi = 0, n
        if prefix:
            lo = bisect_left(range(n), prefix, key=self._path)
            # what is under "d/" sorts before "d0" ("0" follows "/")
            hi = bisect_left(range(lo, n), prefix[:-1] + b"0", key=self._path) + lo
        offsets = self._offsets[lo:hi + 1].tolist()
        start = len(prefix)
        names = self._names
        if not prefix and b"/" not in names:  # a flat shard folder: every entry is a child
            return list(zip([names[a:b].decode("utf-8") for a, b in zip(offsets, offsets[1:])], range(lo, hi)))
        result = []
        for i, (a, b) in enumerate(zip(offsets, offsets[1:]), lo):
            rest = names[a + start:b]
            if rest and b"/" not in rest:
                result.append((rest.decode("utf-8"), i))
        return result

    # -- storage

    def save(self, path: str, key: dict[str, Any]) -> None:
        """Write the table to ``path`` atomically, tagged with ``key`` (what it was built from)."""
        header = json.dumps({"key": key, "entries": len(self), "names": len(self._names)}).encode()
        folder = os.path.dirname(path)
        fd, tmp = tempfile.mkstemp(prefix=".table-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + len(header).to_bytes(4, "little") + header)
                f.write(self._offsets.tobytes())
                for name, dtype in _COLUMNS:
                    f.write(getattr(self, name).astype(dtype, copy=False).tobytes())
                f.write(self._names)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str, key: dict[str, Any], limits: "Limits") -> "FileTable | None":
        """The table stored at ``path`` if it was built from ``key`` and is well formed, else None."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            return None
        try:
            return cls._parse(data, key, limits)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            return None

    @classmethod
    def _parse(cls, data: bytes, key: dict[str, Any], limits: "Limits") -> "FileTable | None":
        if not data.startswith(_MAGIC):
            return None
        size = int.from_bytes(data[8:12], "little")
        if size > _HEADER_MAX:
            return None
        header = json.loads(data[12:12 + size])
        if header.get("key") != key:
            return None
        n, names_len = int(header["entries"]), int(header["names"])
        at = 12 + size
        expected = at + 8 * (n + 1) + sum(np.dtype(d).itemsize * n for _, d in _COLUMNS) + names_len
        if n < 0 or names_len < 0 or len(data) != expected:
            return None
        offsets = np.frombuffer(data, dtype=np.uint64, count=n + 1, offset=at)
        at += 8 * (n + 1)
        columns = {}
        for name, dtype in _COLUMNS:
            columns[name] = np.frombuffer(data, dtype=dtype, count=n, offset=at)
            at += np.dtype(dtype).itemsize * n
        columns["size"] = columns["size"].copy()  # writable: unknown sizes are filled in later
        table = cls(data[at:], offsets, columns)
        return table if table._valid(limits) else None

    def _valid(self, limits: "Limits") -> bool:
        """Paths safe, sorted and unique; positions inside the shard; folders consistent."""
        if len(self) == 0:
            return len(self._names) == 0 and int(self._offsets[0]) == 0
        if int(self._offsets[0]) != 0 or int(self._offsets[-1]) != len(self._names):
            return False
        if not bool(np.all(self._offsets[1:] > self._offsets[:-1])):
            return False
        if bool(np.any(self.kind > UNREADABLE)) or bool(np.any(self.block >= max(limits.blocks, 1))):
            return False
        if bool(np.any(self.pos >= max(limits.block_size, 1))):
            return False
        names = self._names
        offsets = self._offsets[:-1]
        if b"\0" in names:
            return False
        names.decode("utf-8")  # raises if not UTF-8; a path must also start on a character:
        if len(names) and bool(np.any(np.frombuffer(names, dtype=np.uint8)[offsets] & 0xC0 == 0x80)):
            return False
        bounds = self._offsets.tolist()
        paths = [names[a:b] for a, b in zip(bounds, bounds[1:])]
        if not all(map(operator.lt, paths, paths[1:])):  # sorted and unique
            return False
        if b"/" not in names:  # one flat folder, the usual shard: the per-path checks below, at once
            return b"." not in paths and b".." not in paths and int(np.max(np.diff(self._offsets))) <= 255
        folders = set()
        for i, path in enumerate(paths):
            if any(part in (b"", b".", b"..") or len(part) > 255 for part in path.split(b"/")):
                return False
            parent = path.rpartition(b"/")[0]
            if parent and parent not in folders:  # a parent sorts before its children
                return False
            if self.kind[i] == DIR:
                folders.add(path)
        return True


@dataclass(frozen=True)
class Limits:
    """What a stored table's positions must stay within."""

    blocks: int
    block_size: int
