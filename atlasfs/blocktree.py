"""The tree of any source: one folder per shard, WebDataset-style files inside.

A :class:`~atlasfs.sources.source.Source` (an Atlas dataset, Dolma documents,
Lavender shardsets, ``.pbin`` files) gives shards of blocks of samples; this
module makes them a :class:`~atlasfs.tree.Tree` and knows nothing of any
format. Shard names may hold slashes (a Dolma documents file in a sub-folder):
the folders above such shards are made from their names.

Files are named and encoded by :mod:`atlasfs.naming`. A shard's file table
(names, sizes, block and position of every file) is loaded from the table
store, or built the first time the shard is looked into by decoding its
blocks once and naming their examples (and then stored, with what the
source learned by its pass over the shard's files, if it needed one). A
source whose own index tells its files' sizes names them without decoding
(:meth:`~atlasfs.sources.source.SourceShard.describe_block`). Naming needs no
encoding, so a fresh table knows only the sizes of raw bytes fields; the
others are filled in when their files are first looked up (which encodes
their example, as reading it would), and the table is stored again once it
knows them all. A listing needs no sizes. File bytes come from a cache of
decoded blocks bounded in bytes; a block's examples are encoded as files one
at a time, when first needed, and kept with it. Evicted blocks are decoded again.
Readers that go through a shard in order get its next blocks decoded and
encoded ahead of them, on a background thread (:mod:`atlasfs.readahead`).

A random reader need not pay for a whole block to read one file (issue #18).
While a table is built from a decoded block, the source may say where each
file's bytes can be had without decoding it
(:meth:`~atlasfs.sources.source.SourceShard.file_spans`: an Atlas file's run
in the decompressed block, or a small file's bytes themselves); the table keeps
those locators. A read of a file whose block is not cached, by a reader not
going through the shard in order, asks the source for the bytes there
(:meth:`~atlasfs.sources.source.SourceShard.read_span`), which checks them;
anything else, or a check that fails (logged once per block), takes the block
path. Either way the bytes are those the block path gives.

A block that cannot be decoded is logged once; its examples appear as
``<index key>.unreadable`` entries whose lookups and reads fail with EIO,
while everything else keeps serving. A shard that cannot even be opened
(its ``error`` is set, or its pass over its files fails) is a folder whose
listing fails with EIO. Either raises :class:`~atlasfs.tree.Unreadable`, whose
``cause`` lets the tar view and the commands that use the tree (``export``,
``index``) leave that shard out and say why in their own words.
"""

from __future__ import annotations

import errno
import functools
import itertools
import logging
import operator
import os
import sys
import threading
import time
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from . import memory
from .blockcache import BlockCache
from .errors import AtlasFormatError
from .storage import StorageUnavailableError
from .filetable import DIR, FILE, UNKNOWN_SIZE, UNREADABLE, FileTable, Limits
from .naming import LAYOUT_VERSION, MAX_NAME_BYTES, NO_KEY, KeyAssigner, declared_key, encode_as, example_fields
from .readahead import ReadAhead
from .sources.source import Source, SourceShard, SpanMismatch
from .tablestore import TableStore
from .tree import Entry, Tree, Unreadable, not_found, split_path

log = logging.getLogger("atlasfs")

#: Row numbers kept for the listings of recently listed sub-folders (4 bytes each; a shard
#: folder without sub-folders is listed from its table as it is and keeps none).
FOLDER_CACHE_ROWS = 1 << 20
#: Children a listing handed out makes at once (FUSE's readdir asks for one at a time).
LISTING_CHUNK = 256
#: Entries of recently looked up files kept for the reads that follow (each ~350 bytes).
RECENT_ENTRIES = 4096
#: Blocks decoded, and their examples encoded, ahead of a reader going through a shard in order...
READ_AHEAD_BLOCKS = 2
#: ...once it has used this many blocks in a row (starting at a shard's first block counts as
#: one more: readers that start there usually go through). Random readers land on the block
#: after the one before now and then, but seldom twice running.
READ_AHEAD_AFTER = 3
#: Blocks stored in more than this share of the cache bound are not read ahead: decoded, two
#: of them could push out the block being read.
READ_AHEAD_MAX_SHARE = 16
#: Bytes of decoded blocks cached by default (256 MiB).
DEFAULT_CACHE_BYTES = 256 << 20
#: Files whose entries :meth:`BlockTree.members` makes at once (bounds the blocks it sizes ahead of use).
MEMBERS_BATCH = 1024
#: Blocks decoded at once (by the readers' threads and read-ahead together).
DECODERS = 2
#: The freed memory is given back to the system once blocks costing half the cache bound,
#: and at least this much, have been evicted since the last time (and at most twice a second).
TRIM_AFTER_MIN = 4 << 20
#: Problems of a shard's pass over its files logged one by one (a file of bad lines would flood the log).
LOGGED_PROBLEMS = 10
#: Suffix of the entries standing for examples of a block that cannot be decoded.
UNREADABLE_SUFFIX = "unreadable"
#: Bytes of recently located files kept for the read requests that follow the first (a
#: file larger than one request, read without its block, is located once, not per request).
LOCATED_KEEP_BYTES = 8 << 20


class Block:
    """A decoded block in the cache: its examples, their files as named when the
    block's file table rows were built (if it was decoded for that), and each
    example's file bytes once encoded (in the order of :func:`~atlasfs.naming.example_fields`)."""

    __slots__ = ("encoded", "encoded_bytes", "examples", "fields")

    def __init__(self, examples: list[Any]) -> None:
        self.examples = examples
        self.fields: list[list[tuple[str, Any]]] | None = None  # saves naming them again to encode them
        self.encoded: list[tuple[bytes, ...] | None] = [None] * len(examples)
        self.encoded_bytes = 0  # bytes of the files encoded so far


