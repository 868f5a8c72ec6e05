"""A shard's file table: every folder and file, compact, searchable, storable.

Entries are kept in *tree order*, the order a listing shows them and ``tar``
walks them: each folder's children in the order of the first example under
them (files of one example adjacent, in its fixed order), each sub-folder's
entries right after it. A shard without sub-folders is thus simply in
example order. Lookups go through an index of the paths' stable 64-bit hashes,
sorted, so they are a binary search and one comparison; a permutation sorting the
entries by path proves the paths unique. The table is a few numpy arrays and one
blob of names: 43 bytes per entry plus its path.

A table can be saved to a file and loaded back: the mount keeps one per
shard so that a second mount lists without decoding anything. A loaded table is
the file mapped, its arrays and names views of the map, nothing copied
(:mod:`atlasfs.tree.table.ondisk`, the format). It carries
its source's *state* too (what a pass over the shard's files learned, such
as Dolma's gzip seek points; :meth:`atlasfs.formats.source.SourceShard.prepare`),
so that the second mount makes no pass either. A stored table
is untrusted input (it may sit inside a downloaded dataset), so loading
validates every path and position before the table is used, and says why it
refuses one.

A table may also hold, per file, a *locator* from its source
(:class:`~atlasfs.formats.source.Locator`, :meth:`SourceShard.file_spans
<atlasfs.formats.source.SourceShard.file_spans>`): where the file's bytes can
be read without decoding its block, or, for small files, the bytes themselves
(*inline*). They are optional columns (:class:`Locators`), 14 bytes a file, plus
each distinct prefix once and the inline bytes (at most :data:`INLINE_AVERAGE`
a file of the table on average), and the *kept* files: inline files too big to be kept as
they are (a JSON of a dict, up to :data:`KEPT_MAX`), kept compressed, one zstd frame a
block (at most :data:`KEPT_AVERAGE` bytes a file on average); a table without them is as valid. The source
checks what a locator points at on every read, so a stored one that lies only
costs a fallback to the block.
"""

from __future__ import annotations

import os
import tempfile
from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import zstandard

from atlasfs.formats.source import Locator
from atlasfs.tree.table import ondisk
from atlasfs.tree.table.layout import (DIR, FILE, INLINE, INLINE_MAX, KEPT, KEPT_BLOCK_MAX, NO_LOCATOR, UNKNOWN_SIZE,
                                       UNREADABLE)

#: ``(path, kind, size, block, pos, file)``, optionally with a 7th item, the file's
#: :class:`~atlasfs.formats.source.Locator` (or None).
Rows = list[tuple[Any, ...]]
#: Distinct prefixes (``.npy`` headers) a table keeps, and their bytes in all: arrays of many
#: shapes (token arrays of every length) would otherwise grow a table by megabytes. Prefix
#: numbers (1 + the prefix's index) stay below the sentinels :data:`INLINE` and :data:`KEPT`.
MAX_PREFIXES = KEPT - 1
MAX_PREFIX_BYTES = 1 << 20
#: Most inline bytes a table keeps, per file of the table on average (in row order: later
#: small files past the bound get no inline locator; one is at most :data:`INLINE_MAX` bytes).
INLINE_AVERAGE = 64
#: Most bytes of a kept file; most compressed kept bytes a table keeps, per file of the table
#: on average (later blocks past it keep none; a block's, decompressed, at most :data:`KEPT_BLOCK_MAX`).
KEPT_MAX = 16 << 10
KEPT_AVERAGE = 256
#: Limits from a stored table's source state (see :meth:`FileTable.load`).
LimitsOf = Callable[[bytes], "Limits"]


def _view(array: np.ndarray, code: str) -> memoryview:
    """A memoryview of ``array`` with the native format ``code`` (a stored table's arrays
    say ``<Q``, which memoryviews do not index)."""
    return memoryview(np.ascontiguousarray(array)).cast("B").cast(code)


class TableError(ValueError):
    """A stored table that must not be used; the message says why."""


@dataclass(frozen=True)
class Row:
    """One entry of a table."""

    index: int
    path: str
    kind: int
    size: int
    block: int
    pos: int
    file: int


