"""The tree of an Atlas dataset: one folder per shard, WebDataset-style files inside.

Files are named and encoded by :mod:`atlasfs.naming`. A shard's file table
(names, sizes, block and position of every file) is built the first time the
shard is looked into, by decoding its blocks once; file bytes are then served
from a cache of encoded blocks bounded in bytes, re-decoding evicted blocks.

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
from dataclasses import dataclass
from typing import Any

from .blockcache import BlockCache
from .dataset import DEFAULT_CACHE_BYTES, AtlasDataset, BrokenShard
from .errors import AtlasFormatError
from .naming import MAX_NAME_BYTES, NO_KEY, KeyAssigner, declared_key, example_files, index_key_width
from .tree import Entry, Tree, not_found, split_path

log = logging.getLogger("atlasfs")

#: Suffix of the entries standing for examples of a block that cannot be decoded.
UNREADABLE_SUFFIX = "unreadable"


@dataclass(frozen=True)
class EncodedExample:
    """One example as files: suffixes and bytes in listing order."""

    declared_key: object
    suffixes: tuple[str, ...]
    data: tuple[bytes, ...]
    note: str | None


@dataclass(frozen=True)
class FileRef:
    """Where a file's bytes come from: shard position, block, example in block, file of example."""

    shard: int
    block: int
    pos: int
    file: int


@dataclass(frozen=True)
class Unreadable:
    """Stands for an example whose block failed to decode."""

    reason: str


class ShardTable:
    """Every folder and file of one shard, by path relative to the shard folder."""

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.children: dict[str, list[tuple[str, Entry]]] = {"": []}


def _eio(message: str) -> OSError:
    return OSError(errno.EIO, message)


