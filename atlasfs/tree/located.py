"""Located reads: a random read of a file whose block is not cached, served from where the
file's bytes lie without decoding the block (issue #18).

While a table is built from a decoded block, the source may say where each file's bytes
can be had without decoding it (:meth:`~atlasfs.formats.source.SourceShard.file_spans`:
an Atlas file's run in the decompressed block, or a small file's bytes themselves); the
table keeps those locators. A read of a file whose block is not cached, by a reader not
going through the shard in order, asks the source for the bytes there
(:meth:`~atlasfs.formats.source.SourceShard.read_span`), which checks them; anything
else, or a check that fails (logged once per block), takes the block path. Either way
the bytes are those the block path gives.

A pass over a shard in order (the tar view's, :meth:`LocatedReads.block_in_pass`) reads its
files through their locators too where the block stores their runs as they are (incompressible
files: the block's stored bytes read once for its files and sliced beats reading, decompressing
and unpickling it), a block's files together; elsewhere it keeps the block path and its read-ahead.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from atlasfs.blockcache import BlockCache
from atlasfs.errors import AtlasFormatError
from atlasfs.formats.source import Locator, SpanMismatch
from atlasfs.storage import StorageUnavailableError
from atlasfs.tree.base import Entry
from atlasfs.tree.blocks import Blocks, log_unavailable
from atlasfs.tree.listing import FileRef
from atlasfs.tree.table.filetable import FileTable
from atlasfs.tree.table.layout import KEPT, NO_LOCATOR, shard_ino

log = logging.getLogger("atlasfs")

#: Bytes of recently located files kept for the read requests that follow the first (a
#: file larger than one request, read without its block, is located once, not per request).
LOCATED_KEEP_BYTES = 8 << 20


class _Scratch:
    """A block's :class:`~atlasfs.formats.source.Scratch`: a value kept in the tree's block
    cache under ``(shard, block, "scratch")``, charged its length (so that located reads'
    scratch and decoded blocks share the one bound)."""

    __slots__ = ("_cache", "_key")

    def __init__(self, cache: BlockCache[object], key: tuple[int, int, str]) -> None:
        self._cache = cache
        self._key = key

    def get(self) -> bytes | None:
        return self._cache.peek(self._key)

    def put(self, value: bytes) -> None:
        self._cache.put(self._key, value, len(value) + 100)


class LocatedReads:
    """When to read a file through its locator, and the bytes kept for a big file's next requests."""

    def __init__(self, blocks: Blocks) -> None:
        self.blocks = blocks
        # Blocks whose located reads failed their source's check: read through the block
        # from then on (logged once each).
        self._unlocated: set[tuple[int, int]] = set()
        # Recently located files larger than the request that located them: inode -> bytes.
        self._kept: OrderedDict[int, bytes] = OrderedDict()
        self._kept_bytes = 0
        self._lock = threading.Lock()
        # Per shard, which blocks hold their files' runs as they are (block_in_pass): shard -> bools.
        self._as_is: dict[int, np.ndarray] = {}
        #: Whether random reads of files whose blocks are not cached go through their
        #: locators (tests of the block path turn it off).
        self.enabled = True
        #: Reads served through a locator, and located reads that fell back to the block (for
        #: tests and benchmarks; threads may race on them: approximate).
        self.reads = 0
        self.fallbacks = 0
        #: Of :attr:`reads`, those of a pass over a shard in order (:meth:`block_in_pass`).
        self.pass_reads = 0

    def read(self, table: FileTable | None, entry: Entry, ref: FileRef, offset: int, size: int) -> bytes | None:
        """The whole file through its locator (its block is not cached), or None: no
        locator, a reader going through the shard in order (it keeps the block path and
        its read-ahead), or a check that failed (then logged once for the block)."""
        if offset:  # a later request of a big file located by its first one
            with self._lock:
                kept = self._kept.get(entry.ino)
            if kept is not None:
                if offset + size >= len(kept):
                    self._forget(entry.ino)
                return kept
            return None  # its first request did not keep it: the block serves the rest
        if size < entry.size and entry.size > LOCATED_KEEP_BYTES // 4:
            return None  # too big to keep for its next requests: each would read it whole again
        s, block = ref.shard, ref.block
        last, run = self.blocks.last_block[s]
        # In order: the reader came from the block before this one's (or this one) and from
        # the one before that. A random reader lands next to its last block now and then
        # (1 in 15 on a shard of 30 blocks) but seldom twice running; each time it would
        # pay a whole block. A reader in order pays one located read per shard at most.
        if (run >= 2 and (block == last or block == last + 1)) or (s, block) in self._unlocated:
            return None
        if not self.enabled or (s, block) in self.blocks.failed:  # a block known to fail fails all its files
            return None
        if table is None or table.locators is None:
            return None
        locator = _locator(table, entry, s, block)
        if locator is None:
            return None
        self.blocks.reading(s, block)
        data = self._read_span(s, block, locator, entry.size)
        if data is None:
            return None
        if offset + size < len(data) and len(data) <= LOCATED_KEEP_BYTES // 4:
            self._keep(entry.ino, data)
        return data

    def block_in_pass(self, table: FileTable | None, s: int, block: int,
                      entries: Sequence[Entry]) -> list[bytes | None] | None:
        """The files ``entries`` (consecutive files of block ``block`` of shard ``s``) for a pass
        over the shard in order (the tar view's, tree/tarstream.py) through their locators, when
        the block is not cached and holds its files' runs as they are (:meth:`stored_as_is`):
        instead of the block read, decompressed and unpickled (three copies of it, in memory the
        allocator maps afresh for each block), its stored bytes read once for all of them where
        the source can (:meth:`~atlasfs.formats.atlas.spans.located.LocatedReads.read_spans`,
        which checks that data.bin did not change once for all of them, after their reads),
        else one read each; unlike :meth:`read`, no read-ahead of blocks (the pass reads none).
        None in the list: a file without a locator (the block path). None: the block path for
        all of them (a compressed block, no locators, a check that failed: logged once for the
        block)."""
        if not self.enabled or table is None or table.locators is None:
            return None
        as_is = self.stored_as_is(s, table)
        if not (0 <= block < len(as_is) and as_is.item(block)):
            return None
        if (s, block) in self.blocks.cache or (s, block) in self._unlocated or (s, block) in self.blocks.failed:
            return None
        found = [_locator(table, entry, s, block) for entry in entries]
        located = [i for i, locator in enumerate(found) if locator is not None]
        if not located:
            return None
        locators = [found[i] for i in located]
        read_spans = getattr(self.blocks.shards[s], "read_spans", None)
        if read_spans is None:  # a source that reads a file at a time
            files: list[bytes] | None = []
            for i, locator in zip(located, locators):
                data = self._read_span(s, block, locator, entries[i].size)  # type: ignore[arg-type]
                if data is None:
                    return None
                files.append(data)  # type: ignore[union-attr]
        else:
            files = self._spans(s, block, lambda: read_spans(block, locators), [entries[i].size for i in located])
        if files is None:
            return None
        self.pass_reads += len(files)
        if len(files) == len(entries):
            return files
        out: list[bytes | None] = [None] * len(entries)  # a file without a locator: the block path
        for i, data in zip(located, files):
            out[i] = data
        return out

    def stored_as_is(self, s: int, table: FileTable) -> np.ndarray:
        """Per block of shard ``s``, whether it holds its files' runs as they are: some runs,
        and no fewer bytes stored than they add up to (a block whose runs are compressed
        stores fewer; a file in a run that is not stored raw after all is still read right,
        :meth:`~atlasfs.formats.source.SourceShard.read_span` decompresses the block once).
        None of a shard in a bucket (a request a file, where the block is one)."""
        as_is = self._as_is.get(s)
        if as_is is None:
            locators, shard = table.locators, self.blocks.shards[s]
            n = shard.num_blocks
            # from a bucket a pass reads whole blocks: a request a file would wait for each
            remote = getattr(getattr(shard, "storage", None), "remote", False)
            if locators is None or not n or remote:
                as_is = np.zeros(n, dtype=bool)
            else:
                # runs: a locator that is neither inline (INLINE) nor kept (KEPT) in the table
                runs = (locators.offset != NO_LOCATOR) & (locators.prefix < KEPT)
                run_bytes = np.bincount(table.block[runs].astype(np.int64), weights=locators.length[runs],
                                        minlength=n)[:n]
                stored = np.array([shard.stored_block_size(b) for b in range(n)], dtype=np.float64)
                as_is = (run_bytes > 0) & (stored >= run_bytes)
            self._as_is[s] = as_is  # threads may race here: they compute the same
        return as_is

    def known_as_is(self, s: int) -> np.ndarray | None:
        """:meth:`stored_as_is` of shard ``s`` if made already, else None."""
        return self._as_is.get(s)

    def _read_span(self, s: int, block: int, locator: Locator, size: int) -> bytes | None:
        """The file's bytes through its locator (checked by the source), or None: the source
        would rather decode the block, or the check failed (logged once for the block, whose
        files are read through it from then on)."""
        shard = self.blocks.shards[s]
        files = self._spans(s, block, lambda: [shard.read_span(
            block, locator, size, _Scratch(self.blocks.cache, (s, block, "scratch")))], [size])
        return None if files is None else files[0]

    def _spans(self, s: int, block: int, read: Callable[[], list[bytes | None]], sizes: list[int]) -> list[bytes] | None:
        """The files ``read()`` gives of block ``block`` of shard ``s`` (checked by the source; of
        ``sizes``), or None: the source would rather decode the block, or a check failed (logged
        once for the block, whose files are read through it from then on)."""
        shard = self.blocks.shards[s]
        try:
            files = read()
            if any(data is None for data in files):  # the source would rather have the block decoded
                return None
            for data, size in zip(files, sizes, strict=True):
                if len(data) != size:  # type: ignore[arg-type]
                    raise SpanMismatch(f"{shard.block_where(block)}: a located read gave {len(data)} bytes "  # type: ignore[arg-type]
                                       f"for a file of {size}")
        except Exception as exc:  # the block path decides: it serves, or fails with EIO and says why
            if isinstance(exc, StorageUnavailableError):  # transient, not remembered; the block path would
                log_unavailable(exc)                       # wait for the same store again: EIO now
                raise
            self.fallbacks += 1
            if (s, block) not in self._unlocated:
                self._unlocated.add((s, block))
                log.warning("%s; its files are read through the block from now on",
                            exc if isinstance(exc, AtlasFormatError) else f"{shard.block_where(block)}: {exc!r}")
            return None
        self.reads += len(files)
        return files  # type: ignore[return-value]

    def _keep(self, ino: int, data: bytes) -> None:
        with self._lock:
            if ino in self._kept:
                return
            self._kept[ino] = data
            self._kept_bytes += len(data)
            while self._kept_bytes > LOCATED_KEEP_BYTES:
                _, old = self._kept.popitem(last=False)
                self._kept_bytes -= len(old)

    def _forget(self, ino: int) -> None:
        with self._lock:
            old = self._kept.pop(ino, None)
            if old is not None:
                self._kept_bytes -= len(old)


def _locator(table: FileTable, entry: Entry, s: int, block: int) -> Locator | None:
    """The locator of ``entry``'s row in shard ``s``'s table, if the row is in ``block`` and
    its locator's size is the entry's; else None (the block path)."""
    row = entry.ino - shard_ino(s) - 1
    if not 0 <= row < len(table) or table.block.item(row) != block:
        return None
    locator = table.locator(row)
    if locator is None or locator.size != entry.size:
        return None
    return locator
