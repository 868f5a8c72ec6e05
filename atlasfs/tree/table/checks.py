"""A stored file table checked before it is believed (:func:`problem`): another user may have
written it, so every value that later indexes, slices or sizes something is checked first.
The columns' shapes and bounds, the path order and lookup index (permutations, in order), and
every path by the naming layer's rule, a chunk of paths at a time (no Python object per entry
at once). :func:`atlasfs.tree.table.ondisk.parse` runs it on every table it reads."""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import numpy as np

from atlasfs.formats.naming import paths_problem
from atlasfs.tree.table.layout import DIR, UNKNOWN_SIZE, UNREADABLE

if TYPE_CHECKING:
    from atlasfs.tree.table.filetable import FileTable, Limits

#: Paths checked at once (bounds the Python objects a check makes).
CHECK_CHUNK = 1 << 16


def problem(table: FileTable, limits: Limits) -> str | None:
    """Why ``table`` is unsafe to use, or None: paths safe and unique, positions inside the
    shard (``limits``), the lookup index pointing at every entry once, in hash order, every
    folder listed before its entries and holding them contiguously."""
    return _columns_problem(table, limits) or _paths_problem(table)


def _columns_problem(table: FileTable, limits: Limits) -> str | None:
    n = len(table)
    names, offsets = table.names, table.offsets
    if len(offsets) != n + 1 or not all(len(c) == n for c in (table.size, table.block, table.pos, table.file,
                                                               table.by_path)):
        return "columns of another length than the table"
    if n == 0:
        return None if len(names) == 0 and int(offsets[0]) == 0 else "names without entries"
    if int(offsets[0]) != 0 or int(offsets[-1]) != len(names):
        return "name offsets do not cover the names"
    if not bool(np.all(offsets[1:] > offsets[:-1])):
        return "name offsets out of order (or an empty name)"
    if bool(np.any(table.kind > UNREADABLE)):
        return "an unknown entry kind"
    if bool(np.any(table.block >= max(limits.blocks, 1))) or bool(np.any(table.pos >= max(limits.block_size, 1))):
        return "a position outside the shard"
    # A file's bytes come from one block, which may not exceed max_block_bytes: a size past it
    # is never true (2^62 would have tar pad with zeros without end).
    if bool(np.any((table.size != UNKNOWN_SIZE) & (table.size > limits.max_file_bytes))):
        return f"a file size past the {limits.max_file_bytes}-byte block bound"
    if not _is_permutation(table.by_path, n):
        return "the path order is not a permutation of the entries"
    index = table.stored_index
    if index is not None:
        hashes, rows = index
        if len(hashes) != n or len(rows) != n:
            return "a lookup index of another length than the table"
        if not _is_permutation(rows, n):
            return "a lookup index pointing outside the entries or twice at one"
        if not bool(np.all(hashes[1:] >= hashes[:-1])):
            return "a lookup index out of order"
    return None


def _paths_problem(table: FileTable) -> str | None:
    n = len(table)
    names, offsets = table.names, table.offsets
    if names.find(b"\0") >= 0:
        return "a NUL in a name"
    first_bytes = np.frombuffer(names, dtype=np.uint8) if n else np.zeros(0, np.uint8)
    if bool(np.any(first_bytes[offsets[:-1]] & 0xC0 == 0x80)):  # a path must start on a character
        return "a name that is not UTF-8"
    del first_bytes
    by_path = table.by_path
    previous = b""
    for start in range(0, n, CHECK_CHUNK):  # paths in path order, a chunk at a time
        rows = by_path[start:start + CHECK_CHUNK]
        ends = offsets[rows + 1].tolist()
        in_path_order = [names[a:b] for a, b in zip(offsets[rows].tolist(), ends)]
        if start and not previous < in_path_order[0]:
            return "paths out of order or repeated"
        if not all(map(operator.lt, in_path_order, in_path_order[1:])):
            return "paths out of order or repeated"
        previous = in_path_order[-1]
    for start in range(0, n, CHECK_CHUNK):  # every name by the naming layer's own rule
        found = paths_problem(_chunk(table, start))
        if found:
            return f"an unsafe name: {found}"
    if table.flat:  # one flat folder, the usual shard: no folders to check
        return None
    open_folders: list[bytes] = []  # the folders the walk is inside, outermost first
    for start in range(0, n, CHECK_CHUNK):
        paths = _chunk(table, start)
        kinds = table.kind[start:start + CHECK_CHUNK].tolist()
        for path, kind in zip(paths, kinds):
            parent = path.rpartition(b"/")[0]
            while open_folders and open_folders[-1] != parent:
                open_folders.pop()
            if parent and not open_folders:  # its folder is not listed before it, or was left already
                return "entries not grouped under their folders"
            if kind == DIR:
                open_folders.append(path)
    return None


def _chunk(table: FileTable, start: int) -> list[bytes]:
    """The paths of entries ``start`` to ``start + CHECK_CHUNK`` (in tree order)."""
    bounds = table.offsets[start:start + CHECK_CHUNK + 1].tolist()
    names = table.names
    return [names[a:b] for a, b in zip(bounds, bounds[1:])]


def _is_permutation(values: np.ndarray, n: int) -> bool:
    """True if ``values`` holds every number below ``n`` once."""
    if len(values) != n:
        return False
    if n == 0:
        return True
    if int(values.max()) >= n:
        return False
    return bool(np.all(np.bincount(values, minlength=n) == 1))