class AtlasTree(Tree):
    """A :class:`Tree` over an open :class:`AtlasDataset`."""

    def __init__(self, dataset: AtlasDataset, cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.dataset = dataset
        self.width = index_key_width(len(dataset))
        # A field suffix must fit beside the shortest key, the index key.
        self.max_suffix_bytes = MAX_NAME_BYTES - 1 - self.width
        self.cache: BlockCache[list[EncodedExample]] = BlockCache(cache_bytes)
        self._shard_by_name = {shard.name: s for s, shard in enumerate(dataset.shards)}
        self._tables: dict[int, ShardTable] = {}
        self._table_locks = [threading.Lock() for _ in dataset.shards]
        self._failed: dict[tuple[int, int], str] = {}
        self._failed_lock = threading.Lock()
        self._root = Entry(True, 0, os.stat(os.path.join(dataset.root, "meta.json")).st_mtime, 1)
        self._shard_entries = [
            Entry(True, 0, shard.mtime, (s + 1) << 32) for s, shard in enumerate(dataset.shards)]

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
        entry = self._table(s).entries.get("/".join(parts[1:]))
        if entry is None:
            raise not_found(path)
        if isinstance(entry.ref, Unreadable):
            raise _eio(entry.ref.reason)
        return entry

    def listdir(self, path: str) -> list[tuple[str, Entry]]:
        parts = split_path(path)
        if not parts:
            return [(shard.name, self._shard_entries[s]) for s, shard in enumerate(self.dataset.shards)]
        entry = self.lookup(path)
        if not entry.is_dir:
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
        s = self._shard_by_name[parts[0]]
        return self._table(s).children["/".join(parts[1:])]

    def read(self, entry: Entry, offset: int, size: int) -> bytes:
        ref = entry.ref
        if isinstance(ref, Unreadable):
            raise _eio(ref.reason)
        data = self.encoded_block(ref.shard, ref.block)[ref.pos].data[ref.file]
        if len(data) != entry.size:  # cannot happen unless the dataset changed under us
            raise _eio(f"{self.dataset.shards[ref.shard].path}: block {ref.block} no longer matches its file table")
        return data[offset:offset + size]

    def total_bytes(self) -> int:
        return sum(shard.data_size for shard in self.dataset.shards)

    # -- blocks

    def encoded_block(self, s: int, block: int) -> list[EncodedExample]:
        """The examples of a block as files, through the bounded cache.

        A block that fails to decode raises ``OSError(EIO)`` and is logged
        once; later requests fail the same way without decoding it again.
        """
        failed = self._failed.get((s, block))
        if failed is not None:
            raise _eio(failed)
        return self.cache.get((s, block), lambda: self._encode_block(s, block))

    def _encode_block(self, s: int, block: int) -> tuple[list[EncodedExample], int]:
        shard = self.dataset.shards[s]
        limit = shard.codec.max_block_bytes
        try:
            examples, _ = shard.decode_block(block)
            encoded = []
            total = 0
            for example in examples:
                encoded.append(self._encode_example(example))
                total += sum(len(d) for d in encoded[-1].data)
                if total > limit:  # shared references can make files far larger than the pickle
                    raise AtlasFormatError(
                        f"{shard.data_path} block {block}: its files would take more than {limit} bytes")
        except AtlasFormatError as exc:
            raise self._fail(s, block, str(exc)) from None
        except Exception as exc:  # an example the encoders cannot handle
            raise self._fail(s, block, f"{shard.data_path} block {block}: cannot encode example ({exc!r})") from None
        cost = sum(len(d) + 100 for e in encoded for d in e.data)
        return encoded, cost

    def _encode_example(self, example: Any) -> EncodedExample:
        files, note = example_files(example, self.max_suffix_bytes)
        return EncodedExample(declared_key(example), tuple(f[0] for f in files), tuple(f[1] for f in files), note)

    def _fail(self, s: int, block: int, message: str) -> OSError:
        """Remember and log (once) that block ``block`` of shard ``s`` (-1: the whole shard) fails."""
        with self._failed_lock:
            if (s, block) not in self._failed:
                self._failed[(s, block)] = message
                log.error("%s (its files fail with EIO)", message)
        return _eio(message)

    # -- file tables

    def _table(self, s: int) -> ShardTable:
        shard = self.dataset.shards[s]
        if isinstance(shard, BrokenShard):
            raise self._fail(s, -1, str(shard.error))
        table = self._tables.get(s)
        if table is None:
            with self._table_locks[s]:
                table = self._tables.get(s)
                if table is None:
                    table = self._tables[s] = self._build_table(s)
        return table

    def _build_table(self, s: int) -> ShardTable:
        shard = self.dataset.shards[s]
        mtime = shard.mtime
        assigner = KeyAssigner(self.width)
        first_index = self.dataset.shard_start(s)
        table = ShardTable()
        next_ino = ((s + 1) << 32) + 1

        def add(path: str, entry_for: Any) -> None:
            nonlocal next_ino
            parent, _, name = path.rpartition("/")
            if parent and parent not in table.entries:
                add(parent, None)
            if entry_for is None:  # an implied folder
                entry = Entry(True, 0, mtime, next_ino)
                table.children[path] = []
            else:
                entry = entry_for(next_ino)
            next_ino += 1
            table.entries[path] = entry
            table.children[parent].append((name, entry))

        for block in range(shard.num_blocks):
            base = first_index + block * shard.meta.block_size
            try:
                examples = self.encoded_block(s, block)
            except OSError as exc:
                reason = exc.strerror or str(exc)
                for pos in range(shard.block_length(block)):
                    key, _ = assigner.assign(NO_KEY, base + pos, 0)
                    add(f"{key}.{UNREADABLE_SUFFIX}", lambda ino: Entry(False, 0, mtime, ino, Unreadable(reason)))
                continue
            for pos, example in enumerate(examples):
                longest = max(len(x.encode("utf-8")) for x in example.suffixes)
                key, note = assigner.assign(example.declared_key, base + pos, longest)
                for message in (note, example.note):
                    if message:
                        log.info("%s example %d: %s", shard.path, base + pos, message)
                for j, (suffix, data) in enumerate(zip(example.suffixes, example.data)):
                    ref = FileRef(s, block, pos, j)
                    add(f"{key}.{suffix}", lambda ino, r=ref, n=len(data): Entry(False, n, mtime, ino, r))
        for children in table.children.values():
            children.sort(key=lambda item: item[0].encode("utf-8"))
        return table
