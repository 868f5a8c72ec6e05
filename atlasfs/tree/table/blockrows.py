"""A block's rows of its shard's file table: its examples named (by the source's index, or
decoded), their keys assigned, and their files located where the source can read them
without decoding (:meth:`~atlasfs.formats.source.SourceShard.file_spans`). A block that
cannot be decoded gives ``<index key>.unreadable`` rows."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.naming import NO_KEY, KeyAssigner, declared_key, example_fields
from atlasfs.formats.source import SourceShard
from atlasfs.storage import StorageUnavailableError
from atlasfs.tree.blocks import Block, Blocks, max_suffix_bytes
from atlasfs.tree.table.filetable import Rows
from atlasfs.tree.table.layout import FILE, UNKNOWN_SIZE, UNREADABLE

log = logging.getLogger("atlasfs")

#: (declared key, fields, note) of each example of a block, as :meth:`BlockRows._name_block` names them.
Named = list[tuple[object, list[tuple[str, Any]], "str | None"]]
#: Suffix of the entries standing for examples of a block that cannot be decoded.
UNREADABLE_SUFFIX = "unreadable"


class BlockRows:
    """The rows of each block of ``shards``, decoded through ``blocks`` where the source's
    index does not tell them (:meth:`block_rows`)."""

    def __init__(self, shards: Sequence[SourceShard], blocks: Blocks) -> None:
        self.shards = shards
        self.blocks = blocks

    def _describe_block(self, s: int, block: int) -> list[tuple[Any, list[tuple[str, int]]]] | None:
        """What :meth:`SourceShard.describe_block` tells of a block's samples; None if it tells nothing."""
        shard = self.shards[s]
        try:
            return shard.describe_block(block)
        except AtlasFormatError as exc:
            raise self.blocks.fail(s, block, str(exc)) from None

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
        if cached:
            decoded, cost = self.blocks.decoded(s, block), None
        else:
            decoded, cost = self.blocks.decoded_outside(s, block)
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