def _view(array: np.ndarray, code: str) -> memoryview:
    """A memoryview of ``array`` with the native format ``code`` (a stored table's arrays
    say ``=Q``, which memoryviews do not index)."""
    return memoryview(np.ascontiguousarray(array)).cast("B").cast(code)


class _Listing(Sequence[tuple[str, bool, int]]):
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
        self._base = _shard_ino(shard) + 1
        self._n = len(table) if rows is None else len(rows)
        self._chunk: tuple[int, list[tuple[str, bool, int]]] = (0, [])

    def view(self) -> "_Listing":
        """The same listing, with a chunk of its own (only the caller's thread fills it)."""
        other = _Listing.__new__(_Listing)
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


class _PathIndex:
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


class _Unsized:
    """What it takes to size a table's files: its rows grouped by block, the count
    still unknown, and the key to store it under once complete (None: not stored)."""

    def __init__(self, table: FileTable, blocks: int, key: dict[str, Any] | None) -> None:
        self._order = np.argsort(table.block, kind="stable").astype(np.uint32)  # 4 bytes a file
        self._bounds = np.searchsorted(table.block[self._order], np.arange(blocks + 1))
        self.left = int(np.count_nonzero(table.size == UNKNOWN_SIZE))
        self.key = key

    def rows_of(self, block: int) -> np.ndarray:
        """The table rows of block ``block`` (files of unreadable blocks and folders included)."""
        return self._order[self._bounds.item(block):self._bounds.item(block + 1)].astype(np.intp)


class _Scratch:
    """A block's :class:`~atlasfs.sources.source.Scratch`: a value kept in the tree's block
    cache under ``(shard, block, "scratch")``, charged its length (so that located reads'
    scratch and decoded blocks share the one bound)."""

    __slots__ = ("_cache", "_key")

    def __init__(self, cache: BlockCache[Any], key: tuple[int, int, str]) -> None:
        self._cache = cache
        self._key = key

    def get(self) -> bytes | None:
        return self._cache.peek(self._key)

    def put(self, value: bytes) -> None:
        self._cache.put(self._key, value, len(value) + 100)


class FileRef(NamedTuple):
    """Where a file's bytes come from: shard position, block, example in block, file of example."""

    shard: int
    block: int
    pos: int
    file: int


def _distinct(values: np.ndarray) -> list[int]:
    """The distinct values, ascending. (np.unique would import numpy.ma on first use:
    10-20 ms of a daemon's first listing.)"""
    return sorted(set(values.tolist()))


#: Named tuples made from a tuple of their fields without a Python call (their own __new__ is one).
_new_ref = functools.partial(tuple.__new__, FileRef)
_new_entry = functools.partial(tuple.__new__, Entry)


#: Examples of a block whose objects :func:`_held_estimate` sizes (spread over the block).
HELD_SAMPLES = 4
#: What a scalar inside a list or tuple of scalars of one type holds (its own object; the
#: list's pointer to it is in the list's size). Small ints and True/False/None are shared.
_SCALAR_BYTES = {float: 24, int: 28, bool: 0, type(None): 0}


def _held_bytes(value: Any) -> int:
    """About the memory the objects of a decoded ``value`` hold (shared objects counted each
    time they are met: an overestimate). Lists of scalars of one type are sized at once."""
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is dict:
            total += sys.getsizeof(item)
            stack.extend(item.keys())
            stack.extend(item.values())
        elif kind is list or kind is tuple:
            total += sys.getsizeof(item)
            kinds = set(map(type, item))
            scalar = _SCALAR_BYTES.get(kinds.pop()) if len(kinds) == 1 else None
            if scalar is not None:
                total += scalar * len(item)
            else:
                stack.extend(item)
        elif kind is np.ndarray and item.base is not None:  # a view: its buffer belongs to its base
            total += 112 + item.nbytes
        else:  # str, bytes, scalars, arrays owning their data (getsizeof counts it), anything else
            total += sys.getsizeof(item)
    return total


