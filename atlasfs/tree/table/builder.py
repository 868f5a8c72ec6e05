"""A file table built a block at a time, in compact columns.

A shard's table is built by naming its blocks one after another; holding every row as a
Python tuple until the end cost ~850 bytes a file at its peak (a shard of 200,000 files:
170 MiB for a table of 12). Here each block's rows go straight into arrays and one blob of
paths (about 60 bytes a file), and the table is made from them at the end
(:meth:`TableBuilder.finish`): the path order and the lookup index then take about 130
bytes a file more, for as long as they are made.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

import numpy as np
import zstandard

from atlasfs.formats.source import Locator
from atlasfs.tree.table import filetable, layout, ondisk
from atlasfs.tree.table.filetable import FileTable, Locators
from atlasfs.tree.table.layout import DIR, FILE, INLINE, KEPT, NO_LOCATOR, UNKNOWN_SIZE


class LocatorColumns:
    """Locators added one row at a time into :class:`~atlasfs.tree.table.filetable.Locators`'
    columns, within their bounds (distinct prefixes and their bytes; inline bytes at most
    :data:`~atlasfs.tree.table.filetable.INLINE_AVERAGE` a row of those added so far; kept bytes
    at most :data:`~atlasfs.tree.table.filetable.KEPT_AVERAGE`): a locator past a bound is left out,
    and its file keeps its block. An inline locator too big to be kept as it is, is kept
    with the other such files of its block, compressed when the block's rows are done
    (blocks come in order)."""

    def __init__(self) -> None:
        self.offset, self.length, self.check = array("I"), array("I"), array("I")
        self.prefix = array("H")
        self.numbers: dict[bytes, int] = {}
        self.prefix_bytes = 0
        self.inline = bytearray()
        self.any = False
        self.kept = bytearray()
        self.kept_ends = array("Q")
        self._block = -1  # the block whose kept files are gathered in _files, for the rows _rows
        self._files = bytearray()
        self._rows: list[int] = []
        self._compressor = zstandard.ZstdCompressor(level=3)

    def add(self, loc: Locator | None, block: int = 0) -> None:
        """The next row's locator (None: it has none), of a file of block ``block``."""
        if loc is not None and self._fits(loc, block):
            self.any = True
            return
        self.offset.append(NO_LOCATOR)
        self.length.append(0)
        self.check.append(0)
        self.prefix.append(0)

    def _fits(self, loc: Locator, block: int) -> bool:
        """Append ``loc``'s columns if it is within the bounds."""
        if loc.inline:
            data = loc.prefix
            rows = len(self.offset) + 1
            if loc.length:
                return False
            if len(data) > layout.INLINE_MAX or len(self.inline) + len(data) > filetable.INLINE_AVERAGE * rows:
                return self._keep(loc, block)
            offset, length, number = len(self.inline), len(data), INLINE
            self.inline += data
        else:
            if not 0 <= loc.offset < NO_LOCATOR or not 0 <= loc.length < NO_LOCATOR:
                return False
            number = 0
            if loc.prefix:
                number = self.numbers.get(loc.prefix, 0)
                if not number:
                    if len(self.numbers) >= filetable.MAX_PREFIXES or \
                            self.prefix_bytes + len(loc.prefix) > filetable.MAX_PREFIX_BYTES:
                        return False
                    self.prefix_bytes += len(loc.prefix)
                    number = self.numbers[loc.prefix] = len(self.numbers) + 1
            offset, length = loc.offset, loc.length
        self.offset.append(offset)
        self.length.append(length)
        self.check.append(loc.check & 0xFFFFFFFF)
        self.prefix.append(number)
        return True

    def _keep(self, loc: Locator, block: int) -> bool:
        """Gather an inline file too big for the inline bytes with its block's kept files."""
        data = loc.prefix
        if len(data) > filetable.KEPT_MAX or block < self._block:
            return False
        if block != self._block:
            self._close_block()
            self._block = block
        if len(self._files) + len(data) > layout.KEPT_BLOCK_MAX:
            return False
        self._rows.append(len(self.offset))
        self.offset.append(len(self._files))
        self.length.append(len(data))
        self.check.append(loc.check & 0xFFFFFFFF)
        self.prefix.append(KEPT)
        self._files += data
        return True

    def _close_block(self) -> None:
        """Compress the kept files gathered into their block's frame, or, past the table's
        bound, take back their locators."""
        if not self._files:
            return
        frame = self._compressor.compress(bytes(self._files))
        if len(self.kept) + len(frame) > filetable.KEPT_AVERAGE * len(self.offset):
            for row in self._rows:
                self.offset[row], self.length[row], self.check[row], self.prefix[row] = NO_LOCATOR, 0, 0, 0
        else:
            self.kept += frame
            ends = self.kept_ends
            ends.extend([ends[-1] if ends else 0] * (self._block - len(ends)))
            ends.append(len(self.kept))
        self._files, self._rows = bytearray(), []

    def columns(self, order: np.ndarray | None = None) -> Locators | None:
        """The columns (rows taken in ``order``, -1 for a row of none), or None if no row has a locator."""
        self._close_block()
        if not self.any:
            return None
        arrays = [np.frombuffer(a, dtype=a.typecode) if len(a) else np.zeros(0, a.typecode)
                  for a in (self.offset, self.length, self.check, self.prefix)]
        if order is not None:
            defaults = (NO_LOCATOR, 0, 0, 0)
            arrays = [_take(a, order, default) for a, default in zip(arrays, defaults)]
        else:
            arrays = [a.copy() for a in arrays]
        ends = np.array(self.kept_ends, dtype=np.uint64)
        return Locators(*arrays, list(self.numbers), bytes(self.inline), bytes(self.kept), ends)


