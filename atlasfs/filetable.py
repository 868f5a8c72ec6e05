"""A shard's file table: every folder and file, compact, searchable, storable.

Entries are kept in *tree order*, the order a listing shows them and ``tar``
walks them: each folder's children in the order of the first example under
them (files of one example adjacent, in its fixed order), each sub-folder's
entries right after it. A shard without sub-folders is thus simply in
example order. Lookups go through a permutation that sorts the entries by
path bytes, so they are binary searches. The table is a few numpy arrays and
one blob of names, about 24 bytes per entry plus its path, so that the
tables of millions of files fit in memory.

A table can be saved to a file and loaded back: the mount keeps one per
shard so that a second mount lists without decoding anything. It carries
its source's *state* too (what a pass over the shard's files learned, such
as Dolma's gzip seek points; :meth:`atlasfs.sources.source.SourceShard.prepare`),
so that the second mount makes no pass either. A stored table
is untrusted input (it may sit inside a downloaded dataset), so loading
validates every path and position before the table is used, and says why it
refuses one.
"""

from __future__ import annotations

import json
import operator
import os
import tempfile
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

FILE, DIR, UNREADABLE = 0, 1, 2
#: The size of a file whose bytes have not been encoded yet: a table can name
#: files before it knows how big they are (a listing needs no sizes).
UNKNOWN_SIZE = 2**64 - 1
_MAGIC = b"ATLFSTB3"
_HEADER_MAX = 1 << 20
#: (name, dtype) of the per-entry arrays, in file order. ``by_path``: entry numbers sorted by path bytes.
_COLUMNS = (("kind", np.uint8), ("size", np.uint64), ("block", np.uint32), ("pos", np.uint32),
            ("file", np.uint16), ("by_path", np.uint32))

Rows = list[tuple[str, int, int, int, int, int]]
#: Limits from a stored table's source state (see :meth:`FileTable.load`).
LimitsOf = Callable[[bytes], "Limits"]


class TableError(ValueError):
    """A stored table that must not be used; the message says why."""


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


def _tree_order(rows: Rows) -> Rows:
    """``rows`` (files in example order, paths unique) in tree order, with the folders
    their paths imply added, each where its first file is met."""
    if not any("/" in row[0] for row in rows):
        return rows
    root: dict[str, Any] = {}  # name -> sub-folder dict, or the row of a file (dicts keep insertion order)
    for row in rows:
        *folders, name = row[0].split("/")
        node = root
        for part in folders:
            node = node.setdefault(part, {})
        node[name] = row
    ordered: Rows = []
    stack = [("", iter(root.items()))]
    while stack:  # depth first without recursion: keys may nest hundreds of folders deep
        prefix, children = stack[-1]
        for name, child in children:
            if isinstance(child, dict):
                path = prefix + name
                ordered.append((path, DIR, 0, 0, 0, 0))
                stack.append((path + "/", iter(child.items())))
                break
            ordered.append(child)
        else:
            stack.pop()
    return ordered


