"""A shard folder's listing, made from its file table, and the cache of recently listed
folders. (Lookups go through the table's own index: :meth:`FileTable.find`.)

Listings keep no Python object per file whatever a folder's size: names are sliced
from the table's blob a chunk at a time as the kernel asks for them.
"""

from __future__ import annotations

import functools
import itertools
import operator
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from atlasfs.tree.base import Entry
from atlasfs.tree.table.filetable import FileTable
from atlasfs.tree.table.layout import DIR, FILE, UNKNOWN_SIZE, shard_ino

#: Row numbers kept for the listings of recently listed sub-folders (4 bytes each; a shard
#: folder without sub-folders is listed from its table as it is and keeps none).
FOLDER_CACHE_ROWS = 1 << 20
#: Listings remembered at most (each ~200 bytes, whatever its size: a flat shard folder's
#: costs only its object).
FOLDER_CACHE_LISTINGS = 1 << 14
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


class Listing(Sequence[tuple[str, bool, int]]):
    """A folder's ``(name, is_dir, ino)`` children, made from its shard's file table when
    asked, a chunk at a time: a listing keeps no Python object per file, whatever the
    folder's size. The kernel asks for a folder's listing in replies of a few hundred
    entries each, and again on every pass of ``tar``, ``find`` or ``ls``; FUSE's readdir
    then takes the children one at a time, so the chunk around the last one asked for
    is kept (:data:`LISTING_CHUNK` children) for the next.

    The tree keeps one per recently listed folder and hands out a :meth:`view` of it to
    each caller, with a chunk of its own; both are immutable sequences (the table's names
    and kinds never change). A listing holds no table: it asks ``table_of`` for its
    shard's table at each chunk, so that a table let go (unmapped) is not kept by it.
    """

    __slots__ = ("_base", "_chunk", "_n", "_rows", "_skip", "_table_of", "shard")

    def __init__(self, table_of: Callable[[int], FileTable], shard: int, n: int, rows: np.ndarray | None,
                 skip: int) -> None:
        self._table_of = table_of
        self.shard = shard
        self._rows = rows  # the children's table rows; None: every row, in order (a flat shard folder)
        self._skip = skip  # bytes of the folder's path and slash, before each child's name
        self._base = shard_ino(shard) + 1
        self._n = n
        self._chunk: tuple[int, list[tuple[str, bool, int]]] = (0, [])

    def view(self) -> "Listing":
        """The same listing, with a chunk of its own (only the caller's thread fills it)."""
        other = Listing.__new__(Listing)
        for name in ("_base", "_n", "_rows", "_skip", "_table_of", "shard"):
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
        table = self._table_of(self.shard)
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


class FolderCache:
    """Listings of recently listed folders, least recently listed first: the kernel asks
    for a big folder in many replies, and tar and find list every folder on every pass.
    A flat shard folder's costs its object only; a sub-folder's keeps its rows, at most
    :data:`FOLDER_CACHE_ROWS` in all; at most :data:`FOLDER_CACHE_LISTINGS` listings. No
    listing holds its table (they are mapped, and let go, by :class:`atlasfs.tree.table.tables.Tables`)."""

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
            while self.rows > FOLDER_CACHE_ROWS or len(self.listings) > FOLDER_CACHE_LISTINGS:
                _, evicted = self.listings.popitem(last=False)
                self.rows -= evicted.cost