def _take(values: np.ndarray, order: np.ndarray, default: int) -> np.ndarray:
    """``values[order]``, with ``default`` where ``order`` is -1."""
    result = np.full(len(order), default, dtype=values.dtype)
    picked = order >= 0
    result[picked] = values[order[picked]]
    return result


class TableBuilder:
    """Rows ``(path, kind, size, block, pos, file[, locator])`` of files in example order,
    added a block at a time (:meth:`add`); :meth:`finish` makes the
    :class:`~atlasfs.tree.table.filetable.FileTable` (folders implied by paths added, in tree
    order). Paths must be unique (the naming layer guarantees it). A row's locator is kept
    only for a file whose size is unknown or the locator's."""

    def __init__(self) -> None:
        self._names = bytearray()
        self._ends = array("Q")
        self._kind, self._size = array("B"), array("Q")
        self._block, self._pos, self._file = array("I"), array("I"), array("H")
        self._locators = LocatorColumns()

    def __len__(self) -> int:
        return len(self._kind)

    def add(self, rows: Iterable[tuple[Any, ...]]) -> None:
        """Append ``rows`` (a block's)."""
        names, ends, locators = self._names, self._ends, self._locators
        for row in rows:
            names += row[0].encode("utf-8")
            ends.append(len(names))
            kind, size = row[1], row[2]
            self._kind.append(kind)
            self._size.append(size)
            self._block.append(row[3])
            self._pos.append(row[4])
            self._file.append(row[5])
            loc = row[6] if len(row) > 6 else None
            locators.add(loc if loc is not None and kind == FILE and size in (loc.size, UNKNOWN_SIZE) else None,
                         row[3])

    def finish(self) -> FileTable:
        """The table of every row added."""
        n = len(self)
        offsets = np.zeros(n + 1, dtype=np.uint64)
        if n:
            offsets[1:] = np.frombuffer(self._ends, dtype=np.uint64)
        names = bytes(self._names)
        columns = {name: (np.frombuffer(a, dtype=a.typecode).copy() if len(a) else np.zeros(0, a.typecode))
                   for name, a in (("kind", self._kind), ("size", self._size), ("block", self._block),
                                   ("pos", self._pos), ("file", self._file))}
        order = None
        if b"/" in names:  # sub-folders: tree order, with the folders added
            names, offsets, order = _tree_order(names, offsets)
            columns = {name: _take(values, order, DIR if name == "kind" else 0) for name, values in columns.items()}
        self._names, self._ends = bytearray(), array("Q")  # let go before the path order is made
        columns["by_path"] = _path_order(names, offsets)
        hashes = np.concatenate([np.zeros(0, dtype="<u8")] + [ondisk.path_hashes(chunk)
                                                             for chunk in _path_chunks(names, offsets)])
        rows = np.argsort(hashes, kind="stable")
        columns["hashes"], columns["hash_rows"] = hashes[rows], rows.astype(np.uint32)
        table = FileTable(names, offsets, columns)
        table.locators = self._locators.columns(order)
        return table


