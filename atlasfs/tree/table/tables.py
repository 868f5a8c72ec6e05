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
from atlasfs.formats.naming import LAYOUT_VERSION, NO_KEY, KeyAssigner, declared_key, example_fields
from atlasfs.formats.source import SourceShard
from atlasfs.storage import StorageUnavailableError
from atlasfs.tree.blocks import Block, Blocks, eio, max_suffix_bytes
from atlasfs.tree.table.builder import TableBuilder
from atlasfs.tree.table.filetable import FileTable, Limits, Rows
from atlasfs.tree.table.layout import FILE, LOCATOR_RULES, UNKNOWN_SIZE, UNREADABLE
from atlasfs.tree.table.store import TableStore

log = logging.getLogger("atlasfs")

#: (declared key, fields, note) of each example of a block, as :meth:`Tables._name_block` names them.
Named = list[tuple[object, list[tuple[str, Any]], "str | None"]]
#: Problems of a shard's pass over its files logged one by one (a file of bad lines would flood the log).
LOGGED_PROBLEMS = 10
#: Suffix of the entries standing for examples of a block that cannot be decoded.
UNREADABLE_SUFFIX = "unreadable"
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

    def _describe_block(self, s: int, block: int) -> list[tuple[Any, list[tuple[str, int]]]] | None:
        """What :meth:`SourceShard.describe_block` tells of a block's samples; None if it tells nothing."""
        shard = self.shards[s]
        try:
            return shard.describe_block(block)
        except AtlasFormatError as exc:
            raise self.blocks.fail(s, block, str(exc)) from None

    def _build_table(self, s: int) -> tuple[FileTable, bool]:
        """Decode every block of shard ``s`` and name its files (sizes only of bytes
        fields, which are served as they are); the flag is False if a block could
        not be decoded."""
        assigner = KeyAssigner(self.shards[s].key_width)
        builder = TableBuilder()
        complete = True
        for block in range(self.shards[s].num_blocks):
            block_rows, readable = self.block_rows(s, block, assigner)
            builder.add(block_rows)
            complete = complete and readable
        table = builder.finish()
        memory.trim()  # what the build held goes back to the system (a shard's names: tens of MiB)
        return table, complete

    def block_rows(self, s: int, block: int, assigner: KeyAssigner, locate: bool = True) -> tuple[Rows, bool]:
        """The table rows ``(path, kind, size, block, pos, file[, locator])`` of block ``block``
        of shard ``s``, its examples' keys given by ``assigner`` (one per shard, fed every
        block in order); with ``locate``, the locators of files the source can read without
        decoding. False, with ``<key>.unreadable`` rows, if the block cannot be decoded."""
        shard = self.shards[s]
        base = shard.first_index + block * shard.block_size
        rows: Rows = []
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
                return rows, True
            named, decoded, cost = self._name_block(s, block, cached=not locate)
            located = self._file_spans(s, block, [fields for _, fields, _ in named]) if locate else None
        except StorageUnavailableError:  # no table from a store that did not answer: built on a later look
            raise
        except OSError:
            for pos in range(shard.block_length(block)):
                key, _ = assigner.assign(NO_KEY, base + pos, 0)
                rows.append((f"{key}.{UNREADABLE_SUFFIX}", UNREADABLE, 0, block, pos, 0))
            return rows, False
        kept = False  # a file without a locator: its reads need the block, kept in the cache
        runs = 0  # bytes of the files located in runs of the block's stored bytes
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
                if locator is None:
                    kept = True
                elif not locator.inline:
                    runs += locator.length
        if cost is not None and (kept or not self._stored_as_is(s, block, runs)):
            self.blocks.cache.put((s, block), decoded, cost)
        return rows, True

    def _file_spans(self, s: int, block: int, fields: list[list[tuple[str, Any]]]) -> list[list[Any]] | None:
        """The locators the source gives for a block's files (:meth:`SourceShard.file_spans`),
        or None; a source that fails here only leaves the block's files to the block path."""
        shard = self.shards[s]
        try:
            with self.blocks.decoders:  # the source may decode the block's bytes again: bounded like a decode
                found = shard.file_spans(block, fields)
        except Exception as exc:
            log.info("%s: its files are not located (%s)", shard.block_where(block), exc)
            return None
        if found is None or len(found) != len(fields) or any(len(a) != len(b) for a, b in zip(found, fields)):
            return None
        return found

    def _name_block(self, s: int, block: int, cached: bool = True) -> tuple[Named, Block, int | None]:
        """(declared key, fields, note) of each example of a block, the decoded block, and its
        cost if it was decoded here and not cached (None: it is in the cache). With ``cached``
        the block is decoded through the cache; without, a block not cached already is decoded
        outside it (:meth:`block_rows` caches it unless :meth:`_stored_as_is`)."""
        decoded, cost = None, None
        if not cached:
            decoded = self.blocks.cache.peek((s, block))
            if decoded is None:
                failed = self.blocks.failed.get((s, block))
                if failed is not None:
                    raise eio(failed)
                decoded, cost = self.blocks._decode(s, block)  # noqa: SLF001 (the tree's own)
                self.blocks.cache.misses += 1  # a decode the cache did not spare, counted as its own are
        if decoded is None:
            decoded = self.blocks.decoded(s, block)
        shard = self.shards[s]
        try:
            named = [(declared_key(example), *example_fields(example, max_suffix_bytes(shard)))
                     for example in decoded.examples]
        except Exception as exc:  # an example the naming rules cannot handle
            raise self.blocks.fail(s, block, f"{shard.block_where(block)}: cannot name its examples ({exc!r})") from None
        decoded.fields = [fields for _, fields, _ in named]
        extra = 100 * sum(len(fields) for fields in decoded.fields)
        if cost is None:
            self.blocks.cache.charge((s, block), extra)
        else:
            cost += extra
        return named, decoded, cost

    def _stored_as_is(self, s: int, block: int, runs: int) -> bool:
        """Whether a block decoded outside the cache by a table's build need not be cached:
        its files, every one located, lie in runs of its bytes as stored (some runs, and no
        fewer bytes stored than they add up to, as :meth:`LocatedReads.stored_as_is
        <atlasfs.tree.located.LocatedReads.stored_as_is>` judges a block), in a local file.
        Reads of them are preads of the stored bytes, not the cache's; and a build that cached
        every block it decoded faulted fresh pages in for all of them (a quarter of the CPU
        time of an image shard's build). A compressed block is cached as before: its files'
        reads would decompress it again."""
        shard = self.shards[s]
        if runs <= 0 or getattr(getattr(shard, "storage", None), "remote", False):
            return False
        return shard.stored_block_size(block) >= runs
