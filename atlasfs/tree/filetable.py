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
as Dolma's gzip seek points; :meth:`atlasfs.formats.source.SourceShard.prepare`),
so that the second mount makes no pass either. A stored table
is untrusted input (it may sit inside a downloaded dataset), so loading
validates every path and position before the table is used, and says why it
refuses one.

A table may also hold, per file, a *locator* from its source
(:class:`~atlasfs.formats.source.Locator`, :meth:`SourceShard.file_spans
<atlasfs.formats.source.SourceShard.file_spans>`): where the file's bytes can
be read without decoding its block, or, for small files, the bytes themselves
(*inline*). They are optional columns (:class:`Locators`), 14 bytes a file, plus
each distinct prefix once and the inline bytes (at most :data:`INLINE_AVERAGE`
a file of the table on average); a table without them is as valid. The source
checks what a locator points at on every read, so a stored one that lies only
costs a fallback to the block.
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

from atlasfs.formats.source import Locator

FILE, DIR, UNREADABLE = 0, 1, 2
#: The size of a file whose bytes have not been encoded yet: a table can name
#: files before it knows how big they are (a listing needs no sizes).
UNKNOWN_SIZE = 2**64 - 1
_MAGIC = b"ATLFSTB5"  # 4: optional locator columns; 5: with their lengths
_HEADER_MAX = 1 << 20
#: (name, dtype) of the per-entry arrays, in file order. ``by_path``: entry numbers sorted by path bytes.
_COLUMNS = (("kind", np.uint8), ("size", np.uint64), ("block", np.uint32), ("pos", np.uint32),
            ("file", np.uint16), ("by_path", np.uint32))

#: ``(path, kind, size, block, pos, file)``, optionally with a 7th item, the file's
#: :class:`~atlasfs.formats.source.Locator` (or None).
Rows = list[tuple[Any, ...]]
#: (attribute of :class:`Locators`, stored dtype) of the optional locator columns, in file order.
_LOCATOR_COLUMNS = (("offset", np.uint32), ("length", np.uint32), ("check", np.uint32), ("prefix", np.uint16))
#: A row's locator offset when it has none.
NO_LOCATOR = 0xFFFFFFFF
#: A row's prefix number when its locator is inline (its offset is then in :attr:`Locators.inline`).
INLINE = 0xFFFF
#: Distinct prefixes (``.npy`` headers) a table keeps, and their bytes in all: arrays of many
#: shapes (token arrays of every length) would otherwise grow a table by megabytes.
MAX_PREFIXES = 0xFFFE
MAX_PREFIX_BYTES = 1 << 20
#: Most bytes of an inline file, and most inline bytes a table keeps, per file of the table on
#: average (in row order: later small files past the bound get no inline locator).
INLINE_MAX = 255
INLINE_AVERAGE = 64
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