#: Paths made into Python objects at once while the path order and the lookup index are made.
_CHUNK = 1 << 16
#: Most bytes of the fixed-width copy of the paths the path order is sorted on (one path far
#: longer than the others would make it huge: those tables are sorted in Python instead).
_SORT_BYTES = 32 << 20


def _path_chunks(names: bytes, offsets: np.ndarray) -> Iterable[list[bytes]]:
    """The paths, :data:`_CHUNK` at a time."""
    for start in range(0, len(offsets) - 1, _CHUNK):
        bounds = offsets[start:start + _CHUNK + 1].tolist()
        yield [names[a:b] for a, b in zip(bounds, bounds[1:])]


def _path_order(names: bytes, offsets: np.ndarray) -> np.ndarray:
    """Row numbers sorted by path bytes: a stable sort of the paths as fixed-width byte strings
    (no path holds a NUL, so their padding sorts as Python sorts bytes), about the longest
    path's bytes a row; or, past :data:`_SORT_BYTES`, Python's sort of every path."""
    n = len(offsets) - 1
    longest = int(np.max(np.diff(offsets))) if n else 0
    if n * max(longest, 1) <= _SORT_BYTES:
        fixed = np.concatenate([np.zeros(0, dtype=f"S{max(longest, 1)}")] + [
            np.array(chunk, dtype=f"S{max(longest, 1)}") for chunk in _path_chunks(names, offsets)])
        return np.argsort(fixed, kind="stable").astype(np.uint32)
    paths = [path for chunk in _path_chunks(names, offsets) for path in chunk]
    return np.array(sorted(range(n), key=paths.__getitem__), dtype=np.uint32)


def _tree_order(names: bytes, offsets: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The paths of files in example order put in tree order, each folder their paths imply
    added where its first file is met: the new names blob and offsets, and for each new row
    the row it comes from (-1: an added folder)."""
    bounds = offsets.tolist()
    root: dict[str, Any] = {}  # name -> sub-folder dict, or a file's row (dicts keep insertion order)
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        *folders, name = names[a:b].decode("utf-8").split("/")
        node = root
        for part in folders:
            node = node.setdefault(part, {})
        node[name] = i
    parts: list[bytes] = []
    order: list[int] = []
    stack = [("", iter(root.items()))]
    while stack:  # depth first without recursion: keys may nest hundreds of folders deep
        prefix, children = stack[-1]
        for name, child in children:
            if isinstance(child, dict):
                path = prefix + name
                parts.append(path.encode("utf-8"))
                order.append(-1)
                stack.append((path + "/", iter(child.items())))
                break
            parts.append(names[bounds[child]:bounds[child + 1]])
            order.append(child)
        else:
            stack.pop()
    new_offsets = np.zeros(len(parts) + 1, dtype=np.uint64)
    np.cumsum(np.fromiter(map(len, parts), dtype=np.uint64, count=len(parts)), out=new_offsets[1:])
    return b"".join(parts), new_offsets, np.array(order, dtype=np.int64)