class FileTable:
    """The entries of one shard in tree order. Build with :meth:`build`, or :meth:`load`."""

    def __init__(self, names: bytes, offsets: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        self._names = names
        self._offsets = offsets
        self.kind = columns["kind"]
        self.size = columns["size"]
        self.block = columns["block"]
        self.pos = columns["pos"]
        self.file = columns["file"]
        self.by_path = columns["by_path"]
        #: What the shard's source learned by a pass over its files (stored with the table).
        self.state = b""

    def __len__(self) -> int:
        return len(self.kind)

    @classmethod
    def build(cls, rows: Rows) -> "FileTable":
        """A table from ``(path, kind, size, block, pos, file)`` rows of files in example
        order (``size`` may be :data:`UNKNOWN_SIZE`); folders implied by paths are added.
        Paths must be unique (the naming layer guarantees it)."""
        ordered = _tree_order(rows)
        paths = [row[0].encode("utf-8") for row in ordered]
        lengths = np.fromiter(map(len, paths), dtype=np.uint64, count=len(paths))
        offsets = np.zeros(len(paths) + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        columns = {name: np.array([row[i + 1] for row in ordered], dtype=dtype)
                   for i, (name, dtype) in enumerate(_COLUMNS[:-1])}
        columns["by_path"] = np.array(sorted(range(len(paths)), key=paths.__getitem__), dtype=np.uint32)
        return cls(b"".join(paths), offsets, columns)

    def _path(self, i: int) -> bytes:
        return self._names[int(self._offsets[i]):int(self._offsets[i + 1])]

    def row(self, i: int) -> Row:
        """Entry ``i`` (in tree order)."""
        return Row(i, self._path(i).decode("utf-8"), int(self.kind[i]), int(self.size[i]), int(self.block[i]),
                   int(self.pos[i]), int(self.file[i]))

    def find(self, path: str) -> int | None:
        """Index of the entry at ``path`` (relative to the shard folder), or None."""
        target = path.encode("utf-8")
        by_path = self.by_path
        j = bisect_left(range(len(self)), target, key=lambda j: self._path(by_path.item(j)))
        if j < len(self) and self._path(by_path.item(j)) == target:
            return by_path.item(j)
        return None

    def children(self, folder: str) -> list[tuple[str, int]]:
        """``(name, index)`` of each entry directly in ``folder`` ("" for the shard folder), in tree order."""
        names = self._names
        if not folder:
            lo, prefix = 0, b""
            if b"/" not in names:  # a flat shard folder: every entry is a child
                offsets = self._offsets.tolist()
                return list(zip([names[a:b].decode("utf-8") for a, b in zip(offsets, offsets[1:])], range(len(self))))
        else:
            found = self.find(folder)
            if found is None or self.kind[found] != DIR:
                return []
            lo, prefix = found + 1, folder.encode("utf-8") + b"/"
        result = []
        start = len(prefix)
        for i in range(lo, len(self)):  # the folder's entries follow it, up to the first one outside it
            path = self._path(i)
            if not path.startswith(prefix):
                break
            rest = path[start:]
            if b"/" not in rest:
                result.append((rest.decode("utf-8"), i))
        return result

    def example_order(self) -> list[int]:
        """Indices of the files (readable or not) in example order, a file's example's files adjacent."""
        files = np.flatnonzero(self.kind != DIR)
        if b"/" in self._names:  # sub-folders group a folder's files: put them back in example order
            files = files[np.lexsort((self.file[files], self.pos[files], self.block[files]))]
        return files.tolist()

    # -- storage

    def save(self, path: str, key: dict[str, Any]) -> None:
        """Write the table to ``path`` atomically, tagged with ``key`` (what it was built from)."""
        header = json.dumps({"key": key, "entries": len(self), "names": len(self._names),
                             "state": len(self.state)}).encode()
        folder = os.path.dirname(path)
        fd, tmp = tempfile.mkstemp(prefix=".table-", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + len(header).to_bytes(4, "little") + header)
                f.write(self._offsets.tobytes())
                for name, dtype in _COLUMNS:
                    f.write(getattr(self, name).astype(dtype, copy=False).tobytes())
                f.write(self._names)
                f.write(self.state)
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str, key: dict[str, Any], limits: "Limits | LimitsOf") -> "FileTable | None":
        """The table stored at ``path``, or None if there is no such file; raises
        :class:`TableError` saying why if it was not built from ``key`` or is not well formed.

        ``limits`` may be a function of the stored state that returns them (it takes the
        state back into the shard's source first, raising ``ValueError`` if it does not fit)."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TableError(f"cannot be read ({exc.strerror})") from None
        try:
            return cls._parse(data, key, limits)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            if isinstance(exc, TableError):
                raise
            raise TableError(f"is corrupt ({exc})") from None

    @classmethod
    def _parse(cls, data: bytes, key: dict[str, Any], limits: "Limits | LimitsOf") -> "FileTable":
        if not data.startswith(_MAGIC):
            raise TableError("is not a file table of this atlasfs version")
        size = int.from_bytes(data[8:12], "little")
        if size > _HEADER_MAX:
            raise TableError("is corrupt (header too large)")
        header = json.loads(data[12:12 + size])
        if header.get("key") != key:
            raise TableError("was built from other files or by other naming rules (stale or foreign)")
        n, names_len, state_len = int(header["entries"]), int(header["names"]), int(header["state"])
        at = 12 + size
        expected = at + 8 * (n + 1) + sum(np.dtype(d).itemsize * n for _, d in _COLUMNS) + names_len + state_len
        if n < 0 or names_len < 0 or state_len < 0 or len(data) != expected:
            raise TableError(f"is corrupt ({len(data)} bytes where its header means {expected})")
        offsets = np.frombuffer(data, dtype=np.uint64, count=n + 1, offset=at)
        at += 8 * (n + 1)
        columns = {}
        for name, dtype in _COLUMNS:
            columns[name] = np.frombuffer(data, dtype=dtype, count=n, offset=at)
            at += np.dtype(dtype).itemsize * n
        columns["size"] = columns["size"].copy()  # writable: unknown sizes are filled in later
        table = cls(data[at:at + names_len], offsets, columns)
        table.state = data[at + names_len:]
        if not isinstance(limits, Limits):
            try:
                limits = limits(table.state)
            except ValueError as exc:
                raise TableError(f"holds a source state that does not fit ({exc})") from None
        problem = table._problem(limits)
        if problem:
            raise TableError(f"is corrupt ({problem})")
        return table

    def _problem(self, limits: "Limits") -> str | None:
        """Why the table is unsafe to use, or None: paths safe and unique, positions inside
        the shard, every folder listed before its entries and holding them contiguously."""
        n = len(self)
        if n == 0:
            return None if len(self._names) == 0 and int(self._offsets[0]) == 0 else "names without entries"
        if int(self._offsets[0]) != 0 or int(self._offsets[-1]) != len(self._names):
            return "name offsets do not cover the names"
        if not bool(np.all(self._offsets[1:] > self._offsets[:-1])):
            return "an empty name"
        if bool(np.any(self.kind > UNREADABLE)):
            return "an unknown entry kind"
        if bool(np.any(self.block >= max(limits.blocks, 1))) or bool(np.any(self.pos >= max(limits.block_size, 1))):
            return "a position outside the shard"
        if not np.array_equal(np.sort(self.by_path), np.arange(n, dtype=np.uint32)):
            return "the path order is not a permutation of the entries"
        names = self._names
        if b"\0" in names:
            return "a NUL in a name"
        names.decode("utf-8")  # raises if not UTF-8; a path must also start on a character:
        if bool(np.any(np.frombuffer(names, dtype=np.uint8)[self._offsets[:-1]] & 0xC0 == 0x80)):
            return "a name that is not UTF-8"
        bounds = self._offsets.tolist()
        paths = [names[a:b] for a, b in zip(bounds, bounds[1:])]
        in_path_order = [paths[i] for i in self.by_path.tolist()]
        if not all(map(operator.lt, in_path_order, in_path_order[1:])):
            return "paths out of order or repeated"
        if b"/" not in names:  # one flat folder, the usual shard: the per-path checks below, at once
            if b"." in paths or b".." in paths or int(np.max(np.diff(self._offsets))) > 255:
                return "an unsafe name"
            return None
        open_folders: list[bytes] = []  # the folders the walk is inside, outermost first
        kinds = self.kind.tolist()
        for path, kind in zip(paths, kinds):
            if any(part in (b"", b".", b"..") or len(part) > 255 for part in path.split(b"/")):
                return "an unsafe name"
            parent = path.rpartition(b"/")[0]
            while open_folders and open_folders[-1] != parent:
                open_folders.pop()
            if parent and not open_folders:  # its folder is not listed before it, or was left already
                return "entries not grouped under their folders"
            if kind == DIR:
                open_folders.append(path)
        return None


@dataclass(frozen=True)
class Limits:
    """What a stored table's positions must stay within."""

    blocks: int
    block_size: int
