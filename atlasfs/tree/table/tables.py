"""Shard file tables for the tree: loaded from the table store, or built the first time a
shard is looked into (by its source's pass over its files, then decoding its blocks
once and naming their examples, or from its own index through
:meth:`~atlasfs.formats.source.SourceShard.describe_block`), stored, and sized.

Naming needs no encoding, so a fresh table knows only the sizes of raw bytes fields;
the others are filled in when their files are first looked up (which encodes their
example, as reading it would), and the table is stored again once it knows them all.
A block that cannot be decoded gives ``<index key>.unreadable`` rows whose lookups
and reads fail with EIO; a shard that cannot be opened fails its folder.

Stored tables are mapped from their files, not read (:mod:`atlasfs.tree.table.ondisk`), and a
table built here is mapped from its file once stored. At most :data:`RESIDENT_TABLE_BYTES`
of tables are held, the least recently used let go first (mapped again from their files
when next used; a table that could not be stored is built again): the memory tables take
does not grow with the number of shards looked into.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from atlasfs import memory
from atlasfs.errors import AtlasFormatError
from atlasfs.formats.naming import LAYOUT_VERSION, KeyAssigner
from atlasfs.formats.source import SourceShard
from atlasfs.tree.blocks import Blocks
from atlasfs.tree.table.blockrows import BlockRows
from atlasfs.tree.table.builder import TableBuilder
from atlasfs.tree.table.filetable import FileTable, Limits
from atlasfs.tree.table.layout import LOCATOR_RULES, UNKNOWN_SIZE
from atlasfs.tree.table.store import TableStore

log = logging.getLogger("atlasfs")

#: Problems of a shard's pass over its files logged one by one (a file of bad lines would flood the log).
LOGGED_PROBLEMS = 10
#: Bytes of file tables held, mapped or in memory (the most recently used; at least one, whatever its size).
RESIDENT_TABLE_BYTES = 16 << 20


class _Unsized:
    """What it takes to size a table's files: its rows grouped by block, the count
    still unknown, the count learnt since it was loaded, and the key to store it under
    once complete (None: not stored). Kept on the table (:attr:`FileTable.unsized`)."""

    def __init__(self, table: FileTable, blocks: int, key: dict[str, Any] | None) -> None:
        self._order = np.argsort(table.block, kind="stable").astype(np.uint32)  # 4 bytes a file
        self._bounds = np.searchsorted(table.block[self._order], np.arange(blocks + 1))
        self.left = int(np.count_nonzero(table.size == UNKNOWN_SIZE))
        self.learnt = 0
        self.key = key

    def rows_of(self, block: int) -> np.ndarray:
        """The table rows of block ``block`` (files of unreadable blocks and folders included)."""
        return self._order[self._bounds.item(block):self._bounds.item(block + 1)].astype(np.intp)


def _limits(shard: SourceShard) -> Limits:
    """What a stored table of ``shard`` must stay within (its state restored first, if any)."""
    return Limits(shard.num_blocks, shard.block_size, shard.max_block_bytes)


def _distinct(values: np.ndarray) -> list[int]:
    """The distinct values, ascending. (np.unique would import numpy.ma on first use:
    10-20 ms of a daemon's first listing.)"""
    return sorted(set(values.tolist()))




class Resident:
    """The tables in use, by shard position, least recently used first: past ``bound`` bytes
    (:meth:`FileTable.nbytes`) the least recently used are let go (unmapped, or freed, once
    no caller holds them), whatever the size of the one just held."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self._tables: OrderedDict[int, FileTable] = OrderedDict()
        self._costs: dict[int, int] = {}
        self.bytes = 0  # of the mapped tables held
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._tables)

    def __contains__(self, s: int) -> bool:
        return s in self._tables

    def get(self, s: int) -> FileTable | None:
        """The table of shard position ``s`` if held (it becomes the most recently used)."""
        with self._lock:
            table = self._tables.get(s)
            if table is not None:
                self._tables.move_to_end(s)
            return table

    def put(self, s: int, table: FileTable) -> list[tuple[int, FileTable]]:
        """Hold ``table``; returns the tables let go to stay within the bound, with their positions."""
        cost = table.nbytes()
        with self._lock:
            self._drop(s)
            self._tables[s] = table
            self._costs[s] = cost
            self.bytes += cost
            evicted = []
            for other in list(self._tables):
                if self.bytes <= self.bound:
                    break
                if other != s:
                    evicted.append((other, self._tables[other]))
                    self._drop(other)
            return evicted

    def drop(self, s: int) -> None:
        """Let go of the table of shard position ``s``, if held."""
        with self._lock:
            self._drop(s)

    def _drop(self, s: int) -> None:
        if s in self._tables:
            del self._tables[s]
            self.bytes -= self._costs.pop(s)


class Tables:
    """The file tables of a source's shards, each made once (one lock per shard), at
    most :data:`RESIDENT_TABLE_BYTES` of mapped ones held (:class:`Resident`)."""

    def __init__(self, kind: str, shards: Sequence[SourceShard], blocks: Blocks,
                 store: TableStore | None) -> None:
        self.kind = kind
        self.shards = shards
        self.blocks = blocks
        self.store = store
        self.tables = Resident(RESIDENT_TABLE_BYTES)
        self.locks = [threading.Lock() for _ in shards]
        # The file each shard's table was last mapped from (mapped again from it once let go).
        self._paths: dict[int, str] = {}
        #: Called with a shard position whose table is let go (the native engine detaches its columns).
        self.on_release: Callable[[int], None] | None = None
        #: Each block's rows: its examples named, their files located.
        self.rows = BlockRows(shards, blocks)

    def _hold(self, s: int, table: FileTable) -> None:
        """Hold ``table`` as shard position ``s``'s; a table let go that learnt sizes since it
        was mapped is stored first (else they would be learnt again)."""
        if table.path is not None:
            self._paths[s] = table.path
        for t, evicted in self.tables.put(s, table):
            if self.on_release is not None:
                self.on_release(t)
            self._keep_learnt(t, evicted)

    def _keep_learnt(self, s: int, table: FileTable) -> None:
        """Store ``table`` (let go) if it learnt sizes since it was mapped (else they would be
        learnt again)."""
        unsized = table.unsized
        if unsized is not None and unsized.learnt and unsized.key is not None:
            unsized.learnt = 0
            self._store(s, unsized.key, table)

    def table(self, s: int, sizes: bool = False) -> FileTable:
        """The file table of shard position ``s``: loaded from the store, or built by
        decoding and naming the shard's blocks (then stored). With ``sizes``, every
        size it does not know yet is filled in first (encoding those examples);
        files that fail to encode are left unsized and fail with EIO when read."""
        shard = self.shards[s]
        if shard.error is not None:
            raise self.blocks.fail(s, -1, str(shard.error))
        table = self.tables.get(s)
        if table is None:
            with self.locks[s]:
                table = self.tables.get(s)
                if table is None:
                    table = self._load_or_build(s)
                    self._hold(s, table)
        if sizes:
            for block in _distinct(table.block[table.size == UNKNOWN_SIZE]):
                try:
                    self._size_block(s, table, block)
                except OSError:  # logged once by _fail; the rest of the shard is still sized
                    pass
        return table

    def fill_sizes(self, s: int, table: FileTable, rows: list[int]) -> None:
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

    def size_located(self, s: int, table: FileTable, i: int) -> bool:
        """Fill in the size of table row ``i`` from its locator, without decoding its block;
        False if it has none. (The locator's size was checked against the file's encoding
        when the table was built; a stored one that lies fails its read's check.)"""
        size = table.located_size(i)
        if size is None:
            return False
        with self.locks[s]:
            unsized = table.unsized
            if table.size.item(i) != UNKNOWN_SIZE:
                return True
            table.size[i] = size
            if unsized is None:
                return True
            unsized.left -= 1
            unsized.learnt += 1
            if unsized.left:
                return True
            table.unsized = None
        if unsized.key is not None:
            self._store_complete(s, unsized.key, table)
        return True

    def _size_block(self, s: int, table: FileTable, block: int) -> None:
        unsized = table.unsized
        if unsized is None:  # sized meanwhile by another thread
            return
        rows = unsized.rows_of(block)
        rows = rows[table.size[rows] == UNKNOWN_SIZE]
        if not len(rows):
            return
        # A file with a locator has its size there (checked against its encoding when the
        # table was built, as at a lookup: size_located); only the others encode their examples.
        sizes = table.located_sizes(rows)
        left = np.flatnonzero(sizes == UNKNOWN_SIZE)
        if len(left):
            self.blocks.reading(s, block)
            decoded = self.blocks.decoded(s, block)
            for k, pos, file in zip(left.tolist(), table.pos[rows[left]].tolist(), table.file[rows[left]].tolist()):
                files = self.blocks.example_of(decoded, s, block, pos)
                if file >= len(files):  # only if a stored table lies
                    raise self.blocks.mismatch(s, block)
                sizes[k] = len(files[file])
        with self.locks[s]:
            still = table.size[rows] == UNKNOWN_SIZE  # another thread may have been first
            table.size[rows[still]] = sizes[still]
            learnt = int(np.count_nonzero(still))
            unsized.left -= learnt
            unsized.learnt += learnt
            if unsized.left or table.unsized is None:
                return
            table.unsized = None
        if unsized.key is not None:
            self._store_complete(s, unsized.key, table)

    def _store(self, s: int, key: dict[str, Any], table: FileTable) -> bool:
        """Store ``table``; False if it could not be (logged)."""
        assert self.store is not None
        name = self.shards[s].name
        where = self.store.save(name, key, table)
        log.debug("stored the file table of shard %s in %s", name, where)
        return where is not None

    def _mapped(self, s: int, key: dict[str, Any], table: FileTable) -> FileTable:
        """``table`` as mapped from the file it was just stored in (its arrays then leave
        memory), or ``table`` if it cannot be."""
        assert self.store is not None
        shard = self.shards[s]
        path = self.store.saved_path(shard.name)
        mapped = self.store.reopen(path, key, _limits(shard)) if path else None
        return mapped if mapped is not None and len(mapped) == len(table) else table

    def _store_complete(self, s: int, key: dict[str, Any], table: FileTable) -> None:
        """Store a table that has learnt every size, and hold it mapped from its file."""
        if not self._store(s, key, table):
            return
        with self.locks[s]:
            if self.tables.get(s) is table:
                mapped = self._mapped(s, key, table)
                if mapped is not table:
                    self._hold(s, mapped)

    def table_key(self, s: int) -> dict[str, Any]:
        """What a shard's table depends on: the naming rules, the locator rules, the source's
        kind, and what the shard's table depends on (its files, its first index, its options)."""
        return {"layout": LAYOUT_VERSION, "locators": LOCATOR_RULES, "source": self.kind,
                **self.shards[s].table_key()}

    def _load_or_build(self, s: int) -> FileTable:
        shard = self.shards[s]
        key = None
        table = None
        if self.store is not None:
            key = self.table_key(s)
            path = self._paths.get(s)
            if path is not None:  # mapped before, and let go: its state is the shard's already
                table = self.store.reopen(path, key, _limits(shard))
            if table is None:
                table = self.stored(s, key)
        if table is None:
            state = self.prepare(s)
            table, complete = self._build_table(s)
            table.state = state
            if not complete:  # a table with unreadable blocks is rebuilt next time
                key = None
            elif key is not None and self._store(s, key, table):  # at once, sizes or not: the next mount
                table = self._mapped(s, key, table)                  # lists without decoding
        if bool(np.any(table.size == UNKNOWN_SIZE)):
            table.unsized = _Unsized(table, shard.num_blocks, key)
        return table

    def prepare(self, s: int) -> bytes:
        """Run shard position ``s``'s pass over its files (:meth:`SourceShard.prepare`), logging
        the problems it found; returns its state. A shard it fails fails whole (EIO)."""
        shard = self.shards[s]
        try:
            state = shard.prepare()
        except AtlasFormatError as exc:
            raise self.blocks.fail(s, -1, str(exc)) from None
        except Exception as exc:  # a source's bug or an unforeseen file still only fails its folder
            raise self.blocks.fail(s, -1, f"{shard.path}: cannot be read ({exc!r})") from None
        problems = shard.problems()
        for problem in problems[:LOGGED_PROBLEMS]:
            log.warning("%s", problem)
        if len(problems) > LOGGED_PROBLEMS:
            log.warning("%s: %d more problems (atlasfs verify lists them all)", shard.path,
                        len(problems) - LOGGED_PROBLEMS)
        return state

    def stored(self, s: int, key: dict[str, Any] | None = None) -> FileTable | None:
        """Shard position ``s``'s table as the store holds it, if it holds a valid one
        built from the shard as it is now (None: it does not, or there is no store);
        ``key``: its :meth:`table_key`, if known."""
        if self.store is None:
            return None
        shard = self.shards[s]

        def limits(state: bytes) -> Limits:  # the stored state first: a Dolma shard's blocks come from it
            shard.restore(state)
            return _limits(shard)

        return self.store.load(shard.name, key or self.table_key(s), limits)

    def forget(self, s: int) -> None:
        """Let go of shard position ``s``'s table (a command going over every shard keeps one
        at a time); it is mapped, loaded or built again if asked for."""
        with self.locks[s]:
            table = self.tables.get(s)
            self.tables.drop(s)
        if table is not None:
            if self.on_release is not None:
                self.on_release(s)
            self._keep_learnt(s, table)

    def _build_table(self, s: int) -> tuple[FileTable, bool]:
        """Decode every block of shard ``s`` and name its files (sizes only of bytes
        fields, which are served as they are); the flag is False if a block could
        not be decoded."""
        assigner = KeyAssigner(self.shards[s].key_width)
        builder = TableBuilder()
        complete = True
        for block in range(self.shards[s].num_blocks):
            block_rows, readable = self.rows.block_rows(s, block, assigner)
            builder.add(block_rows)
            complete = complete and readable
        table = builder.finish()
        memory.trim()  # what the build held goes back to the system (a shard's names: tens of MiB)
        return table, complete
