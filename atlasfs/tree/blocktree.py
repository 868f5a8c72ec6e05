"""The tree of any source: one folder per shard, WebDataset-style files inside.

A :class:`~atlasfs.formats.source.Source` (an Atlas dataset, Dolma documents,
Lavender shardsets, ``.pbin`` files) gives shards of blocks of samples; this
module makes them a :class:`~atlasfs.tree.base.Tree` and knows nothing of any
format. It only answers the tree's calls; each job is a module of its own:

- :mod:`atlasfs.tree.placement`: which folder each shard is, and the folders above
  shards named with slashes;
- :mod:`atlasfs.tree.table.tables`: each shard's file table (names, sizes, block and position
  of every file), loaded, built, sized and stored;
- :mod:`atlasfs.tree.listing`: a folder's listing and lookup index made from its table,
  and the cache of recently listed folders;
- :mod:`atlasfs.tree.blocks`: decoded blocks through the cache bounded in bytes, their
  examples encoded as files when first read, failures, read-ahead;
- :mod:`atlasfs.tree.located`: random reads of a file whose block is not cached, served
  from where its bytes lie without decoding the block.

A block that cannot be decoded is logged once; its examples appear as
``<index key>.unreadable`` entries whose lookups and reads fail with EIO,
while everything else keeps serving. A shard that cannot even be opened
(its ``error`` is set, or its pass over its files fails) is a folder whose
listing fails with EIO. Either raises :class:`~atlasfs.tree.base.Unreadable`, whose
``cause`` lets the tar view and the commands that use the tree (``export``,
``index``) leave that shard out and say why in their own words.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Sequence

import numpy as np

from atlasfs.formats.source import NativeSpans, Source, SourceShard
from atlasfs.tree.base import Entry, Tree, not_found
from atlasfs.tree.blocks import Blocks, eio
from atlasfs.tree.listing import FolderCache, Listing, row_entries, row_entry
from atlasfs.tree.located import LocatedReads
from atlasfs.tree.placement import ShardPlacement
from atlasfs.tree.shardfiles import shard_files
from atlasfs.tree.table.filetable import FileTable, Locators
from atlasfs.tree.table.layout import FILE, UNKNOWN_SIZE, UNREADABLE, split_ino
from atlasfs.tree.table.store import TableStore
from atlasfs.tree.table.tables import Tables

#: Entries of recently looked up files kept for the reads that follow (each ~350 bytes).
RECENT_ENTRIES = 4096
#: Bytes of decoded blocks cached by default (256 MiB).
DEFAULT_CACHE_BYTES = 256 << 20
#: Files whose entries :meth:`BlockTree.members` makes at once (bounds the blocks it sizes ahead of use).
MEMBERS_BATCH = 1024


class BlockTree(Tree):
    """A :class:`Tree` over an open :class:`~atlasfs.formats.source.Source`.

    ``store`` keeps shard file tables between runs (None: build them every time).
    Each shard or block that fails is logged once, in a mount's words (its files fail
    with EIO), shards that could not be opened at once; a command that says itself
    what each :class:`~atlasfs.tree.base.Unreadable` it meets means for it (``export``)
    passes ``log_failures=False``.
    """

    def __init__(self, source: Source, cache_bytes: int = DEFAULT_CACHE_BYTES,
                 store: TableStore | None = None, log_failures: bool = True) -> None:
        self.source = source
        self.shards: list[SourceShard] = list(source.shards)
        self.placement = ShardPlacement(self.shards, source.mtime)
        self.blocks = Blocks(self.shards, cache_bytes, log_failures)
        self.tables = Tables(source.kind, self.shards, self.blocks, store)
        self.located = LocatedReads(self.blocks)
        self.folders = FolderCache()
        # Entries of recently looked-up files: the kernel looks a file up, then reads it
        # (and each read request names the file again). Emptied when full.
        self._recent: dict[str, Entry] = {}
        for s, shard in enumerate(self.shards):  # said now: a mount's user sees it when mounting
            if shard.error is not None:
                self.blocks.fail(s, -1, str(shard.error))

    @property
    def cache(self):  # noqa: ANN201 (BlockCache[Block])
        """The block cache (decoded blocks and their files), bounded in bytes."""
        return self.blocks.cache

    def failures(self, s: int) -> list[str]:
        """What is known to fail in shard position ``s`` (see :meth:`atlasfs.tree.blocks.Blocks.failures`)."""
        return self.blocks.failures(s)

    def table(self, s: int, sizes: bool = False) -> FileTable:
        """The file table of shard position ``s`` (see :meth:`atlasfs.tree.table.tables.Tables.table`)."""
        return self.tables.table(s, sizes)

    def forget(self, s: int) -> None:
        """Drop shard position ``s``'s table, listings and entries (see :meth:`Tables.forget
        <atlasfs.tree.table.tables.Tables.forget>`) and close its files (reopened if it is read again):
        ``index`` and ``export`` keep one shard's at a time, and as many descriptors."""
        self.tables.forget(s)
        self.folders.forget(s)
        self._recent = {}
        self.shards[s].close()

    def path_of_ino(self, ino: int) -> str | None:
        """The path of a shard folder's or a table row's inode number (they carry (shard, row):
        :func:`~atlasfs.tree.table.layout.shard_ino`), None if it names none. The native engine
        names these files by their inode numbers and keeps nothing per file (docs/native.md)."""
        s, row = split_ino(ino)
        if not 0 <= s < len(self.shards) or self.placement.by_name.get(self.shards[s].name) != s:
            return None
        if row < 0:
            return f"/{self.shards[s].name}"
        table = self.tables.tables.get(s) or self.table(s)
        return f"/{self.shards[s].name}/{table.entry_path(row)}" if row < len(table) else None

    def block_files(self, s: int, block: int) -> tuple[int, np.ndarray, bytes] | None:
        """The encoded files of block ``block`` of shard position ``s`` for the native engine's
        byte cache: (first row, offsets of each file's bytes and their end, the bytes), if the
        block's rows are consecutive files (a flat shard); None otherwise. Encodes every
        example of the block."""
        table = self.tables.tables.get(s) or self.table(s)
        rows = np.flatnonzero(table.block == block)
        if not len(rows) or int(rows[-1]) - int(rows[0]) + 1 != len(rows) or (table.kind[rows] != FILE).any():
            return None
        blocks = self.blocks
        blocks.reading(s, block)
        decoded = blocks.decoded(s, block)  # once, not once a row: the cache's lock is not free
        parts = []
        for pos, file in zip(table.pos[rows].tolist(), table.file[rows].tolist()):
            files = blocks.example_of(decoded, s, block, pos)
            if file >= len(files):  # only if the dataset changed under us, or a stored table lies
                raise blocks.mismatch(s, block)
            parts.append(files[file])
        offsets = np.zeros(len(parts) + 1, np.uint64)
        np.cumsum([len(part) for part in parts], out=offsets[1:])
        return int(rows[0]), offsets, b"".join(parts)

    def in_order_run(self, s: int, block: int) -> int:
        """How many blocks of shard position ``s`` readers have gone through in order, ending
        with ``block``, while ``block`` is still decoded in the cache; 0 if ``block`` is not the
        last one read or not cached. The native engine hands a reader going through a shard in
        order the files of whole blocks (:meth:`block_files`)."""
        last, run = self.blocks.last_block[s]
        return run if last == block and (s, block) in self.blocks.cache else 0

    def native_spans(self, s: int) -> tuple[Locators, NativeSpans] | None:
        """The locators of shard position ``s``'s table (held) and where its blocks lie, for
        the native engine to read its located files itself; None when located reads are off,
        the table has no locators or the source gives no :class:`NativeSpans`."""
        table = self.tables.tables.get(s)
        if not self.located.enabled or table is None or table.locators is None:
            return None
        spans = self.blocks.shards[s].native_spans()
        return (table.locators, spans) if spans is not None else None

    # -- the Tree interface

    def lookup(self, path: str) -> Entry:
        entry = self._recent.get(path)
        if entry is not None:
            return entry
        s, rest, above = self.placement.split(path)
        if s is None:
            return self.placement.entry_above(above)
        if not rest:
            return self.placement.shard_entries[s]
        tables = self.tables
        table = tables.tables.get(s)
        if table is None:
            table = tables.table(s)
        i = table.find(rest)
        if i is None:
            raise not_found(path)
        kind = table.kind.item(i)
        if kind == UNREADABLE:
            raise eio(self.blocks.failure(s, table.block.item(i)))
        if kind == FILE and table.size.item(i) == UNKNOWN_SIZE and not tables.size_located(s, table, i):
            tables.fill_sizes(s, table, [i])
        entry = row_entry(table, s, i, self.placement.shard_entries[s].mtime)
        recent = self._recent
        if len(recent) >= RECENT_ENTRIES:  # cheaper than keeping an order, and as good for lookup-then-read
            recent.clear()
        recent[path] = entry
        return entry

    def listdir(self, path: str) -> list[tuple[str, Entry]]:
        s, folder = self._folder_of(path)
        if s is None:
            return self.placement.list_above(folder)
        table = self.table(s)
        children = table.children(folder)
        return list(zip([name for name, _ in children], self._entries(s, table, [i for _, i in children])))

    def names(self, path: str) -> Sequence[tuple[str, bool, int]]:
        s, folder = self._folder_of(path)
        if s is None:
            return super().names(path)
        listing = self.folders.get(s, folder)
        if listing is not None:
            return listing
        table = self.table(s)
        if not folder and table.flat:  # a flat shard folder: its table as it is
            listing = Listing(self.table, s, len(table), None, 0)
        else:
            rows = np.array([i for _, i in table.children(folder)], dtype=np.uint32)
            listing = Listing(self.table, s, len(rows), rows, len(folder.encode("utf-8")) + 1 if folder else 0)
        self.folders.remember(s, folder, listing)
        return listing.view()

    def known_entries(self, path: str, start: int = 0, stop: int | None = None) -> Sequence[Entry | None]:
        listing = self.names(path)
        if not isinstance(listing, Listing):  # the root, or a folder above shards
            return super().known_entries(path, start, stop)
        start, stop, _ = slice(start, stop).indices(len(listing))
        # Entries of the rows whose sizes the table knows (a stored table, or files
        # looked up since); not of unreadable files, whose lookups must fail.
        s = listing.shard
        return row_entries(self.table(s), s, listing.rows(start, max(start, stop)),
                           self.placement.shard_entries[s].mtime, known_only=True)

    def _folder_of(self, path: str) -> tuple[int | None, str]:
        """(shard position, folder inside it) of the folder ``path``; (None, folder above
        shards, "" for the root) if it is not inside a shard."""
        if not self.lookup(path).is_dir:
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        s, rest, above = self.placement.split(path)
        return (s, rest) if s is not None else (None, above)

    def members(self, path: str) -> Iterator[tuple[str, Entry]]:
        s, folder = self._folder_of(path)
        if s is None:
            yield from super().members(path)
            return
        table = self.table(s)
        prefix = f"{folder}/" if folder else ""
        rows = [i for i in table.example_order() if table.entry_path(i).startswith(prefix)] if prefix else \
            table.example_order()
        path, cut = table.entry_path, len(prefix)
        for start in range(0, len(rows), MEMBERS_BATCH):  # entries a batch at a time: sizing encodes their blocks
            batch = rows[start:start + MEMBERS_BATCH]
            unreadable = np.flatnonzero(table.kind[batch] == UNREADABLE)
            if len(unreadable):
                raise eio(self.blocks.failure(s, int(table.block[batch[int(unreadable[0])]])))
            for i, entry in zip(batch, self._entries(s, table, batch)):
                yield path(i)[cut:], entry

    def member_files(self, path: str) -> Iterator[tuple[str, Entry, bytes | None]]:
        s, folder = self._folder_of(path)
        if s is None or folder or self.tables.tables.get(s) is not None:
            yield from super().member_files(path)  # a sub-folder, or a table at hand: by the table
            return
        mtime = self.placement.shard_entries[s].mtime
        for name, data in shard_files(self.tables, s):  # a whole shard: block by block, no table built
            yield name, Entry(False, len(data), mtime, 0), data

    def read(self, entry: Entry, offset: int, size: int) -> bytes:
        ref = entry.ref
        if ref is None:
            raise OSError(errno.EISDIR, os.strerror(errno.EISDIR))
        if (ref.shard, ref.block) not in self.blocks.cache:
            table = self.tables.tables.get(ref.shard)
            if table is None:  # let go since its lookup: mapped again (no pass: it was checked)
                table = self.table(ref.shard)
            data = self.located.read(table, entry, ref, offset, size)
            if data is not None:
                return data[offset:offset + size]
        files = self.blocks.encoded_example(ref.shard, ref.block, ref.pos)
        if ref.file >= len(files) or len(files[ref.file]) != entry.size:
            # only if the dataset changed under us, or a stored table lies
            raise self.blocks.mismatch(ref.shard, ref.block)
        return files[ref.file][offset:offset + size]

    def shard_folders(self) -> list[str]:
        return list(self.placement.by_name)  # in shard order; a shard left out is not there

    def total_bytes(self) -> int:
        return sum(shard.data_size for shard in self.shards)

    def _entries(self, s: int, table: FileTable, rows: list[int]) -> list[Entry]:
        """The entries of table rows ``rows``, their sizes filled in first."""
        if not rows:
            return []
        self.tables.fill_sizes(s, table, rows)
        mtime = self.placement.shard_entries[s].mtime
        if len(rows) == 1:  # a lookup
            return [row_entry(table, s, rows[0], mtime)]
        return row_entries(table, s, rows, mtime)  # type: ignore[return-value]
