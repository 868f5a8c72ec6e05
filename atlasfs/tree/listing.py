"""A shard folder's listing and lookup index, made from its file table, and the cache
of recently listed folders.

Listings keep no Python object per file whatever a folder's size: names are sliced
from the table's blob a chunk at a time as the kernel asks for them.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from atlasfs.tree.base import Entry
from atlasfs.tree.filetable import DIR, FILE, UNKNOWN_SIZE, FileTable
from atlasfs.tree.placement import shard_ino

#: Row numbers kept for the listings of recently listed sub-folders (4 bytes each; a shard
#: folder without sub-folders is listed from its table as it is and keeps none).
FOLDER_CACHE_ROWS = 1 << 20
#: Children a listing handed out makes at once (FUSE's readdir asks for one at a time).
LISTING_CHUNK = 256


class FileRef(NamedTuple):
    """Where a file's bytes come from: shard position, block, example in block, file of example."""

    shard: int
    block: int
    pos: int
    file: int


#: Named tuples made from a tuple of their fields without a Python call (their own __new__ is one:
#: a third of a big listing's time).
_new_ref = functools.partial(tuple.__new__, FileRef)
_new_entry = functools.partial(tuple.__new__, Entry)


def row_entry(table: FileTable, s: int, i: int, mtime: float) -> Entry:
    """The entry of row ``i`` of shard position ``s``'s table (a file's size as the table knows it)."""
    if table.kind.item(i) == FILE:
        return _new_entry((False, table.size.item(i), mtime, shard_ino(s) + 1 + i,
                           _new_ref((s, table.block.item(i), table.pos.item(i), table.file.item(i)))))
    return _new_entry((table.kind.item(i) == DIR, 0, mtime, shard_ino(s) + 1 + i, None))


def row_entries(table: FileTable, s: int, rows: range | list[int], mtime: float,
                known_only: bool = False) -> list[Entry | None]:
    """The entries of table rows ``rows`` at once (a listing makes one per file). With
    ``known_only``, None for a file whose size the table does not know and for anything
    that is neither a file nor a folder (an unreadable example, whose lookup must fail)."""
    if not len(rows):
        return []
    index: Any = slice(rows.start, rows.stop) if isinstance(rows, range) else np.asarray(rows, dtype=np.intp)
    kinds = table.kind[index]
    sizes = table.size[index]
    base = shard_ino(s) + 1
    inos = range(base + rows.start, base + rows.stop) if isinstance(rows, range) else [base + r for r in rows]
    blocks, positions, files = (column[index].tolist() for column in (table.block, table.pos, table.file))
    if not (kinds != FILE).any() and not (sizes == UNKNOWN_SIZE).any():  # files, all sized: at C speed
        refs = map(_new_ref, zip(itertools.repeat(s), blocks, positions, files))
        return list(map(_new_entry, zip(itertools.repeat(False), sizes.tolist(), itertools.repeat(mtime), inos,
                                        refs)))
    new = tuple.__new__
    result: list[Entry | None] = []
    for ino, kind, size, block, pos, file in zip(inos, kinds.tolist(), sizes.tolist(), blocks, positions, files):
        if kind == FILE:
            result.append(None if known_only and size == UNKNOWN_SIZE else
                          new(Entry, (False, size, mtime, ino, new(FileRef, (s, block, pos, file)))))
        elif kind == DIR or not known_only:
            result.append(new(Entry, (kind == DIR, 0, mtime, ino, None)))
        else:
            result.append(None)
    return result


def _view(array: np.ndarray, code: str) -> memoryview:
    """A memoryview of ``array`` with the native format ``code`` (a stored table's arrays
    say ``=Q``, which memoryviews do not index)."""
    return memoryview(np.ascontiguousarray(array)).cast("B").cast(code)


