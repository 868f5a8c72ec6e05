"""Blocks of samples through the tree's cache: decoded once, their examples encoded as
files when first read, failures remembered, the next blocks read ahead for readers
going through a shard in order, and freed memory handed back after evictions.

A block that cannot be decoded is logged once; later requests for it fail with EIO
without decoding it again. A store that does not answer is not remembered: the next
read tries again.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from atlasfs import memory
from atlasfs.blockcache import BlockCache
from atlasfs.errors import AtlasFormatError
from atlasfs.formats.naming import MAX_NAME_BYTES, encode_as, example_fields
from atlasfs.formats.source import SourceShard
from atlasfs.storage import StorageUnavailableError
from atlasfs.tree.base import Unreadable
from atlasfs.tree.readahead import ReadAhead

log = logging.getLogger("atlasfs")

#: Blocks decoded, and their examples encoded, ahead of a reader going through a shard in order...
READ_AHEAD_BLOCKS = 2
#: ...once it has used this many blocks in a row (starting at a shard's first block counts as
#: one more: readers that start there usually go through). Random readers land on the block
#: after the one before now and then, but seldom twice running.
READ_AHEAD_AFTER = 3
#: Blocks stored in more than this share of the cache bound are not read ahead: decoded, two
#: of them could push out the block being read.
READ_AHEAD_MAX_SHARE = 16
#: Blocks decoded at once (by the readers' threads and read-ahead together).
DECODERS = 2
#: The freed memory is given back to the system once blocks costing half the cache bound,
#: and at least this much, have been evicted since the last time (and at most twice a second).
TRIM_AFTER_MIN = 4 << 20


class Block:
    """A decoded block in the cache: its examples, their files as named when the
    block's file table rows were built (if it was decoded for that), and each
    example's file bytes once encoded (in the order of :func:`~atlasfs.formats.naming.example_fields`)."""

    __slots__ = ("encoded", "encoded_bytes", "examples", "fields")

    def __init__(self, examples: list[Any]) -> None:
        self.examples = examples
        self.fields: list[list[tuple[str, Any]]] | None = None  # saves naming them again to encode them
        self.encoded: list[tuple[bytes, ...] | None] = [None] * len(examples)
        self.encoded_bytes = 0  # bytes of the files encoded so far


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


def log_unavailable(exc: StorageUnavailableError) -> None:
    """Log a store that does not answer, at most once every 10 seconds (an outage fails
    every read; one line says it)."""
    now = time.monotonic()
    if now - _unavailable_logged[0] >= 10:
        _unavailable_logged[0] = now
        log.error("%s (reads fail with EIO until it answers; nothing is remembered as broken)", exc)


def eio(message: str) -> OSError:
    """The error of data that is bad (:class:`~atlasfs.tree.base.Unreadable`, EIO)."""
    return Unreadable(message)


def max_suffix_bytes(shard: SourceShard) -> int:
    """Longest field suffix a shard's files may have: it must fit beside the shortest key, the index key."""
    return MAX_NAME_BYTES - 1 - shard.key_width