class Locators:
    """The locators of a table's rows as columns: ``offset`` (uint32, :data:`NO_LOCATOR`
    for none; for an inline one, where its bytes start in ``inline``; for a kept one, in its
    block's kept files), ``length`` (uint32: the run's, or the inline or kept file's),
    ``check`` (uint32), ``prefix`` (uint16: 0 none, else 1 + its index in ``prefixes``, or
    :data:`INLINE`, or :data:`KEPT`). The length is stored although the
    file's size often tells it: a table names files before it knows their sizes, and a
    locator then gives a file's size at its lookup without decoding its block (a table
    whose sizes are all known lists with attributes: the kernel, and libfuse, then keep
    an entry for every file listed). ``kept`` is one zstd frame a block holding its kept
    files one after another, and ``kept_ends`` (uint64) where block ``b``'s frame ends in
    it (it starts where block ``b - 1``'s ends)."""

    __slots__ = ("_last_kept", "check", "inline", "kept", "kept_ends", "length", "offset", "prefix", "prefixes")

    def __init__(self, offset: np.ndarray, length: np.ndarray, check: np.ndarray, prefix: np.ndarray,
                 prefixes: list[bytes], inline: bytes, kept: Any = b"", kept_ends: np.ndarray | None = None) -> None:
        self.offset = offset
        self.length = length
        self.check = check
        self.prefix = prefix
        self.prefixes = prefixes
        self.inline = inline
        self.kept = kept
        self.kept_ends = kept_ends if kept_ends is not None else np.zeros(0, dtype=np.uint64)
        self._last_kept: tuple[int, bytes | None] = (-1, None)

    @classmethod
    def build(cls, locators: list[Locator | None]) -> "Locators | None":
        """Columns for one locator per row (None: none), the rows' files all of one block;
        None if no row has one. Locators past the bounds (:data:`MAX_PREFIXES`,
        :data:`MAX_PREFIX_BYTES`, :data:`INLINE_MAX`, :data:`INLINE_AVERAGE` a row of those
        before it, :data:`KEPT_MAX`, :data:`KEPT_AVERAGE`, offsets of 4 GiB) are left out:
        their files keep their blocks. (A shard's table: :class:`atlasfs.tree.table.builder.TableBuilder`.)"""
        from atlasfs.tree.table.builder import LocatorColumns

        columns = LocatorColumns()
        for loc in locators:
            columns.add(loc)
        return columns.columns()

    def nbytes(self) -> int:
        """Memory the columns and their bytes take."""
        return (self.offset.nbytes + self.length.nbytes + self.check.nbytes + self.prefix.nbytes + len(self.inline)
                + sum(map(len, self.prefixes)) + len(self.kept) + self.kept_ends.nbytes)

    def kept_file(self, block: int, offset: int, length: int) -> bytes | None:
        """Bytes ``offset`` to ``offset + length`` of block ``block``'s kept files, or None if
        its frame (untrusted) does not hold them. The last block's files are kept
        decompressed, for its next file."""
        last, files = self._last_kept
        if last != block:
            ends = self.kept_ends
            if not 0 <= block < len(ends):
                return None
            frame = self.kept[int(ends[block - 1]) if block else 0:int(ends[block])]
            try:
                content = zstandard.frame_content_size(frame)
                files = (zstandard.ZstdDecompressor().decompress(frame, max_output_size=KEPT_BLOCK_MAX)
                         if 0 <= content <= KEPT_BLOCK_MAX else None)
            except zstandard.ZstdError:
                files = None
            self._last_kept = (block, files)
        if files is None or offset + length > len(files):
            return None
        return files[offset:offset + length]

    def problem(self, kinds: np.ndarray, sizes: np.ndarray, blocks: np.ndarray) -> str | None:
        """Why stored columns are unsafe to use (they come from an untrusted file), or None."""
        n = len(kinds)
        if not len(self.offset) == len(self.length) == len(self.check) == len(self.prefix) == n:
            return "locator columns of another length than the table"
        if len(self.prefixes) > MAX_PREFIXES or sum(map(len, self.prefixes)) > MAX_PREFIX_BYTES:
            return "too many locator prefixes"
        if len(self.inline) > INLINE_AVERAGE * n:
            return "more inline bytes than a table keeps"
        if len(self.kept) > KEPT_AVERAGE * n:
            return "more kept bytes than a table keeps"
        located = self.offset != NO_LOCATOR
        if bool(np.any(located & (kinds != FILE))):
            return "a locator of an entry that is no file"
        if bool(np.any(~located & ((self.prefix != 0) | (self.length != 0)))):
            return "a locator prefix or length without a locator"
        inline = located & (self.prefix == INLINE)
        kept = located & (self.prefix == KEPT)
        runs = located & ~inline & ~kept
        if bool(np.any(self.prefix[runs] > len(self.prefixes))):
            return "a locator prefix out of range"
        ends = self.offset[inline].astype(np.uint64) + self.length[inline]
        if bool(np.any(self.length[inline] > INLINE_MAX)) or bool(np.any(ends > len(self.inline))):
            return "an inline file outside the table's inline bytes"
        kept_ends = self.kept_ends
        last_block = int(blocks[kept].max()) if bool(kept.any()) else -1
        if len(kept_ends) != last_block + 1 or bool(np.any(np.diff(kept_ends.astype(np.int64)) < 0)) \
                or (len(kept_ends) and int(kept_ends[-1]) > len(self.kept)):
            return "kept frames out of order or outside the table's kept bytes"
        ends = self.offset[kept].astype(np.uint64) + self.length[kept]
        if bool(np.any(self.length[kept] > KEPT_MAX)) or bool(np.any(ends > KEPT_BLOCK_MAX)):
            return "a kept file out of bounds"
        prefix_lengths = np.array([0] + [len(p) for p in self.prefixes], dtype=np.uint64)
        located_sizes = np.where(inline | kept, self.length.astype(np.uint64),
                                 prefix_lengths[np.where(runs, self.prefix, 0)] + self.length)
        known = located & (sizes != UNKNOWN_SIZE)
        if bool(np.any(located_sizes[known] != sizes[known])):
            return "a locator of another size than its file"
        return None


