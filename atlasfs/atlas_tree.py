"""The tree of an Atlas dataset: one folder per shard, WebDataset-style files inside.

Files are named and encoded by :mod:`atlasfs.naming`. A shard's file table
(names, sizes, block and position of every file) is loaded from the table
store, or built the first time the shard is looked into by decoding its
blocks once and naming their examples (and then stored). Naming needs no
encoding, so a fresh table knows only the sizes of raw bytes fields; the
others are filled in when their files are first looked up (which encodes
their example, as reading it would), and the table is stored again once it
knows them all. A listing needs no sizes. File bytes come from a cache of
decoded blocks bounded in bytes; a block's examples are encoded as files one
at a time, when first needed, and kept with it. Evicted blocks are decoded again.
Readers that go through a shard in order get its next blocks decoded and
encoded ahead of them, on a background thread (:mod:`atlasfs.readahead`).

A block that cannot be decoded is logged once; its examples appear as
``<index key>.unreadable`` entries whose lookups and reads fail with EIO,
while everything else keeps serving. A shard that cannot even be opened
(open the dataset with ``tolerate_broken_shards=True``) is a folder whose
listing fails with EIO.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np

from .blockcache import BlockCache
from .dataset import DEFAULT_CACHE_BYTES, AtlasDataset, BrokenShard
from .errors import AtlasFormatError
from .filetable import DIR, FILE, UNKNOWN_SIZE, UNREADABLE, FileTable, Limits
from .naming import (LAYOUT_VERSION, MAX_NAME_BYTES, NO_KEY, KeyAssigner, declared_key, encode_as, example_fields,
                     index_key_width)
from .readahead import ReadAhead
from .tablestore import TableStore
from .tree import Entry, Tree, not_found, split_path

log = logging.getLogger("atlasfs")

#: Names kept in the cache of recently listed folders (about 200 bytes each).
FOLDER_CACHE_NAMES = 100_000
#: Blocks decoded, and their examples encoded, ahead of a reader going through a shard in order...
READ_AHEAD_BLOCKS = 2
#: ...once it has used this many blocks in a row (starting at a shard's first block counts as
#: one more: readers that start there usually go through). Random readers land on the block
#: after the one before now and then, but seldom twice running.
READ_AHEAD_AFTER = 3
#: Blocks stored in more than this share of the cache bound are not read ahead: decoded, two
#: of them could push out the block being read.
READ_AHEAD_MAX_SHARE = 16
#: Files whose entries :meth:`AtlasTree.members` makes at once (bounds the blocks it sizes ahead of use).
MEMBERS_BATCH = 1024
#: Suffix of the entries standing for examples of a block that cannot be decoded.
UNREADABLE_SUFFIX = "unreadable"


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


class _Folder(NamedTuple):
    """A recently listed folder: its listing, and its readable children by name
    (their entry, or their table row while their size is not known)."""

    listing: tuple[tuple[str, bool, int], ...]  # a tuple: every caller gets this same one
    children: dict[str, Entry | int]


class _Unsized:
    """What it takes to size a table's files: its rows grouped by block, the count
    still unknown, and the key to store it under once complete (None: not stored)."""

    def __init__(self, table: FileTable, blocks: int, key: dict[str, Any] | None) -> None:
        self._order = np.argsort(table.block, kind="stable")
        self._bounds = np.searchsorted(table.block[self._order], np.arange(blocks + 1)).tolist()
        self.left = int(np.count_nonzero(table.size == UNKNOWN_SIZE))
        self.key = key

    def rows_of(self, block: int) -> np.ndarray:
        """The table rows of block ``block`` (files of unreadable blocks and folders included)."""
        return self._order[self._bounds[block]:self._bounds[block + 1]]


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


def _eio(message: str) -> OSError:
    return OSError(errno.EIO, message)


def _shard_ino(s: int) -> int:
    """The inode number of shard position ``s``'s folder; row ``i`` of its table is this + 1 + i."""
    return (s + 1) << 32