class Blocks:
    """The blocks of a source's shards through one cache bounded in bytes."""

    def __init__(self, shards: Sequence[SourceShard], cache_bytes: int, log_failures: bool = True) -> None:
        self.shards = shards
        self.log_failures = log_failures
        self.cache: BlockCache[Any] = BlockCache(cache_bytes)
        self.failed: dict[tuple[int, int], str] = {}
        self._failed_lock = threading.Lock()
        # The last block each shard's readers used, and how many blocks in order led
        # there (see READ_AHEAD_AFTER).
        self.last_block = [(-1, 1)] * len(shards)
        self.readahead = ReadAhead(self._read_ahead) if cache_bytes > 0 else None
        # A block being decoded is not in the cache yet: its compressed bytes, its pickle
        # and its objects, about three times its size. Every thread of a mount could be
        # decoding one; this many at once keep both cores busy and bound that memory.
        self.decoders = threading.BoundedSemaphore(DECODERS)
        # Evicted bytes when the freed memory was last given back, and how many more call for it.
        self._trimmed_at = 0
        self._trim_after = max(TRIM_AFTER_MIN, cache_bytes // 2)

    def decoded(self, s: int, block: int) -> Block:
        """A block through the cache: its decoded examples, and those encoded so far.

        A block that fails to decode raises ``OSError(EIO)`` and is logged
        once; later requests fail the same way without decoding it again.
        """
        failed = self.failed.get((s, block))
        if failed is not None:
            raise eio(failed)
        decoded = self.cache.get((s, block), lambda: self._decode(s, block))
        if self.cache.evicted_bytes - self._trimmed_at >= self._trim_after:
            self._give_back()
        return decoded

    def decoded_outside(self, s: int, block: int) -> tuple[Block, int | None]:
        """A block as :meth:`decoded` gives it, but one not in the cache is decoded outside it
        (counted as the cache's miss) and returned with its cost, for the caller to cache
        (``cache.put``) or let go; the cost is None for a block the cache held."""
        decoded = self.cache.peek((s, block))
        if decoded is not None:
            return decoded, None
        failed = self.failed.get((s, block))
        if failed is not None:
            raise eio(failed)
        decoded, cost = self._decode(s, block)
        self.cache.misses += 1  # a decode the cache did not spare, counted as its own are
        return decoded, cost

    def _give_back(self) -> None:
        """Hand the pages freed by evictions back to the system (:func:`atlasfs.memory.trim`).

        Freed blocks leave holes in the allocator's arenas that later blocks only partly
        fill, one set per arena (each thread of a mount allocates in its own): without
        this a mount with an 8 MiB cache grew to ~2.5 times what it held
        (docs/performance.md, "Memory")."""
        self._trimmed_at = self.cache.evicted_bytes
        memory.trim()

    def _decode(self, s: int, block: int) -> tuple[Block, int]:
        shard = self.shards[s]
        try:
            with self.decoders:
                examples, nbytes = shard.decode_block(block)
        except StorageUnavailableError as exc:  # the store, not the block: not remembered, tried again next read
            log_unavailable(exc)
            raise
        except AtlasFormatError as exc:
            raise self.fail(s, block, str(exc)) from None
        except Exception as exc:  # the source reports what it knows; anything else still only fails this block
            raise self.fail(s, block, f"{shard.block_where(block)}: cannot decode ({exc!r})") from None
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
        self.reading(s, block)
        return self.example_of(self.decoded(s, block), s, block, pos)

    def reading(self, s: int, block: int) -> None:
        """Note that a reader uses block ``block`` of shard ``s``; once it has gone through
        :data:`READ_AHEAD_AFTER` blocks in order, read the next ones ahead."""
        last, run = self.last_block[s]
        if block == last:
            return
        run = run + 1 if block == last + 1 else 1
        self.last_block[s] = (block, run)  # threads may race here: at worst a hint is missed or repeated
        if run >= READ_AHEAD_AFTER and self.readahead is not None:
            end = min(block + 1 + READ_AHEAD_BLOCKS, self.shards[s].num_blocks)
            self.readahead.hint([(s, b) for b in range(block + 1, end)])

    def _read_ahead(self, key: Any) -> None:
        """Decode block ``key = (shard, block)`` into the cache and encode its examples."""
        s, block = key
        if self.shards[s].stored_block_size(block) * READ_AHEAD_MAX_SHARE > self.cache.max_bytes:
            return
        decoded = self.decoded(s, block)
        for pos in range(len(decoded.examples)):
            self.example_of(decoded, s, block, pos)

    def example_of(self, decoded: Block, s: int, block: int, pos: int) -> tuple[bytes, ...]:
        """The files of example ``pos`` of the decoded block, encoded (and kept) if not yet."""
        if pos >= len(decoded.examples):
            raise self.mismatch(s, block)
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
                example, max_suffix_bytes(shard))[0]
            files = [(suffix, encode_as(suffix, value)) for suffix, value in fields]
        except Exception as exc:  # an example the encoders cannot handle
            raise self.fail(s, block, f"{shard.block_where(block)}: cannot encode example {pos} ({exc!r})") from None
        decoded.encoded_bytes += sum(len(data) for _, data in files)
        limit = shard.max_block_bytes
        if decoded.encoded_bytes > limit:  # shared references can make files far larger than the pickle
            raise self.fail(s, block, f"{shard.block_where(block)}: its files would take more than {limit} bytes")
        values = example.values() if isinstance(example, dict) else (example,)
        shared = {id(value) for value in values if type(value) is bytes}
        cost = sum(len(data) for _, data in files if id(data) not in shared) + 100 * len(files)
        return tuple(data for _, data in files), cost

    def fail(self, s: int, block: int, message: str) -> OSError:
        """Remember and log (once) that block ``block`` of shard ``s`` (-1: the whole shard) fails."""
        with self._failed_lock:
            if (s, block) not in self.failed:
                self.failed[(s, block)] = message
                if self.log_failures:
                    what = f"shard {self.shards[s].name} fails" if block < 0 else "its files fail"
                    log.error("%s (%s with EIO)", message, what)
        return eio(message)

    def failures(self, s: int) -> list[str]:
        """What is known to fail in shard position ``s``, one line each: the whole shard's
        cause, or each failed block's (a block not decoded yet is not known)."""
        with self._failed_lock:
            return [message for (shard, _), message in sorted(self.failed.items()) if shard == s]

    def mismatch(self, s: int, block: int) -> OSError:
        """The error for a block whose examples are not what the file table says (only if
        the dataset changed under us, or a stored table lies)."""
        return eio(f"{self.shards[s].block_where(block)}: does not match its file table")

    def failure(self, s: int, block: int) -> str:
        """Why block ``block`` of shard ``s`` fails."""
        return self.failed.get((s, block), f"{self.shards[s].block_where(block)} cannot be decoded")
