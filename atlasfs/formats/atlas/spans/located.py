"""The shard's side of located reads: :class:`LocatedReads`, mixed into an Atlas
:class:`~atlasfs.formats.atlas.dataset.Shard` (a :class:`BlockStore`), gives the tree
``file_spans`` and ``read_span`` from the finding (:mod:`.find`), reading (:mod:`.read`)
and caches (:mod:`.payloads`) of this package."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import zstandard

from atlasfs.formats.atlas.meta import CompressionStrategy
from atlasfs.formats.atlas.spans.find import block_fingerprint, file_locators, stored_crc
from atlasfs.formats.atlas.spans.fingerprints import StoredFingerprints, file_identity
from atlasfs.formats.atlas.spans.payloads import JUST_DECODED, PAYLOADS
from atlasfs.formats.atlas.spans.read import BlockReader, StoredBlock, read_span, run_in, stored_fingerprint
from atlasfs.formats.source import Locator, NativeSpans, SpanMismatch
from atlasfs.storage import open_regular

#: Most stored bytes of a block that :meth:`LocatedReads.read_spans` reads whole once for all
#: the files asked of it (a larger block is read a file at a time, as :meth:`read_span` reads).
PASS_READ_BYTES = 2 << 20


@runtime_checkable
class BlockStore(Protocol):
    """What :class:`LocatedReads` needs of the shard it is mixed into (an Atlas
    :class:`~atlasfs.formats.atlas.dataset.Shard`): where its blocks are and how to read
    them. ``tests/unit/tree/test_located.py`` checks that a shard is one."""

    data_path: str
    index_path: str
    index: np.ndarray  # block ``b``'s stored bytes are ``index[b]:index[b + 1]`` of data.bin
    codec: Any  # its BlockCodec: strategy, dictionary, bounds, decompress

    @property
    def num_blocks(self) -> int: ...

    def block_where(self, block: int) -> str: ...

    def check_unchanged(self) -> None: ...

    def read_raw(self, block: int) -> bytes: ...

    def read_range(self, block: int, offset: int, size: int) -> bytes: ...


class LocatedReads:
    """:meth:`~atlasfs.formats.source.SourceShard.file_spans` and
    :meth:`~atlasfs.formats.source.SourceShard.read_span` for an Atlas
    :class:`~atlasfs.formats.atlas.dataset.Shard` (mixed into it, so that the
    reader module keeps only what reads blocks): the shard must be a :class:`BlockStore`."""

    def _payload_key(self, block: int) -> tuple[Any, ...]:
        shard = cast(BlockStore, self)
        return (shard.data_path, shard.index_path, block, int(shard.index[block]), int(shard.index[block + 1]))

    def payload_keeper(self, block: int) -> Callable[[bytes], None] | None:
        """What keeps a compressed block's decompressed pickle once decoded (in
        :data:`JUST_DECODED`): :meth:`file_spans`, which the tree asks next when it builds a
        table, then searches it without decompressing the block again."""
        shard = cast(BlockStore, self)
        if shard.codec.strategy == CompressionStrategy.NO_COMPRESSION:
            return None  # its stored bytes are its pickle: read again in place
        return functools.partial(JUST_DECODED.put, self._payload_key(block))

    def kept_payload(self, block: int) -> bytes | None:
        """The decompressed pickle of ``block`` if a located read or a decode made it a moment
        ago (in :data:`PAYLOADS`, which holds whole blocks only), checked unchanged on disk:
        a decode then only unpickles it."""
        shard = cast(BlockStore, self)
        if shard.codec.strategy == CompressionStrategy.NO_COMPRESSION:
            return None
        if isinstance(shard.index, np.memmap):  # first: a mapped index.npy truncated since open would raise SIGBUS
            shard.check_unchanged()
        payload = PAYLOADS.get(self._payload_key(block))
        if payload is not None:
            shard.check_unchanged()
        return payload

    def file_spans(self, block: int, fields: list[list[tuple[str, Any]]]) -> list[list[Locator | None]] | None:
        """The block's decompressed pickle (kept by its decode, or read and decompressed
        again) is searched; nothing is unpickled."""
        shard = cast(BlockStore, self)
        where = shard.block_where(block)
        codec = shard.codec
        if codec.strategy == CompressionStrategy.NO_COMPRESSION:
            raw = shard.read_raw(block)
            return file_locators(raw, fields, block_fingerprint(raw, codec.strategy))
        shard.check_unchanged()
        length = int(shard.index[block + 1]) - int(shard.index[block])
        head = shard.read_range(block, 0, 18)
        content_size = codec.check_header(head, where)
        payload = JUST_DECODED.get(self._payload_key(block)) or PAYLOADS.get(self._payload_key(block))
        raw = None
        if payload is None or len(payload) != content_size:  # not kept whole: decompressed again
            raw = shard.read_raw(block)
            payload = codec.decompress(raw, where)
        if zstandard.get_frame_parameters(head).has_checksum and length >= 4:
            fingerprint = int.from_bytes(shard.read_range(block, length - 4, 4), "little")
        else:  # no checksum: the CRC-32 of the stored bytes, whatever the block's size
            fingerprint = stored_crc(raw if raw is not None else shard.read_raw(block))
        return file_locators(payload, fields, fingerprint)

    def native_spans(self) -> NativeSpans | None:
        """A local shard's blocks for the native engine's located reads (its checks are
        :func:`read_span`'s); None from a store, or when a file or the dictionary cannot be had
        (every located read is then :meth:`read_span`'s, which says why)."""
        shard = cast(Any, self)
        if shard.storage.remote:
            return None
        data, index = shard._signature
        if data is None or index is None:
            return None
        codec = shard.codec
        try:
            dictionary = codec.dictionary.data() if codec.dictionary is not None else None
            # the file the link rule approves (storage.links): the engine opens data.bin by its
            # path and reads only if it opened this same file (a link swapped since is refused)
            fd, st = open_regular(shard.data_path)
            os.close(fd)
        except Exception:  # noqa: BLE001 (read_span meets the same error and says it)
            return None
        return NativeSpans(shard.data_path, shard.index_path, (data[0], data[1], index[0], index[1]),
                           np.ascontiguousarray(shard.index, dtype=np.uint64),
                           codec.strategy != CompressionStrategy.NO_COMPRESSION, dictionary, codec.max_block_bytes,
                           (st.st_dev, st.st_ino))

    def _stored_fingerprint(self, block: int, reader: BlockReader) -> int | None:
        """The CRC-32 of ``block``'s stored bytes, read whole once and remembered while data.bin
        stays the same file (:class:`StoredFingerprints`: 8 bytes a block of the shard)."""
        shard = cast(Any, self)
        fingerprints = getattr(self, "_fingerprints", None)
        if fingerprints is None:  # made once a shard; two threads making it at once lose an entry
            fingerprints = self._fingerprints = StoredFingerprints(shard.num_blocks)
        identity = file_identity(shard.data_path, shard._data)  # noqa: SLF001 (the storage its reads go through)
        return fingerprints.get(block, identity, functools.partial(stored_fingerprint, reader, shard.codec))

    def read_span(self, block: int, locator: Locator, size: int, scratch: Any = None) -> bytes | None:
        """A pread of the run (strategy 0, or raw zstd blocks), the frame decompressed up to
        the run's end with a pooled context, or for an inline file the block's fingerprint:
        checked against the locator either way. Nothing is unpickled. What was decompressed
        is kept in ``scratch`` (the tree's cache), or without one in :data:`PAYLOADS`."""
        shard = cast(BlockStore, self)
        where = shard.block_where(block)
        if locator.size != size:
            raise SpanMismatch(f"{where}: a locator of {locator.size} bytes for a file of {size}")
        if not 0 <= block < shard.num_blocks:
            raise SpanMismatch(f"{where}: no such block")
        # As for any read that needs the disk: a data.bin or index.npy changed since the
        # dataset was opened fails the read (EIO through the block path), rather than mixing.
        shard.check_unchanged()
        start, end = int(shard.index[block]), int(shard.index[block + 1])
        reader = BlockReader(functools.partial(shard.read_range, block), end - start)
        codec = shard.codec
        if locator.inline:
            return read_span(reader, locator, codec, where, fingerprint=functools.partial(
                self._stored_fingerprint, block, reader))
        if locator.length == 0 or codec.strategy == CompressionStrategy.NO_COMPRESSION:
            return read_span(reader, locator, codec, where)
        # A run inside a compressed block: read_span takes the run alone if the zstd blocks
        # over it are stored raw; else the block is decompressed whole, once, and kept (the
        # tree's scratch for this block, within its cache bound; and PAYLOADS, where a decode
        # of the block for a file without a locator finds it). Decompressing only up to the
        # run's end costs half a block on average, but random readers come back to a block:
        # in the benchmark's cold pass (8-16 reads a block) a first partial decompression and
        # a later whole one or a decode cost 20-30% more in all than one whole decompression.
        key = self._payload_key(block)
        kept = scratch.get() if scratch is not None else None
        if kept is None:
            kept = PAYLOADS.get(key)
        if kept is not None:
            return run_in(locator, kept, where)

        def decompress_whole() -> bytes:
            payload = codec.decompress(shard.read_raw(block), where)  # bounds checked as any block's
            PAYLOADS.put(key, payload)
            if scratch is not None:
                scratch.put(payload)
            return payload

        return read_span(reader, locator, codec, where, whole=decompress_whole)

    def read_spans(self, block: int, spans: Sequence[Locator]) -> list[bytes]:
        """:meth:`read_span` of each of ``spans`` (of one ``block``, each checked against its
        locator as there) for a pass over the shard in order (the tar view's): the block's
        stored bytes read once for all of them (within :data:`PASS_READ_BYTES`, a
        :class:`~.read.StoredBlock`; else a read a file) and data.bin's identity checked once, after the reads, which that
        check covers: a data.bin changed before or while they read fails them all, so no file
        of a batch comes from a data.bin that changed since it was opened (plus one check
        before, which a mapped index.npy needs). Nothing is kept for later reads."""
        shard = cast(BlockStore, self)
        where = shard.block_where(block)
        if not 0 <= block < shard.num_blocks:
            raise SpanMismatch(f"{where}: no such block")
        shard.check_unchanged()  # first: a mapped index.npy truncated since open would raise SIGBUS
        start, end = int(shard.index[block]), int(shard.index[block + 1])
        length, codec = end - start, shard.codec
        read_at = functools.partial(shard.read_range, block)
        if length <= PASS_READ_BYTES:  # the files' runs are most of it (stored as they are)
            source = stored = StoredBlock(read_at, length, where)

            def raw() -> bytes:
                return b"".join(stored.pieces)
        else:
            source = BlockReader(read_at, length)

            def raw() -> bytes:
                return shard.read_raw(block)
        # each made at most once a batch (a run not stored raw after all: the payload)
        fingerprint = functools.cache(functools.partial(self._stored_fingerprint, block, source))
        payload = functools.cache(lambda: codec.decompress(raw(), where))
        strategy0 = codec.strategy == CompressionStrategy.NO_COMPRESSION
        files = []
        for locator in spans:
            if locator.inline:
                files.append(read_span(source, locator, codec, where, fingerprint=fingerprint))
            elif locator.length == 0 or strategy0:
                files.append(read_span(source, locator, codec, where))
            else:
                files.append(read_span(source, locator, codec, where, whole=payload))
        shard.check_unchanged()  # after the reads: none of them is of a changed data.bin
        return files