class FileTable:
    """The entries of one shard in tree order. Build with :meth:`build`, or :meth:`load`.

    ``names`` is the blob of every path (bytes, or the map of a stored table's names: both
    slice to bytes); ``columns`` the per-entry arrays, and optionally the lookup index
    (``hashes``: the stable hashes of the paths, sorted; ``hash_rows``: the row of each),
    made at the first lookup if not given."""

    def __init__(self, names: Any, offsets: np.ndarray, columns: dict[str, np.ndarray]) -> None:
        self._names = names
        self._offsets = offsets
        self.kind = columns["kind"]
        self.size = columns["size"]
        self.block = columns["block"]
        self.pos = columns["pos"]
        self.file = columns["file"]
        self.by_path = columns["by_path"]
        #: True if no path has a folder (the usual shard: listed from the table as it is).
        self.flat = names.find(b"/") < 0
        self._index: tuple[np.ndarray, np.ndarray] | None = None
        self._search: tuple[memoryview, memoryview, memoryview] | None = None
        if "hashes" in columns:
            self._index = (columns["hashes"], columns["hash_rows"])
        #: What the shard's source learned by a pass over its files (stored with the table).
        self.state = b""
        #: Where files can be read without decoding their blocks (None: nowhere).
        self.locators: Locators | None = None
        #: For a table mapped from its file: the file, and its bytes (what it keeps mapped);
        #: the file's identity when it was checked (device, inode, size, mtime in ns) and
        #: where each section lies in it (name -> (offset, length)), for a reader of the file
        #: itself (the native engine's file mode).
        self.path: str | None = None
        self.mapped_bytes = 0
        self.file_identity: tuple[int, int, int, int] | None = None
        self.sections: dict[str, tuple[int, int]] = {}
        #: The limits the table was checked against (None: not checked, a built table).
        self.limits: Limits | None = None
        #: What the tree keeps while the table's sizes are being learnt (tree/table/tables.py).
        self.unsized: Any = None

    @property
    def names(self) -> Any:
        """The blob of every row's path, in row order (bytes, or the map of a stored table's
        names: both slice to bytes): row ``i``'s path is ``names[offsets[i]:offsets[i + 1]]``."""
        return self._names

    @property
    def offsets(self) -> np.ndarray:
        """Where each row's path starts in :attr:`names`, then where the last ends (uint64, one
        more than the rows)."""
        return self._offsets

    @property
    def stored_index(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The lookup index as the table was given it (stored, or made by :meth:`lookup_index`
        since); None if not."""
        return self._index

    def nbytes(self) -> int:
        """Bytes the table keeps: its file's if mapped (its size column in memory counted too,
        if copied), else its arrays' and names'."""
        if self.path is not None:
            return self.mapped_bytes + (self.size.nbytes if self.size.base is None else 0)
        columns = (self._offsets, self.kind, self.size, self.block, self.pos, self.file, self.by_path)
        index = self._index or ()
        return (sum(a.nbytes for a in columns) + sum(a.nbytes for a in index) + len(self._names)
                + (self.locators.nbytes() if self.locators is not None else 0))

    def lookup_index(self) -> tuple[np.ndarray, np.ndarray]:
        """(stable hashes of the paths, sorted; the row of each): made now if not stored."""
        index = self._index
        if index is None:
            bounds = self._offsets.tolist()
            names = self._names
            hashes = ondisk.path_hashes([names[a:b] for a, b in zip(bounds, bounds[1:])])
            order = np.argsort(hashes, kind="stable")
            index = self._index = (hashes[order], order.astype(np.uint32))
        return index

    def __len__(self) -> int:
        return len(self.kind)

    @classmethod
    def build(cls, rows: Rows) -> "FileTable":
        """A table from ``(path, kind, size, block, pos, file[, locator])`` rows of files in
        example order (``size`` may be :data:`UNKNOWN_SIZE`); folders implied by paths are
        added. Paths must be unique (the naming layer guarantees it). A row's locator, if
        any, must be of a file whose size is unknown or the locator's. (A shard's table is
        built a block at a time: :class:`atlasfs.tree.table.builder.TableBuilder`.)"""
        from atlasfs.tree.table.builder import TableBuilder

        builder = TableBuilder()
        builder.add(rows)
        return builder.finish()

    def locator(self, i: int) -> Locator | None:
        """Where the file of entry ``i`` can be read without decoding its block, or None."""
        locators = self.locators
        if locators is None:
            return None
        offset = locators.offset.item(i)
        if offset == NO_LOCATOR:
            return None
        number = locators.prefix.item(i)
        length = locators.length.item(i)
        if number == INLINE:
            return Locator(0, 0, locators.check.item(i), locators.inline[offset:offset + length], True)
        if number == KEPT:  # None if its frame does not hold it: the file keeps its block
            data = locators.kept_file(self.block.item(i), offset, length)
            return None if data is None else Locator(0, 0, locators.check.item(i), data, True)
        return Locator(offset, length, locators.check.item(i), locators.prefixes[number - 1] if number else b"")

    def located_size(self, i: int) -> int | None:
        """The size of the file of entry ``i`` its locator tells, or None if it has none
        (:meth:`locator`'s size, without reading a kept file)."""
        locators = self.locators
        if locators is None or locators.offset.item(i) == NO_LOCATOR:
            return None
        number = locators.prefix.item(i)
        length = locators.length.item(i)
        if number in (INLINE, KEPT) or not number:
            return length
        return len(locators.prefixes[number - 1]) + length

    def located_sizes(self, rows: np.ndarray) -> np.ndarray:
        """:meth:`located_size` of each of entries ``rows`` at once (uint64), :data:`UNKNOWN_SIZE`
        where an entry has no locator."""
        out = np.full(len(rows), UNKNOWN_SIZE, dtype=np.uint64)
        locators = self.locators
        if locators is None or not len(rows):
            return out
        has = locators.offset[rows] != NO_LOCATOR
        number = locators.prefix[rows].astype(np.int64)
        sizes = locators.length[rows].astype(np.uint64)
        runs = has & (number != 0) & (number != INLINE) & (number != KEPT)
        if bool(runs.any()):
            prefix_lengths = np.array([len(p) for p in locators.prefixes], dtype=np.uint64)
            sizes[runs] += prefix_lengths[number[runs] - 1]
        out[has] = sizes[has]
        return out

    def entry_path(self, i: int) -> str:
        """The path of entry ``i`` (relative to the shard folder)."""
        return self._path(i).decode("utf-8")

    def _path(self, i: int) -> bytes:
        return self._names[int(self._offsets[i]):int(self._offsets[i + 1])]

    def row(self, i: int) -> Row:
        """Entry ``i`` (in tree order)."""
        return Row(i, self._path(i).decode("utf-8"), int(self.kind[i]), int(self.size[i]), int(self.block[i]),
                   int(self.pos[i]), int(self.file[i]))

    def find(self, path: str) -> int | None:
        """Index of the entry at ``path`` (relative to the shard folder), or None."""
        try:
            return self.find_bytes(path.encode("utf-8"))
        except UnicodeEncodeError:  # a lone surrogate: no name in a table has one
            return None

    def find_bytes(self, path: bytes) -> int | None:
        """:meth:`find` of an encoded path: a binary search of the lookup index and a comparison."""
        search = self._search
        if search is None:
            hashes, rows = self.lookup_index()
            # memoryviews: indexed from Python they give ints at C speed (numpy's scalars cost more)
            search = self._search = (_view(hashes, "Q"), _view(rows, "I"), _view(self._offsets, "Q"))
        hashes_view, rows_view, offsets = search
        wanted = ondisk.path_hash(path)
        j = bisect_left(hashes_view, wanted)
        names = self._names
        while j < len(hashes_view) and hashes_view[j] == wanted:  # more than once only if two hashes collide
            row = rows_view[j]
            if names[offsets[row]:offsets[row + 1]] == path:
                return row
            j += 1
        return None

    def children(self, folder: str) -> list[tuple[str, int]]:
        """``(name, index)`` of each entry directly in ``folder`` ("" for the shard folder), in tree order."""
        names = self._names
        if not folder:
            lo, prefix = 0, b""
            if self.flat:  # a flat shard folder: every entry is a child
                offsets = self._offsets.tolist()
                return list(zip([names[a:b].decode("utf-8") for a, b in zip(offsets, offsets[1:])], range(len(self))))
        else:
            found = self.find(folder)
            if found is None or self.kind[found] != DIR:
                return []
            lo, prefix = found + 1, folder.encode("utf-8") + b"/"
        result = []
        start = len(prefix)
        for i in range(lo, len(self)):  # the folder's entries follow it, up to the first one outside it
            path = self._path(i)
            if not path.startswith(prefix):
                break
            rest = path[start:]
            if b"/" not in rest:
                result.append((rest.decode("utf-8"), i))
        return result

    def example_order(self) -> list[int]:
        """Indices of the files (readable or not) in example order, a file's example's files adjacent."""
        return self.example_rows().tolist()

    def example_rows(self) -> np.ndarray:
        """:meth:`example_order` as an array (intp)."""
        files = np.flatnonzero(self.kind != DIR)
        if not self.flat:  # sub-folders group a folder's files: put them back in example order
            files = files[np.lexsort((self.file[files], self.pos[files], self.block[files]))]
        return files

    # -- storage (the format: atlasfs.tree.table.ondisk)

    def to_bytes(self, key: dict[str, Any]) -> bytes:
        """The table as stored, tagged with ``key`` (what it was built from)."""
        return b"".join(ondisk.encode(self, key))

    def save(self, path: str, key: dict[str, Any]) -> None:
        """Write the table to the local file ``path`` atomically (:meth:`to_bytes`): a
        mapped table file is replaced, never changed in place."""
        fd, tmp = tempfile.mkstemp(prefix=".table-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as f:
                f.writelines(ondisk.encode(self, key))
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path: str, key: dict[str, Any], limits: "Limits | LimitsOf") -> "FileTable | None":
        """The table stored in the local file ``path``, mapped (:func:`atlasfs.tree.table.ondisk.open_mapped`),
        or None if there is no such file; raises :class:`TableError` as :meth:`from_bytes` does."""
        return ondisk.open_mapped(path, key, limits)

    @classmethod
    def from_bytes(cls, data: bytes, key: dict[str, Any], limits: "Limits | LimitsOf") -> "FileTable":
        """The table ``data`` holds (its arrays views of ``data``); raises :class:`TableError`
        saying why if it was not built from ``key`` or is not well formed.

        ``limits`` may be a function of the stored state that returns them (it takes the
        state back into the shard's source first, raising ``ValueError`` if it does not fit)."""
        try:
            return ondisk.parse(data, key, limits)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError, IndexError) as exc:
            if isinstance(exc, TableError):
                raise
            raise TableError(f"is corrupt ({exc})") from None


@dataclass(frozen=True)
class Limits:
    """What a stored table's positions and sizes must stay within (``max_file_bytes``: the
    shard's ``max_block_bytes``, the most a block's files may take)."""

    blocks: int
    block_size: int
    max_file_bytes: int = 1 << 30  # SourceShard.max_block_bytes' default