class Listing(Sequence[tuple[str, bool, int]]):
    """A folder's ``(name, is_dir, ino)`` children, made from its shard's file table when
    asked, a chunk at a time: a listing keeps no Python object per file, whatever the
    folder's size. The kernel asks for a folder's listing in replies of a few hundred
    entries each, and again on every pass of ``tar``, ``find`` or ``ls``; FUSE's readdir
    then takes the children one at a time, so the chunk around the last one asked for
    is kept (:data:`LISTING_CHUNK` children) for the next.

    The tree keeps one per recently listed folder and hands out a :meth:`view` of it to
    each caller, with a chunk of its own; both are immutable sequences (the table's names
    and kinds never change).
    """

    __slots__ = ("_base", "_chunk", "_n", "_rows", "_skip", "_table", "shard")

    def __init__(self, table: FileTable, shard: int, rows: np.ndarray | None, skip: int) -> None:
        self._table = table
        self.shard = shard
        self._rows = rows  # the children's table rows; None: every row, in order (a flat shard folder)
        self._skip = skip  # bytes of the folder's path and slash, before each child's name
        self._base = shard_ino(shard) + 1
        self._n = len(table) if rows is None else len(rows)
        self._chunk: tuple[int, list[tuple[str, bool, int]]] = (0, [])

    def view(self) -> "Listing":
        """The same listing, with a chunk of its own (only the caller's thread fills it)."""
        other = Listing.__new__(Listing)
        for name in ("_base", "_n", "_rows", "_skip", "_table", "shard"):
            setattr(other, name, getattr(self, name))
        other._chunk = (0, [])
        return other

    def __len__(self) -> int:
        return self._n

    @property
    def cost(self) -> int:
        """What the listing counts against :data:`FOLDER_CACHE_ROWS`."""
        return 1 + (len(self._rows) if self._rows is not None else 0)

    def rows(self, start: int, stop: int) -> range | list[int]:
        """The table rows of children ``start:stop`` (within bounds)."""
        return range(start, stop) if self._rows is None else self._rows[start:stop].tolist()

    def __getitem__(self, index: Any) -> Any:
        if type(index) is int:  # FUSE's readdir takes one child at a time, in order
            first, chunk = self._chunk
            if 0 <= index - first < len(chunk):
                return chunk[index - first]
            if 0 <= index < self._n:
                chunk = self._slice(index, min(index + LISTING_CHUNK, self._n))
                self._chunk = (index, chunk)
                return chunk[0]
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            return self._slice(start, max(start, stop))
        i = operator.index(index)
        if not -self._n <= i < self._n:
            raise IndexError("listing index out of range")
        return self._slice(i % self._n, i % self._n + 1)[0]

    def _slice(self, start: int, stop: int) -> list[tuple[str, bool, int]]:
        table = self._table
        names = table._names  # the table's own blob: one slice and decode per name, nothing kept
        skip = self._skip
        if self._rows is None:
            bounds = table._offsets[start:stop + 1].tolist()
            starts, ends = bounds[:-1], bounds[1:]
            rows: range | np.ndarray = range(start, stop)
        else:
            rows = self._rows[start:stop]
            starts, ends = table._offsets[rows].tolist(), table._offsets[rows + 1].tolist()
        if not starts:
            return []
        first, last = starts[0] + skip, ends[-1]
        text = names[first:last].decode("utf-8")
        if len(text) == last - first and self._rows is None:  # ASCII: slice the text where the bytes are
            listed = [text[a - first:b - first] for a, b in zip(starts, ends)]
        else:
            listed = [names[a + skip:b].decode("utf-8") for a, b in zip(starts, ends)]
        # a flat shard folder (no rows of its own) has no sub-folders
        dirs = itertools.repeat(False) if self._rows is None else (table.kind[rows] == DIR).tolist()
        base = self._base
        inos = range(base + start, base + stop) if self._rows is None else [base + row for row in rows.tolist()]
        return list(zip(listed, dirs, inos))

    def __iter__(self) -> Iterator[tuple[str, bool, int]]:
        for start in range(0, self._n, LISTING_CHUNK):
            yield from self._slice(start, min(start + LISTING_CHUNK, self._n))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)) or len(other) != self._n:
            return False
        return other is self or list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<listing of {self._n} entries of shard {self.shard}>"


class PathIndex:
    """A table's rows by the hash of their path, for lookups: a binary search and a
    comparison, in 12 bytes a file (a dict of paths would hold ~150 bytes of Python
    objects a file). Hashes are Python's, so the index is built in each process."""

    __slots__ = ("_hashes", "_names", "_offsets", "_rows")

    def __init__(self, table: FileTable) -> None:
        names = table._names
        bounds = table._offsets.tolist()
        hashes = np.fromiter((hash(names[a:b]) for a, b in zip(bounds, bounds[1:])), dtype=np.int64,
                             count=len(table))
        order = np.argsort(hashes, kind="stable")
        # memoryviews: indexed from Python they give ints at C speed (numpy's scalars cost more)
        self._hashes = _view(hashes[order], "q")
        self._rows = _view(order.astype(np.uint32), "I")
        self._names = names
        self._offsets = _view(table._offsets.astype(np.uint64, copy=False), "Q")

    def find(self, path: bytes) -> int | None:
        """The row of ``path`` (relative to the shard folder), or None."""
        wanted = hash(path)
        hashes = self._hashes
        j = bisect_left(hashes, wanted)
        while j < len(hashes) and hashes[j] == wanted:  # more than once only if two paths' hashes collide
            row = self._rows[j]
            if self._names[self._offsets[row]:self._offsets[row + 1]] == path:
                return row
            j += 1
        return None


class FolderCache:
    """Listings of recently listed folders, least recently listed first: the kernel asks
    for a big folder in many replies, and tar and find list every folder on every pass.
    A flat shard folder's costs nothing; a sub-folder's keeps its rows, at most
    :data:`FOLDER_CACHE_ROWS` in all."""

    def __init__(self) -> None:
        self.listings: OrderedDict[tuple[int, str], Listing] = OrderedDict()
        self.rows = 0
        self._lock = threading.Lock()

    def get(self, s: int, folder: str) -> Listing | None:
        """A view of the remembered listing of ``folder`` of shard ``s``, or None."""
        with self._lock:
            listing = self.listings.get((s, folder))
            if listing is None:
                return None
            self.listings.move_to_end((s, folder))
            return listing.view()

    def forget(self, s: int) -> None:
        """Drop the listings of shard ``s`` (they hold its table)."""
        with self._lock:
            for key in [key for key in self.listings if key[0] == s]:
                self.rows -= self.listings.pop(key).cost

    def remember(self, s: int, folder: str, listing: Listing) -> None:
        """Keep ``listing``, evicting the least recently listed past the bound."""
        cost = listing.cost
        if cost > FOLDER_CACHE_ROWS:
            return
        with self._lock:
            old = self.listings.pop((s, folder), None)
            self.rows -= old.cost if old is not None else 0
            self.listings[(s, folder)] = listing
            self.rows += cost
            while self.rows > FOLDER_CACHE_ROWS:
                _, evicted = self.listings.popitem(last=False)
                self.rows -= evicted.cost