class Locators:
    """The locators of a table's rows as columns: ``offset`` (uint32, :data:`NO_LOCATOR`
    for none; for an inline one, where its bytes start in ``inline``), ``length`` (uint32:
    the run's, or the inline file's), ``check`` (uint32), ``prefix`` (uint16: 0 none, else
    1 + its index in ``prefixes``, or :data:`INLINE`). The length is stored although the
    file's size often tells it: a table names files before it knows their sizes, and a
    locator then gives a file's size at its lookup without decoding its block (a table
    whose sizes are all known lists with attributes: the kernel, and libfuse, then keep
    an entry for every file listed)."""

    __slots__ = ("check", "inline", "length", "offset", "prefix", "prefixes")

    def __init__(self, offset: np.ndarray, length: np.ndarray, check: np.ndarray, prefix: np.ndarray,
                 prefixes: list[bytes], inline: bytes) -> None:
        self.offset = offset
        self.length = length
        self.check = check
        self.prefix = prefix
        self.prefixes = prefixes
        self.inline = inline

    @classmethod
    def build(cls, locators: list[Locator | None]) -> "Locators | None":
        """Columns for one locator per row (None: none); None if no row has one. Locators
        past the bounds (:data:`MAX_PREFIXES`, :data:`MAX_PREFIX_BYTES`, :data:`INLINE_MAX`,
        :data:`INLINE_AVERAGE`, offsets of 4 GiB) are left out: their files keep their blocks."""
        n = len(locators)
        if not any(loc is not None for loc in locators):
            return None
        offset = np.full(n, NO_LOCATOR, dtype=np.uint32)
        length = np.zeros(n, dtype=np.uint32)
        check = np.zeros(n, dtype=np.uint32)
        prefix = np.zeros(n, dtype=np.uint16)
        numbers: dict[bytes, int] = {}
        prefix_bytes = 0
        inline = bytearray()
        inline_bound = INLINE_AVERAGE * n
        for i, loc in enumerate(locators):
            if loc is None:
                continue
            if loc.inline:
                data = loc.prefix
                if loc.length or len(data) > INLINE_MAX or len(inline) + len(data) > inline_bound:
                    continue
                offset[i] = len(inline)
                length[i] = len(data)
                prefix[i] = INLINE
                inline += data
            else:
                if not 0 <= loc.offset < NO_LOCATOR or not 0 <= loc.length < NO_LOCATOR:
                    continue
                if loc.prefix:
                    number = numbers.get(loc.prefix)
                    if number is None:
                        if len(numbers) >= MAX_PREFIXES or prefix_bytes + len(loc.prefix) > MAX_PREFIX_BYTES:
                            continue
                        prefix_bytes += len(loc.prefix)
                        number = numbers[loc.prefix] = len(numbers) + 1
                    prefix[i] = number
                offset[i] = loc.offset
                length[i] = loc.length
            check[i] = loc.check & 0xFFFFFFFF
        return cls(offset, length, check, prefix, list(numbers), bytes(inline))

    def nbytes(self) -> int:
        """Memory the columns and their bytes take."""
        return (self.offset.nbytes + self.length.nbytes + self.check.nbytes + self.prefix.nbytes + len(self.inline)
                + sum(map(len, self.prefixes)))

    def problem(self, kinds: np.ndarray, sizes: np.ndarray) -> str | None:
        """Why stored columns are unsafe to use (they come from an untrusted file), or None."""
        n = len(kinds)
        if not len(self.offset) == len(self.length) == len(self.check) == len(self.prefix) == n:
            return "locator columns of another length than the table"
        if len(self.prefixes) > MAX_PREFIXES or sum(map(len, self.prefixes)) > MAX_PREFIX_BYTES:
            return "too many locator prefixes"
        if len(self.inline) > INLINE_AVERAGE * n:
            return "more inline bytes than a table keeps"
        located = self.offset != NO_LOCATOR
        if bool(np.any(located & (kinds != FILE))):
            return "a locator of an entry that is no file"
        if bool(np.any(~located & ((self.prefix != 0) | (self.length != 0)))):
            return "a locator prefix or length without a locator"
        inline = located & (self.prefix == INLINE)
        runs = located & ~inline
        if bool(np.any(self.prefix[runs] > len(self.prefixes))):
            return "a locator prefix out of range"
        ends = self.offset[inline].astype(np.uint64) + self.length[inline]
        if bool(np.any(self.length[inline] > INLINE_MAX)) or bool(np.any(ends > len(self.inline))):
            return "an inline file outside the table's inline bytes"
        prefix_lengths = np.array([0] + [len(p) for p in self.prefixes], dtype=np.uint64)
        located_sizes = np.where(inline, self.length.astype(np.uint64),
                                 prefix_lengths[np.where(runs, self.prefix, 0)] + self.length)
        known = located & (sizes != UNKNOWN_SIZE)
        if bool(np.any(located_sizes[known] != sizes[known])):
            return "a locator of another size than its file"
        return None


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
        #: Where files can be read without decoding their blocks (None: nowhere).
        self.locators: Locators | None = None

    def __len__(self) -> int:
        return len(self.kind)

    @classmethod
    def build(cls, rows: Rows) -> "FileTable":
        """A table from ``(path, kind, size, block, pos, file[, locator])`` rows of files in
        example order (``size`` may be :data:`UNKNOWN_SIZE`); folders implied by paths are
        added. Paths must be unique (the naming layer guarantees it). A row's locator, if
        any, must be of a file whose size is unknown or the locator's."""
        ordered = _tree_order(rows)
        paths = [row[0].encode("utf-8") for row in ordered]
        lengths = np.fromiter(map(len, paths), dtype=np.uint64, count=len(paths))
        offsets = np.zeros(len(paths) + 1, dtype=np.uint64)
        np.cumsum(lengths, out=offsets[1:])
        columns = {name: np.array([row[i + 1] for row in ordered], dtype=dtype)
                   for i, (name, dtype) in enumerate(_COLUMNS[:-1])}
        columns["by_path"] = np.array(sorted(range(len(paths)), key=paths.__getitem__), dtype=np.uint32)
        table = cls(b"".join(paths), offsets, columns)
        if any(len(row) > 6 and row[6] is not None for row in rows):
            table.locators = Locators.build([
                row[6] if len(row) > 6 and row[6] is not None and row[1] == FILE
                and row[2] in (row[6].size, UNKNOWN_SIZE) else None
                for row in ordered])
        return table

    def locator(self, i: int) -> Locator | None:
        """Where the file of entry ``i`` can be read without decoding its block, or None."""
        locators = self.locators
        if locators is None:
            return None
        offset = locators.offset.item(i)
        if offset == NO_LOCATOR:
            return None
        number = locators.prefix.item(i)
        length = locators.length.item(i)
        if number == INLINE:
            return Locator(0, 0, locators.check.item(i), locators.inline[offset:offset + length], True)
        return Locator(offset, length, locators.check.item(i), locators.prefixes[number - 1] if number else b"")

    def _path(self, i: int) -> bytes:
        return self._names[int(self._offsets[i]):int(self._offsets[i + 1])]

    def path(self, i: int) -> str:
        """The path of entry ``i`` (relative to the shard folder)."""
        return self._names[int(self._offsets[i]):int(self._offsets[i + 1])].decode("utf-8")

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

    def to_bytes(self, key: dict[str, Any]) -> bytes:
        """The table as stored, tagged with ``key`` (what it was built from)."""
        fields: dict[str, Any] = {"key": key, "entries": len(self), "names": len(self._names),
                                  "state": len(self.state)}
        locators = self.locators
        if locators is not None:
            fields["locators"] = {"prefixes": [len(p) for p in locators.prefixes], "inline": len(locators.inline)}
        header = json.dumps(fields).encode()
        parts = [_MAGIC + len(header).to_bytes(4, "little") + header, self._offsets.tobytes()]
        parts += [getattr(self, name).astype(dtype, copy=False).tobytes() for name, dtype in _COLUMNS]
        parts += [self._names, self.state]
        if locators is not None:
            parts += [getattr(locators, column).astype(dtype, copy=False).tobytes()
                      for column, dtype in _LOCATOR_COLUMNS]
            parts += [b"".join(locators.prefixes), locators.inline]
        return b"".join(parts)

    def save(self, path: str, key: dict[str, Any]) -> None:
        """Write the table to the local file ``path`` atomically (:meth:`to_bytes`)."""
        fd, tmp = tempfile.mkstemp(prefix=".table-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(self.to_bytes(key))
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str, key: dict[str, Any], limits: "Limits | LimitsOf") -> "FileTable | None":
        """The table stored in the local file ``path``, or None if there is no such file
        (:meth:`from_bytes`)."""
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise TableError(f"cannot be read ({exc.strerror})") from None
        return cls.from_bytes(data, key, limits)

    @classmethod
    def from_bytes(cls, data: bytes, key: dict[str, Any], limits: "Limits | LimitsOf") -> "FileTable":
        """The table ``data`` holds; raises :class:`TableError` saying why if it was not built
        from ``key`` or is not well formed.

        ``limits`` may be a function of the stored state that returns them (it takes the
        state back into the shard's source first, raising ``ValueError`` if it does not fit)."""
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
        stored_locators = header.get("locators")
        prefix_lengths: list[int] = []
        inline_len = 0
        locators_len = 0
        if stored_locators is not None:
            prefix_lengths = [int(length) for length in stored_locators["prefixes"]]
            inline_len = int(stored_locators["inline"])
            if len(prefix_lengths) > MAX_PREFIXES or any(length <= 0 for length in prefix_lengths) or inline_len < 0:
                raise TableError("is corrupt (locator prefixes out of bounds)")
            locators_len = sum(np.dtype(d).itemsize * n for _, d in _LOCATOR_COLUMNS) + sum(prefix_lengths) + inline_len
        at = 12 + size
        expected = (at + 8 * (n + 1) + sum(np.dtype(d).itemsize * n for _, d in _COLUMNS) + names_len + state_len
                    + locators_len)
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
        at += names_len
        table.state = data[at:at + state_len]
        at += state_len
        if stored_locators is not None:
            loc_columns = []
            for _, dtype in _LOCATOR_COLUMNS:
                loc_columns.append(np.frombuffer(data, dtype=dtype, count=n, offset=at))
                at += np.dtype(dtype).itemsize * n
            prefixes = []
            for length in prefix_lengths:
                prefixes.append(data[at:at + length])
                at += length
            table.locators = Locators(*loc_columns, prefixes, data[at:at + inline_len])
        if not isinstance(limits, Limits):
            try:
                limits = limits(table.state)
            except ValueError as exc:
                raise TableError(f"holds a source state that does not fit ({exc})") from None
        problem = table._problem(limits)
        if problem is None and table.locators is not None:
            problem = table.locators.problem(table.kind, table.size)
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