def _held_estimate(examples: list[Any]) -> int:
    """About the memory a block's examples hold, from :data:`HELD_SAMPLES` of them (the
    examples of a block are alike: within 4% of tracemalloc's count on the bench's sets)."""
    if not examples:
        return 0
    sample = examples[::max(1, len(examples) // HELD_SAMPLES)][:HELD_SAMPLES]
    return sys.getsizeof(examples) + sum(map(_held_bytes, sample)) * len(examples) // len(sample)


_unavailable_logged = [0.0]


def _log_unavailable(exc: StorageUnavailableError) -> None:
    """Log a store that does not answer, at most once every 10 seconds (an outage fails
    every read; one line says it)."""
    now = time.monotonic()
    if now - _unavailable_logged[0] >= 10:
        _unavailable_logged[0] = now
        log.error("%s (reads fail with EIO until it answers; nothing is remembered as broken)", exc)


def _eio(message: str) -> OSError:
    return Unreadable(message)


def _max_suffix_bytes(shard: SourceShard) -> int:
    """Longest field suffix a shard's files may have: it must fit beside the shortest key, the index key."""
    return MAX_NAME_BYTES - 1 - shard.key_width


def _shard_ino(s: int) -> int:
    """The inode number of shard position ``s``'s folder; row ``i`` of its table is this + 1 + i."""
    return (s + 1) << 32


class BlockTree(Tree):
    """A :class:`Tree` over an open :class:`~atlasfs.sources.source.Source`.

    ``store`` keeps shard file tables between runs (None: build them every time).
    Each shard or block that fails is logged once, in a mount's words (its files fail
    with EIO), shards that could not be opened at once; a command that says itself
    what each :class:`~atlasfs.tree.Unreadable` it meets means for it (``export``)
    passes ``log_failures=False``.
    """

    def __init__(self, source: Source, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 store: TableStore | None = None, log_failures: bool = True) -> None:
        self.source = source
        self.log_failures = log_failures
        self.shards: list[SourceShard] = list(source.shards)
        self.cache: BlockCache[Block] = BlockCache(cache_bytes)
        self.store = store
        self._shard_by_name: dict[str, int] = {}
        # Folders above shards named with slashes: path -> its children's names, in shard order.
        self._above: dict[str, list[str]] = {"": []}
        self._place_shards()
        self._tables: dict[int, FileTable] = {}
        self._table_locks = [threading.Lock() for _ in self.shards]
        self._failed: dict[tuple[int, int], str] = {}
        self._failed_lock = threading.Lock()
        # Tables that do not know every size yet.
        self._unsized: dict[int, _Unsized] = {}
        # Each looked-into shard's lookup index (built at its first lookup).
        self._indexes: dict[int, _PathIndex] = {}
        # Listings of recently listed folders, least recently listed first: the kernel
        # asks for a big folder in many replies, and tar and find list every folder on
        # every pass. A flat shard folder's costs nothing; a sub-folder's keeps its rows.
        self._folders: OrderedDict[tuple[int, str], _Listing] = OrderedDict()
        self._folder_rows = 0
        self._folders_lock = threading.Lock()
        # Entries of recently looked-up files: the kernel looks a file up, then reads it
        # (and each read request names the file again). Emptied when full.
        self._recent: dict[str, Entry] = {}
        # The last block each shard's readers used, and how many blocks in order led
        # there (see READ_AHEAD_AFTER).
        self._last_block = [(-1, 1)] * len(self.shards)
        self.readahead = ReadAhead(self._read_ahead) if cache_bytes > 0 else None
        # Blocks whose located reads failed their source's check: read through the block
        # from then on (logged once each).
        self._unlocated: set[tuple[int, int]] = set()
        # Recently located files larger than the request that located them: inode -> bytes.
        self._located: OrderedDict[int, bytes] = OrderedDict()
        self._located_bytes = 0
        self._located_lock = threading.Lock()
        #: Whether random reads of files whose blocks are not cached go through their
        #: locators (tests of the block path turn it off).
        self.locate = True
        #: Reads served through a locator, and located reads that fell back to the block (for
        #: tests and benchmarks; threads may race on them: approximate).
        self.located_reads = 0
        self.located_fallbacks = 0
        # A block being decoded is not in the cache yet: its compressed bytes, its pickle
        # and its objects, about three times its size. Every thread of a mount could be
        # decoding one; this many at once keep both cores busy and bound that memory.
        self._decoders = threading.BoundedSemaphore(DECODERS)
        # Evicted bytes when the freed memory was last given back, and how many more call for it.
        self._trimmed_at = 0
        self._trim_after = max(TRIM_AFTER_MIN, cache_bytes // 2)
        self._root = Entry(True, 0, source.mtime, 1)
        self._shard_entries = [Entry(True, 0, shard.mtime, _shard_ino(s)) for s, shard in enumerate(self.shards)]
        # Folders above shards: inode numbers below any shard's (which start at 1 << 32).
        self._above_entries = {path: Entry(True, 0, source.mtime, 2 + i)
                               for i, path in enumerate(p for p in self._above if p)}
        for s, shard in enumerate(self.shards):  # said now: a mount's user sees it when mounting
            if shard.error is not None:
                self._fail(s, -1, str(shard.error))

    def _place_shards(self) -> None:
        """Map shard names to positions and make the folders above shards named with
        slashes. A shard whose name is also such a folder, or repeats another's, or is
        not a safe path, is left out with one log line: no name may hide another."""
        folders = set()  # every folder above a shard
        for shard in self.shards:
            parts = shard.name.split("/")
            folders.update("/".join(parts[:k]) for k in range(1, len(parts)))
        for s, shard in enumerate(self.shards):
            parts = shard.name.split("/")
            problem = None
            if any(part in ("", ".", "..") or len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
                   for part in parts):
                problem = "is not a safe folder path"
            elif shard.name in self._shard_by_name:
                problem = "repeats another shard's name"
            elif shard.name in folders:
                problem = "is also the folder of other shards"
            if problem:
                log.error("%s: its folder %r %s; it is left out", shard.path, shard.name, problem)
                continue
            self._shard_by_name[shard.name] = s
            for k in range(1, len(parts) + 1):
                parent, child = "/".join(parts[:k - 1]), "/".join(parts[:k])
                children = self._above.setdefault(parent, [])
                if parts[k - 1] not in children:
                    children.append(parts[k - 1])
                if k < len(parts):
                    self._above.setdefault(child, [])

    def _split(self, path: str) -> tuple[int | None, str, str]:
        """``(shard position, path inside its folder, folder above shards)`` of a tree path:
        the position None if the path is the root or a folder above shards (named by the
        third item); raises ENOENT if there is no such shard."""
        if path.startswith("/") and "//" not in path and not path.endswith("/"):  # as the kernel asks
            shard, _, rest = path[1:].partition("/")
        else:
            parts = split_path(path)
            shard, rest = (parts[0], "/".join(parts[1:])) if parts else ("", "")
        if not shard:
            return None, "", ""
        s = self._shard_by_name.get(shard)
        if s is not None:
            return s, rest, ""
        while shard in self._above:  # a folder above shards: go down its path
            if not rest:
                return None, "", shard
            head, _, rest = rest.partition("/")
            shard = f"{shard}/{head}"
            s = self._shard_by_name.get(shard)
            if s is not None:
                return s, rest, ""
        raise not_found(path)

    # -- the Tree interface

    def lookup(self, path: str) -> Entry:
        entry = self._recent.get(path)
        if entry is not None:
            return entry
        s, rest, above = self._split(path)
        if s is None:
            return self._above_entries[above] if above else self._root
        if not rest:
            return self._shard_entries[s]
        table = self._tables.get(s)
        if table is None:
            table = self.table(s)
        try:
            i = self._index(s, table).find(rest.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: no name in a table has one
            i = None
        if i is None:
            raise not_found(path)
        kind = table.kind.item(i)
        if kind == UNREADABLE:
            raise _eio(self._failure(s, table.block.item(i)))
        if kind == FILE:
            if table.size.item(i) == UNKNOWN_SIZE and not self._size_located(s, table, i):
                self._fill_sizes(s, table, [i])
            entry = _new_entry((False, table.size.item(i), self._shard_entries[s].mtime, _shard_ino(s) + 1 + i,
                                _new_ref((s, table.block.item(i), table.pos.item(i), table.file.item(i)))))
        else:
            entry = _new_entry((True, 0, self._shard_entries[s].mtime, _shard_ino(s) + 1 + i, None))
        recent = self._recent
        if len(recent) >= RECENT_ENTRIES:  # cheaper than keeping an order, and as good for lookup-then-read
            recent.clear()
        recent[path] = entry
        return entry

    def _index(self, s: int, table: FileTable) -> _PathIndex:
        index = self._indexes.get(s)
        if index is None:
            with self._table_locks[s]:
                index = self._indexes.get(s)
                if index is None:
                    index = self._indexes[s] = _PathIndex(table)
        return index

    def listdir(self, path: str) -> list[tuple[str, Entry]]:
        s, folder = self._folder_of(path)
        if s is None:
            return self._list_above(folder)
        table = self.table(s)
        children = table.children(folder)
        return list(zip([name for name, _ in children], self._entries(s, table, [i for _, i in children])))

    def _list_above(self, folder: str) -> list[tuple[str, Entry]]:
        """The children of the root or of a folder above shards: shards and such folders."""
        prefix = f"{folder}/" if folder else ""
        children = []
        for name in self._above[folder]:
            path = prefix + name
            s = self._shard_by_name.get(path)
            children.append((name, self._shard_entries[s] if s is not None else self._above_entries[path]))
        return children

    def names(self, path: str) -> Sequence[tuple[str, bool, int]]:
        s, folder = self._folder_of(path)
        if s is None:
            return super().names(path)
        with self._folders_lock:
            listing = self._folders.get((s, folder))
            if listing is not None:
                self._folders.move_to_end((s, folder))
                return listing.view()
        table = self.table(s)
        if not folder and b"/" not in table._names:  # a flat shard folder: its table as it is
            listing = _Listing(table, s, None, 0)
        else:
            rows = np.array([i for _, i in table.children(folder)], dtype=np.uint32)
            listing = _Listing(table, s, rows, len(folder.encode("utf-8")) + 1 if folder else 0)
        self._remember_folder(s, folder, listing)
        return listing.view()

    def known_entries(self, path: str, start: int = 0, stop: int | None = None) -> Sequence[Entry | None]:
        listing = self.names(path)
        if not isinstance(listing, _Listing):  # the root, or a folder above shards
            return super().known_entries(path, start, stop)
        start, stop, _ = slice(start, stop).indices(len(listing))
        rows = listing.rows(start, max(start, stop))
        if not len(rows):
            return []
        # Entries of the rows whose sizes the table knows (a stored table, or files
        # looked up since); not of unreadable files, whose lookups must fail.
        s = listing.shard
        table = self.table(s)
        index = np.asarray(rows, dtype=np.intp) if not isinstance(rows, range) else slice(rows.start, rows.stop)
        kinds = table.kind[index]
        sizes = table.size[index]
        base = _shard_ino(s) + 1
        inos = range(base + start, base + stop) if isinstance(rows, range) else [base + r for r in rows]
        mtime = self._shard_entries[s].mtime
        blocks, positions, files = (column[index].tolist() for column in (table.block, table.pos, table.file))
        if not (kinds != FILE).any() and not (sizes == UNKNOWN_SIZE).any():  # files, all sized: at C speed
            refs = map(_new_ref, zip(itertools.repeat(s), blocks, positions, files))
            return list(map(_new_entry, zip(itertools.repeat(False), sizes.tolist(), itertools.repeat(mtime), inos,
                                            refs)))
        new = tuple.__new__  # a named tuple's own __new__ is a Python call
        result: list[Entry | None] = []
        for ino, kind, size, block, pos, file in zip(inos, kinds.tolist(), sizes.tolist(), blocks, positions, files):
            if kind == FILE:
                result.append(None if size == UNKNOWN_SIZE else
                              new(Entry, (False, size, mtime, ino, new(FileRef, (s, block, pos, file)))))
            else:
                result.append(new(Entry, (True, 0, mtime, ino, None)) if kind == DIR else None)
        return result

    def _folder_of(self, path: str) -> tuple[int | None, str]:
        """(shard position, folder inside it) of the folder ``path``; (None, folder above
        shards, "" for the root) if it is not inside a shard."""
        if not self.lookup(path).is_dir:
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        s, rest, above = self._split(path)
        return (s, rest) if s is not None else (None, above)

    def _remember_folder(self, s: int, folder: str, listing: _Listing) -> None:
        cost = listing.cost
        if cost > FOLDER_CACHE_ROWS:
            return
        with self._folders_lock:
            old = self._folders.pop((s, folder), None)
            self._folder_rows -= old.cost if old is not None else 0
            self._folders[(s, folder)] = listing
            self._folder_rows += cost
            while self._folder_rows > FOLDER_CACHE_ROWS:
                _, evicted = self._folders.popitem(last=False)
                self._folder_rows -= evicted.cost

    def members(self, path: str) -> Iterator[tuple[str, Entry]]:
        s, folder = self._folder_of(path)
        if s is None:
            yield from super().members(path)
            return
        table = self.table(s)
        prefix = f"{folder}/" if folder else ""
        rows = [i for i in table.example_order() if table.row(i).path.startswith(prefix)] if prefix else \
            table.example_order()
        for start in range(0, len(rows), MEMBERS_BATCH):  # entries a batch at a time: sizing encodes their blocks
            batch = rows[start:start + MEMBERS_BATCH]
            for i in batch:
                if table.kind[i] == UNREADABLE:
                    raise _eio(self._failure(s, int(table.block[i])))
            for i, entry in zip(batch, self._entries(s, table, batch)):
                yield table.row(i).path[len(prefix):], entry

    def read(self, entry: Entry, offset: int, size: int) -> bytes:
        ref = entry.ref
        if ref is None:
            raise OSError(errno.EISDIR, os.strerror(errno.EISDIR))
        if (ref.shard, ref.block) not in self.cache:
            data = self._located_read(entry, ref, offset, size)
            if data is not None:
                return data[offset:offset + size]
        files = self.encoded_example(ref.shard, ref.block, ref.pos)
        if ref.file >= len(files) or len(files[ref.file]) != entry.size:
            # only if the dataset changed under us, or a stored table lies
            raise self._mismatch(ref.shard, ref.block)
        return files[ref.file][offset:offset + size]

    def _located_read(self, entry: Entry, ref: FileRef, offset: int, size: int) -> bytes | None:
        """The whole file through its locator (its block is not cached), or None: no
        locator, a reader going through the shard in order (it keeps the block path and
        its read-ahead), or a check that failed (then logged once for the block)."""
        if offset:  # a later request of a big file located by its first one
            with self._located_lock:
                kept = self._located.get(entry.ino)
            if kept is not None:
                if offset + size >= len(kept):
                    self._forget_located(entry.ino)
                return kept
            return None  # its first request did not keep it: the block serves the rest
        if size < entry.size and entry.size > LOCATED_KEEP_BYTES // 4:
            return None  # too big to keep for its next requests: each would read it whole again
        s, block = ref.shard, ref.block
        last, run = self._last_block[s]
        # In order: the reader came from the block before this one's (or this one) and from
        # the one before that. A random reader lands next to its last block now and then
        # (1 in 15 on a shard of 30 blocks) but seldom twice running; each time it would
        # pay a whole block. A reader in order pays one located read per shard at most.
        if (run >= 2 and (block == last or block == last + 1)) or (s, block) in self._unlocated:
            return None
        if not self.locate or (s, block) in self._failed:  # a block known to fail fails all its files
            return None
        table = self._tables.get(s)
        if table is None or table.locators is None:
            return None
        row = entry.ino - _shard_ino(s) - 1
        if not 0 <= row < len(table) or table.block.item(row) != block:
            return None
        locator = table.locator(row)
        if locator is None or locator.size != entry.size:
            return None
        self._reading(s, block)
        shard = self.shards[s]
        try:
            data = shard.read_span(block, locator, entry.size, _Scratch(self.cache, (s, block, "scratch")))
            if data is None:  # the source would rather have the block decoded
                return None
            if len(data) != entry.size:
                raise SpanMismatch(f"{shard.block_where(block)}: a located read gave {len(data)} bytes "
                                   f"for a file of {entry.size}")
        except Exception as exc:  # the block path decides: it serves, or fails with EIO and says why
            if isinstance(exc, StorageUnavailableError):  # transient, not remembered; the block path would
                _log_unavailable(exc)                      # wait for the same store again: EIO now
                raise
            self.located_fallbacks += 1
            if (s, block) not in self._unlocated:
                self._unlocated.add((s, block))
                log.warning("%s; its files are read through the block from now on",
                            exc if isinstance(exc, AtlasFormatError) else f"{shard.block_where(block)}: {exc!r}")
            return None
        self.located_reads += 1
        if offset + size < len(data) and len(data) <= LOCATED_KEEP_BYTES // 4:
            self._keep_located(entry.ino, data)
        return data

    def _keep_located(self, ino: int, data: bytes) -> None:
        with self._located_lock:
            if ino in self._located:
                return
            self._located[ino] = data
            self._located_bytes += len(data)
            while self._located_bytes > LOCATED_KEEP_BYTES:
                _, old = self._located.popitem(last=False)
                self._located_bytes -= len(old)

    def _forget_located(self, ino: int) -> None:
        with self._located_lock:
            old = self._located.pop(ino, None)
            if old is not None:
                self._located_bytes -= len(old)

    def total_bytes(self) -> int:
        return sum(shard.data_size for shard in self.shards)

    def _entries(self, s: int, table: FileTable, indices: list[int]) -> list[Entry]:
        """The entries of table rows ``indices``, at once: a listing makes one per file."""
        if not indices:
            return []
        self._fill_sizes(s, table, indices)
        if len(indices) == 1:  # a lookup
            i = indices[0]
            if table.kind.item(i) == FILE:
                ref = FileRef(s, table.block.item(i), table.pos.item(i), table.file.item(i))
                return [Entry(False, table.size.item(i), self._shard_entries[s].mtime, _shard_ino(s) + 1 + i, ref)]
        lo, hi = min(indices), max(indices) + 1
        kinds, sizes, blocks, positions, files = (column[lo:hi].tolist() for column in (
            table.kind, table.size, table.block, table.pos, table.file))
        mtime = self._shard_entries[s].mtime
        base = _shard_ino(s) + 1
        new = tuple.__new__  # a named tuple's own __new__ is a Python call: a third of a big listing's time
        result = []
        for i in indices:
            j = i - lo
            kind = kinds[j]
            if kind == FILE:
                entry = new(Entry, (False, sizes[j], mtime, base + i, new(FileRef, (s, blocks[j], positions[j], files[j]))))
            else:
                entry = new(Entry, (kind == DIR, 0, mtime, base + i, None))
            result.append(entry)
        return result

    # -- blocks and examples

    def decoded_block(self, s: int, block: int) -> Block:
        """A block through the cache: its decoded examples, and those encoded so far.

        A block that fails to decode raises ``OSError(EIO)`` and is logged
        once; later requests fail the same way without decoding it again.
        """
        failed = self._failed.get((s, block))
        if failed is not None:
            raise _eio(failed)
        decoded = self.cache.get((s, block), lambda: self._decode_block(s, block))
        if self.cache.evicted_bytes - self._trimmed_at >= self._trim_after:
            self._give_back()
        return decoded

    def _give_back(self) -> None:
        """Hand the pages freed by evictions back to the system (:func:`atlasfs.memory.trim`).

        Freed blocks leave holes in the allocator's arenas that later blocks only partly
        fill, one set per arena (each thread of a mount allocates in its own): without
        this a mount with an 8 MiB cache grew to ~2.5 times what it held
        (docs/performance.md, "Memory")."""
        self._trimmed_at = self.cache.evicted_bytes
        memory.trim()

    def _decode_block(self, s: int, block: int) -> tuple[Block, int]:
        shard = self.shards[s]
        try:
            with self._decoders:
                examples, nbytes = shard.decode_block(block)
        except StorageUnavailableError as exc:  # the store, not the block: not remembered, tried again next read
            _log_unavailable(exc)
            raise
        except AtlasFormatError as exc:
            raise self._fail(s, block, str(exc)) from None
        except Exception as exc:  # the source reports what it knows; anything else still only fails this block
            raise self._fail(s, block, f"{shard.block_where(block)}: cannot decode ({exc!r})") from None
        # Charged what its objects hold, when more than its pickle: small objects (a list of
        # floats: 9 bytes a float pickled, 32 held) made the cache hold twice its bound.
        return Block(examples), max(nbytes, _held_estimate(examples))

    def encoded_example(self, s: int, block: int, pos: int) -> tuple[bytes, ...]:
        """The bytes of the files of example ``pos`` of a block.

        Examples are encoded one at a time, when first read, and kept with
        their block: a random read pays for one decode and one encode, not for
        encoding the whole block. The block's cost in the cache grows by the
        bytes its encoded files add (bytes fields are served as they are, at no cost).
        """
        self._reading(s, block)
        return self._example_of(self.decoded_block(s, block), s, block, pos)

    def _reading(self, s: int, block: int) -> None:
        """Note that a reader uses block ``block`` of shard ``s``; once it has gone through
        :data:`READ_AHEAD_AFTER` blocks in order, read the next ones ahead."""
        last, run = self._last_block[s]
        if block == last:
            return
        run = run + 1 if block == last + 1 else 1
        self._last_block[s] = (block, run)  # threads may race here: at worst a hint is missed or repeated
        if run >= READ_AHEAD_AFTER and self.readahead is not None:
            end = min(block + 1 + READ_AHEAD_BLOCKS, self.shards[s].num_blocks)
            self.readahead.hint([(s, b) for b in range(block + 1, end)])

    def _read_ahead(self, key: Any) -> None:
        """Decode block ``key = (shard, block)`` into the cache and encode its examples."""
        s, block = key
        if self.shards[s].stored_block_size(block) * READ_AHEAD_MAX_SHARE > self.cache.max_bytes:
            return
        decoded = self.decoded_block(s, block)
        for pos in range(len(decoded.examples)):
            self._example_of(decoded, s, block, pos)

    def _example_of(self, decoded: Block, s: int, block: int, pos: int) -> tuple[bytes, ...]:
        if pos >= len(decoded.examples):
            raise self._mismatch(s, block)
        encoded = decoded.encoded[pos]
        if encoded is None:
            encoded, cost = self._encode(decoded, s, block, pos)
            decoded.encoded[pos] = encoded  # two threads may both encode it: same result, charged twice at worst
            self.cache.charge((s, block), cost)
        return encoded

    def _encode(self, decoded: Block, s: int, block: int, pos: int) -> tuple[tuple[bytes, ...], int]:
        shard = self.shards[s]
        example = decoded.examples[pos]
        try:
            fields = decoded.fields[pos] if decoded.fields is not None else example_fields(
                example, _max_suffix_bytes(shard))[0]
            files = [(suffix, encode_as(suffix, value)) for suffix, value in fields]
        except Exception as exc:  # an example the encoders cannot handle
            raise self._fail(s, block, f"{shard.block_where(block)}: cannot encode example {pos} ({exc!r})") from None
        decoded.encoded_bytes += sum(len(data) for _, data in files)
        limit = shard.max_block_bytes
        if decoded.encoded_bytes > limit:  # shared references can make files far larger than the pickle
            raise self._fail(s, block, f"{shard.block_where(block)}: its files would take more than {limit} bytes")
        values = example.values() if isinstance(example, dict) else (example,)
        shared = {id(value) for value in values if type(value) is bytes}
        cost = sum(len(data) for _, data in files if id(data) not in shared) + 100 * len(files)
        return tuple(data for _, data in files), cost

    def _fail(self, s: int, block: int, message: str) -> OSError:
        """Remember and log (once) that block ``block`` of shard ``s`` (-1: the whole shard) fails."""
        with self._failed_lock:
            if (s, block) not in self._failed:
                self._failed[(s, block)] = message
                if self.log_failures:
                    what = f"shard {self.shards[s].name} fails" if block < 0 else "its files fail"
                    log.error("%s (%s with EIO)", message, what)
        return _eio(message)

    def failures(self, s: int) -> list[str]:
        """What is known to fail in shard position ``s``, one line each: the whole shard's
        cause, or each failed block's (a block not decoded yet is not known)."""
        with self._failed_lock:
            return [message for (shard, _), message in sorted(self._failed.items()) if shard == s]

    def _mismatch(self, s: int, block: int) -> OSError:
        """The error for a block whose examples are not what the file table says (only if
        the dataset changed under us, or a stored table lies)."""
        return _eio(f"{self.shards[s].block_where(block)}: does not match its file table")

    def _failure(self, s: int, block: int) -> str:
        return self._failed.get((s, block), f"{self.shards[s].block_where(block)} cannot be decoded")

    # -- file tables

    def table(self, s: int, sizes: bool = False) -> FileTable:
        """The file table of shard position ``s``: loaded from the store, or built by
        decoding and naming the shard's blocks (then stored). With ``sizes``, every
        size it does not know yet is filled in first (encoding those examples);
        files that fail to encode are left unsized and fail with EIO when read."""
        shard = self.shards[s]
        if shard.error is not None:
            raise self._fail(s, -1, str(shard.error))
        table = self._tables.get(s)
        if table is None:
            with self._table_locks[s]:
                table = self._tables.get(s)
                if table is None:
                    table = self._tables[s] = self._load_or_build(s)
        if sizes:
            for block in _distinct(table.block[table.size == UNKNOWN_SIZE]):
                try:
                    self._size_block(s, table, block)
                except OSError:  # logged once by _fail; the rest of the shard is still sized
                    pass
        return table

    def _fill_sizes(self, s: int, table: FileTable, rows: list[int]) -> None:
        """Fill in the sizes of table rows ``rows`` that are not known yet by encoding
        their blocks' examples: a whole block at once, since whoever looks up one
        file of a block (tar, ls -l, du) looks up the others next."""
        if len(rows) == 1:
            if table.size.item(rows[0]) != UNKNOWN_SIZE:
                return
            blocks = [table.block.item(rows[0])]
        else:
            picked = np.asarray(rows)
            blocks = _distinct(table.block[picked[table.size[picked] == UNKNOWN_SIZE]])
        for block in blocks:
            self._size_block(s, table, block)

    def _size_located(self, s: int, table: FileTable, i: int) -> bool:
        """Fill in the size of table row ``i`` from its locator, without decoding its block;
        False if it has none. (The locator's size was checked against the file's encoding
        when the table was built; a stored one that lies fails its read's check.)"""
        locator = table.locator(i)
        if locator is None:
            return False
        with self._table_locks[s]:
            unsized = self._unsized.get(s)
            if table.size.item(i) != UNKNOWN_SIZE:
                return True
            table.size[i] = locator.size
            if unsized is None:
                return True
            unsized.left -= 1
            if unsized.left:
                return True
            del self._unsized[s]
        if unsized.key is not None:
            self._store(s, unsized.key, table)
        return True

    def _size_block(self, s: int, table: FileTable, block: int) -> None:
        unsized = self._unsized.get(s)
        if unsized is None:  # sized meanwhile by another thread
            return
        rows = unsized.rows_of(block)
        rows = rows[table.size[rows] == UNKNOWN_SIZE]
        if not len(rows):
            return
        self._reading(s, block)
        decoded = self.decoded_block(s, block)
        sizes = []
        for pos, file in zip(table.pos[rows].tolist(), table.file[rows].tolist()):
            files = self._example_of(decoded, s, block, pos)
            if file >= len(files):  # only if a stored table lies
                raise self._mismatch(s, block)
            sizes.append(len(files[file]))
        with self._table_locks[s]:
            still = table.size[rows] == UNKNOWN_SIZE  # another thread may have been first
            table.size[rows[still]] = np.array(sizes, dtype=np.uint64)[still]
            unsized.left -= int(np.count_nonzero(still))
            if unsized.left or s not in self._unsized:
                return
            del self._unsized[s]
        if unsized.key is not None:
            self._store(s, unsized.key, table)

    def _store(self, s: int, key: dict[str, Any], table: FileTable) -> None:
        assert self.store is not None
        name = self.shards[s].name
        log.debug("stored the file table of shard %s in %s", name, self.store.save(name, key, table))

    def _table_key(self, s: int) -> dict[str, Any]:
        """What a shard's table depends on: the naming rules, the source's kind, and what
        the shard's table depends on (its files, its first index, its options)."""
        return {"layout": LAYOUT_VERSION, "source": self.source.kind, **self.shards[s].table_key()}

    def _load_or_build(self, s: int) -> FileTable:
        shard = self.shards[s]
        key = None
        table = None
        if self.store is not None:
            key = self._table_key(s)

            def limits(state: bytes) -> Limits:  # the stored state first: a Dolma shard's blocks come from it
                shard.restore(state)
                return Limits(shard.num_blocks, shard.block_size)

            table = self.store.load(shard.name, key, limits)
        if table is None:
            try:
                state = shard.prepare()
            except AtlasFormatError as exc:
                raise self._fail(s, -1, str(exc)) from None
            except Exception as exc:  # a source's bug or an unforeseen file still only fails its folder
                raise self._fail(s, -1, f"{shard.path}: cannot be read ({exc!r})") from None
            problems = shard.problems()
            for problem in problems[:LOGGED_PROBLEMS]:
                log.warning("%s", problem)
            if len(problems) > LOGGED_PROBLEMS:
                log.warning("%s: %d more problems (atlasfs verify lists them all)", shard.path,
                            len(problems) - LOGGED_PROBLEMS)
            table, complete = self._build_table(s)
            table.state = state
            if not complete:  # a table with unreadable blocks is rebuilt next time
                key = None
            elif key is not None:  # stored at once, sizes or not: the next mount lists without decoding
                self._store(s, key, table)
        if bool(np.any(table.size == UNKNOWN_SIZE)):
            self._unsized[s] = _Unsized(table, shard.num_blocks, key)
        return table

    def _describe_block(self, s: int, block: int) -> list[tuple[Any, list[tuple[str, int]]]] | None:
        """What :meth:`SourceShard.describe_block` tells of a block's samples; None if it tells nothing."""
        shard = self.shards[s]
        try:
            return shard.describe_block(block)
        except AtlasFormatError as exc:
            raise self._fail(s, block, str(exc)) from None

    def _build_table(self, s: int) -> tuple[FileTable, bool]:
        """Decode every block of shard ``s`` and name its files (sizes only of bytes
        fields, which are served as they are); the flag is False if a block could
        not be decoded."""
        shard = self.shards[s]
        assigner = KeyAssigner(shard.key_width)
        rows: list[tuple[str, int, int, int, int, int]] = []
        complete = True
        for block in range(shard.num_blocks):
            base = shard.first_index + block * shard.block_size
            try:
                described = self._describe_block(s, block)
                if described is not None:  # names and sizes from the source's index: nothing decoded
                    for pos, (declared, files) in enumerate(described):
                        longest = max((len(suffix.encode("utf-8")) for suffix, _ in files), default=0)
                        key, key_note = assigner.assign(declared, base + pos, longest)
                        if key_note:
                            log.info("%s example %d: %s", shard.path, base + pos, key_note)
                        rows.extend((f"{key}.{suffix}", FILE, size, block, pos, j)
                                    for j, (suffix, size) in enumerate(files))
                    continue
                named = self._name_block(s, block)
                located = self._file_spans(s, block, [fields for _, fields, _ in named])
            except StorageUnavailableError:  # no table from a store that did not answer: built on a later look
                raise
            except OSError:
                complete = False
                for pos in range(shard.block_length(block)):
                    key, _ = assigner.assign(NO_KEY, base + pos, 0)
                    rows.append((f"{key}.{UNREADABLE_SUFFIX}", UNREADABLE, 0, block, pos, 0))
                continue
            for pos, (declared, fields, note) in enumerate(named):
                longest = max(len(suffix.encode("utf-8")) for suffix, _ in fields)
                key, key_note = assigner.assign(declared, base + pos, longest)
                for message in (key_note, note):
                    if message:
                        log.info("%s example %d: %s", shard.path, base + pos, message)
                locators = located[pos] if located is not None else None
                for j, (suffix, value) in enumerate(fields):
                    size = len(value) if type(value) is bytes else UNKNOWN_SIZE
                    locator = locators[j] if locators is not None else None
                    if locator is not None and size not in (UNKNOWN_SIZE, locator.size):
                        locator = None
                    # A locator knows its file's size, but the table learns it only at the file's
                    # lookup (_size_located): a table whose sizes are all known hands out every
                    # file's attributes with its listings, and the kernel and libfuse keep an
                    # entry for each (~250 bytes a file, docs/performance.md "Memory").
                    rows.append((f"{key}.{suffix}", FILE, size, block, pos, j, locator))
        return FileTable.build(rows), complete

    def _file_spans(self, s: int, block: int, fields: list[list[tuple[str, Any]]]) -> list[list[Any]] | None:
        """The locators the source gives for a block's files (:meth:`SourceShard.file_spans`),
        or None; a source that fails here only leaves the block's files to the block path."""
        shard = self.shards[s]
        try:
            with self._decoders:  # the source may decode the block's bytes again: bounded like a decode
                found = shard.file_spans(block, fields)
        except Exception as exc:
            log.info("%s: its files are not located (%s)", shard.block_where(block), exc)
            return None
        if found is None or len(found) != len(fields) or any(len(a) != len(b) for a, b in zip(found, fields)):
            return None
        return found

    def _name_block(self, s: int, block: int) -> list[tuple[object, list[tuple[str, Any]], str | None]]:
        """(declared key, fields, note) of each example of a block (decoded through the cache)."""
        decoded = self.decoded_block(s, block)
        shard = self.shards[s]
        try:
            named = [(declared_key(example), *example_fields(example, _max_suffix_bytes(shard)))
                     for example in decoded.examples]
        except Exception as exc:  # an example the naming rules cannot handle
            raise self._fail(s, block, f"{shard.block_where(block)}: cannot name its examples ({exc!r})") from None
        decoded.fields = [fields for _, fields, _ in named]
        self.cache.charge((s, block), 100 * sum(len(fields) for fields in decoded.fields))
        return named