class AtlasTree(Tree):
    """A :class:`Tree` over an open :class:`AtlasDataset`.

    ``store`` keeps shard file tables between runs (None: build them every time).
    """

    def __init__(self, dataset: AtlasDataset, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 store: TableStore | None = None) -> None:
        self.dataset = dataset
        self.width = index_key_width(len(dataset))
        # A field suffix must fit beside the shortest key, the index key.
        self.max_suffix_bytes = MAX_NAME_BYTES - 1 - self.width
        self.cache: BlockCache[Block] = BlockCache(cache_bytes)
        self.store = store
        self._shard_by_name = {shard.name: s for s, shard in enumerate(dataset.shards)}
        self._tables: dict[int, FileTable] = {}
        self._table_locks = [threading.Lock() for _ in dataset.shards]
        self._failed: dict[tuple[int, int], str] = {}
        self._failed_lock = threading.Lock()
        # Tables that do not know every size yet.
        self._unsized: dict[int, _Unsized] = {}
        # Recently listed folders, least recently listed first. The lookups that
        # follow a listing (tar, find, ls -l) become dict hits, and a second
        # listing costs nothing. Bounded by the names it holds.
        self._folders: OrderedDict[tuple[int, str], _Folder] = OrderedDict()
        self._folder_names = 0
        self._folders_lock = threading.Lock()
        # The last block each shard's readers used, and how many blocks in order led
        # there (see READ_AHEAD_AFTER).
        self._last_block = [(-1, 1)] * len(dataset.shards)
        self.readahead = ReadAhead(self._read_ahead) if cache_bytes > 0 else None
        self._root = Entry(True, 0, os.stat(os.path.join(dataset.root, "meta.json")).st_mtime, 1)
        self._shard_entries = [
            Entry(True, 0, shard.mtime, _shard_ino(s)) for s, shard in enumerate(dataset.shards)]

    # -- the Tree interface

    def lookup(self, path: str) -> Entry:
        parts = split_path(path)
        if not parts:
            return self._root
        s = self._shard_by_name.get(parts[0])
        if s is None:
            raise not_found(path)
        if len(parts) == 1:
            return self._shard_entries[s]
        listed = self._folders.get((s, "/".join(parts[1:-1])))
        found = listed.children.get(parts[-1]) if listed is not None else None
        if type(found) is Entry:
            return found
        table = self.table(s)
        i = table.find("/".join(parts[1:])) if found is None else found
        if i is None:
            raise not_found(path)
        if table.kind[i] == UNREADABLE:
            raise _eio(self._failure(s, int(table.block[i])))
        entry = self._entries(s, table, [i])[0]
        if found is not None:
            listed.children[parts[-1]] = entry  # type: ignore[union-attr]
        return entry

    def listdir(self, path: str) -> list[tuple[str, Entry]]:
        parts = split_path(path)
        if not parts:
            return [(shard.name, self._shard_entries[s]) for s, shard in enumerate(self.dataset.shards)]
        s, folder = self._folder_of(path, parts)
        table = self.table(s)
        children = table.children(folder)
        return list(zip([name for name, _ in children], self._entries(s, table, [i for _, i in children])))

    def names(self, path: str) -> Sequence[tuple[str, bool, int]]:
        parts = split_path(path)
        if not parts:
            return super().names(path)
        s, folder = self._folder_of(path, parts)
        with self._folders_lock:
            listed = self._folders.get((s, folder))
            if listed is not None:  # every pass of tar or find lists every folder again
                self._folders.move_to_end((s, folder))
                return listed.listing
        table = self.table(s)
        children = table.children(folder)
        rows = [i for _, i in children]
        kinds = table.kind[rows].tolist()
        base = _shard_ino(s) + 1
        listing = tuple([(name, kind == DIR, base + i) for (name, i), kind in zip(children, kinds)])
        # Rows whose sizes are known get their entries now, at once (a stored table,
        # usually); the others when first looked up. Unreadable entries stay out:
        # their lookups must fail.
        known = bool(np.all(table.size[rows] != UNKNOWN_SIZE))
        values: list[Entry] | list[int] = self._entries(s, table, rows) if known else rows
        readable: dict[str, Entry | int] = {
            name: value for (name, _), kind, value in zip(children, kinds, values) if kind != UNREADABLE}
        self._remember_folder(s, folder, _Folder(listing, readable))
        return listing

    def known_entries(self, path: str, start: int = 0, stop: int | None = None) -> Sequence[Entry | None]:
        parts = split_path(path)
        if not parts:
            return super().known_entries(path, start, stop)
        listing = self.names(path)[start:stop]
        # What names() remembered: entries once sizes are known (a stored table, or
        # files looked up since), table rows before; unreadable files are absent.
        listed = self._folders.get((self._shard_by_name[parts[0]], "/".join(parts[1:])))
        if listed is None:  # too big a folder to remember
            return [None] * len(listing)
        found = map(listed.children.get, [name for name, _, _ in listing])
        return [value if type(value) is Entry else None for value in found]

    def _folder_of(self, path: str, parts: list[str]) -> tuple[int, str]:
        """(shard position, folder inside it) of the folder ``path``."""
        if not self.lookup(path).is_dir:
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        return self._shard_by_name[parts[0]], "/".join(parts[1:])

    def _remember_folder(self, s: int, folder: str, listed: _Folder) -> None:
        if len(listed.listing) > FOLDER_CACHE_NAMES:
            return
        with self._folders_lock:
            old = self._folders.pop((s, folder), None)
            self._folder_names -= len(old.listing) if old else 0
            self._folders[(s, folder)] = listed
            self._folder_names += len(listed.listing)
            while self._folder_names > FOLDER_CACHE_NAMES:
                _, evicted = self._folders.popitem(last=False)
                self._folder_names -= len(evicted.listing)

    def members(self, path: str) -> Iterator[tuple[str, Entry]]:
        parts = split_path(path)
        if not parts:
            yield from super().members(path)
            return
        s, folder = self._folder_of(path, parts)
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
        files = self.encoded_example(ref.shard, ref.block, ref.pos)
        if ref.file >= len(files) or len(files[ref.file]) != entry.size:
            # only if the dataset changed under us, or a stored table lies
            raise self._mismatch(ref.shard, ref.block)
        return files[ref.file][offset:offset + size]

    def total_bytes(self) -> int:
        return sum(shard.data_size for shard in self.dataset.shards)

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
        return self.cache.get((s, block), lambda: self._decode_block(s, block))

    def _decode_block(self, s: int, block: int) -> tuple[Block, int]:
        shard = self.dataset.shards[s]
        try:
            examples, nbytes = shard.decode_block(block)
        except AtlasFormatError as exc:
            raise self._fail(s, block, str(exc)) from None
        except Exception as exc:  # the codec reports what it knows; anything else still only fails this block
            raise self._fail(s, block, f"{shard.data_path} block {block}: cannot decode ({exc!r})") from None
        return Block(examples), nbytes

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
            end = min(block + 1 + READ_AHEAD_BLOCKS, self.dataset.shards[s].num_blocks)
            self.readahead.hint([(s, b) for b in range(block + 1, end)])

    def _read_ahead(self, key: Any) -> None:
        """Decode block ``key = (shard, block)`` into the cache and encode its examples."""
        s, block = key
        if self.dataset.shards[s].stored_block_size(block) * READ_AHEAD_MAX_SHARE > self.cache.max_bytes:
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
        shard = self.dataset.shards[s]
        example = decoded.examples[pos]
        try:
            fields = decoded.fields[pos] if decoded.fields is not None else example_fields(
                example, self.max_suffix_bytes)[0]
            files = [(suffix, encode_as(suffix, value)) for suffix, value in fields]
        except Exception as exc:  # an example the encoders cannot handle
            raise self._fail(s, block, f"{shard.data_path} block {block}: cannot encode example {pos} ({exc!r})") from None
        decoded.encoded_bytes += sum(len(data) for _, data in files)
        limit = shard.codec.max_block_bytes
        if decoded.encoded_bytes > limit:  # shared references can make files far larger than the pickle
            raise self._fail(s, block, f"{shard.data_path} block {block}: its files would take more than {limit} bytes")
        values = example.values() if isinstance(example, dict) else (example,)
        shared = {id(value) for value in values if type(value) is bytes}
        cost = sum(len(data) for _, data in files if id(data) not in shared) + 100 * len(files)
        return tuple(data for _, data in files), cost

    def _fail(self, s: int, block: int, message: str) -> OSError:
        """Remember and log (once) that block ``block`` of shard ``s`` (-1: the whole shard) fails."""
        with self._failed_lock:
            if (s, block) not in self._failed:
                self._failed[(s, block)] = message
                log.error("%s (its files fail with EIO)", message)
        return _eio(message)

    def _mismatch(self, s: int, block: int) -> OSError:
        """The error for a block whose examples are not what the file table says (only if
        the dataset changed under us, or a stored table lies)."""
        return _eio(f"{self.dataset.shards[s].data_path}: block {block} does not match its file table")

    def _failure(self, s: int, block: int) -> str:
        return self._failed.get((s, block), f"{self.dataset.shards[s].data_path} block {block} cannot be decoded")

    # -- file tables

    def table(self, s: int, sizes: bool = False) -> FileTable:
        """The file table of shard position ``s``: loaded from the store, or built by
        decoding and naming the shard's blocks (then stored). With ``sizes``, every
        size it does not know yet is filled in first (encoding those examples);
        files that fail to encode are left unsized and fail with EIO when read."""
        shard = self.dataset.shards[s]
        if isinstance(shard, BrokenShard):
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
        name = self.dataset.shards[s].name
        log.debug("stored the file table of shard %s in %s", name, self.store.save(name, key, table))

    def _table_key(self, s: int) -> dict[str, Any]:
        """What a shard's table depends on: its files, its global position, the naming rules."""
        shard = self.dataset.shards[s]
        files: dict[str, list[int] | None] = {}
        for name in ("meta.json", "index.npy", "data.bin", "zstd_dict.bin", "../zstd_dict.bin"):
            try:
                st = os.stat(os.path.join(shard.path, name))
                files[name] = [st.st_size, st.st_mtime_ns]
            except OSError:
                files[name] = None
        return {"layout": LAYOUT_VERSION, "start": self.dataset.shard_start(s), "width": self.width,
                "files": files}

    def _load_or_build(self, s: int) -> FileTable:
        shard = self.dataset.shards[s]
        key = None
        table = None
        if self.store is not None:
            key = self._table_key(s)
            table = self.store.load(shard.name, key, Limits(shard.num_blocks, shard.meta.block_size))
        if table is None:
            table, complete = self._build_table(s)
            if not complete:  # a table with unreadable blocks is rebuilt next time
                key = None
            elif key is not None:  # stored at once, sizes or not: the next mount lists without decoding
                self._store(s, key, table)
        if bool(np.any(table.size == UNKNOWN_SIZE)):
            self._unsized[s] = _Unsized(table, shard.num_blocks, key)
        return table

    def _build_table(self, s: int) -> tuple[FileTable, bool]:
        """Decode every block of shard ``s`` and name its files (sizes only of bytes
        fields, which are served as they are); the flag is False if a block could
        not be decoded."""
        shard = self.dataset.shards[s]
        assigner = KeyAssigner(self.width)
        first_index = self.dataset.shard_start(s)
        rows: list[tuple[str, int, int, int, int, int]] = []
        complete = True
        for block in range(shard.num_blocks):
            base = first_index + block * shard.meta.block_size
            try:
                named = self._name_block(s, block)
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
                for j, (suffix, value) in enumerate(fields):
                    size = len(value) if type(value) is bytes else UNKNOWN_SIZE
                    rows.append((f"{key}.{suffix}", FILE, size, block, pos, j))
        return FileTable.build(rows), complete

    def _name_block(self, s: int, block: int) -> list[tuple[object, list[tuple[str, Any]], str | None]]:
        """(declared key, fields, note) of each example of a block (decoded through the cache)."""
        decoded = self.decoded_block(s, block)
        try:
            named = [(declared_key(example), *example_fields(example, self.max_suffix_bytes))
                     for example in decoded.examples]
        except Exception as exc:  # an example the naming rules cannot handle
            shard = self.dataset.shards[s]
            raise self._fail(s, block, f"{shard.data_path} block {block}: cannot name its examples ({exc!r})") from None
        decoded.fields = [fields for _, fields, _ in named]
        self.cache.charge((s, block), 100 * sum(len(fields) for fields in decoded.fields))
        return named
