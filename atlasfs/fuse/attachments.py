"""Which shard tables the native engine answers from, and from where (issue #27).

A table the tree holds is attached from its columns (views of its map, or arrays): C answers
its rows' lookups, attributes, listing and located reads. When the tree lets go of it (to stay
within ``tables.RESIDENT_TABLE_BYTES``), a stored table whose sizes are all known is attached
again as ranges of its file, which C reads with ``pread`` (*file mode*: no memory of the
daemon's, the kernel's page cache), so that random readers over more tables than the tree
holds are still answered in C; any other table is detached. The FUSE layer's bridge
(:class:`atlasfs.fuse.engine.NativeBridge`) calls this; nothing here calls back.
"""

from __future__ import annotations

import logging
import os
import resource
from typing import Any

import numpy as np

log = logging.getLogger("atlasfs")

#: Tables the engine reads from their files once the tree lets go of their maps, at most: each
#: holds a few KiB (its blocks' starts, its locators' prefixes) and descriptors for as long as
#: the mount lives; shards with the same zstd dictionary share one (dictionaries.c). Past it,
#: tables are answered in C only while the tree holds them. (A held table is answered from its
#: map: a lookup is then a binary search in memory, not three preads a step.)
FILE_TABLES_MAX = 4096
#: Descriptors a table read from its file takes: its file and its data.bin in C, and its
#: data.bin in the tree's storage (which the tree opened to read it at all).
TABLE_DESCRIPTORS = 3
#: Descriptors left to everything else (libfuse, the tree's other files, Python).
OTHER_DESCRIPTORS = 256
#: What ``Attachments`` records for a table attached from its file.
_FROM_FILE = "file"
#: The sections of a table's file attached in file mode, in ``Session.attach``'s order.
_FILE_COLUMNS = ("names", "offsets", "kind", "size", "by_path", "block")


class Attachments:
    """The engine's attached tables: shard position -> what is attached (the size column of
    the table attached from its columns, or :data:`_FROM_FILE`), and for up to
    :data:`FILE_TABLES_MAX` shards what attaches their table from its file."""

    def __init__(self) -> None:
        self._attached: dict[int, Any] = {}
        self._by_file: dict[int, tuple[Any, Any, Any]] = {}
        self.file_tables_max = file_tables_max()

    def attached(self, s: int, table: Any) -> bool:
        """Whether ``table`` is what the engine answers shard position ``s`` from already."""
        return self._attached.get(s) is table.size

    def attach(self, session: Any, s: int, table: Any, mtime: float, found: Any) -> None:
        """Attach ``table`` (held by the tree) from its columns, with its locators and where its
        blocks lie (``found``: the tree's ``native_spans(s)``, or None), and remember how to
        attach it from its file if it may be."""
        try:
            session.attach(shard=s, mtime=mtime, names=table.names, offsets=table.offsets, kind=table.kind,
                           size=table.size, by_path=table.by_path, block=table.block)
        except (ValueError, TypeError, BufferError) as exc:  # a column that is no plain buffer: Python answers
            log.debug("shard %d: table not attached to the engine: %s", s, exc)
            return
        self._attached[s] = table.size
        spans = found[1] if found is not None else None
        _locate(session, s, spans, _located_args(table, found, by_file=False))
        if s not in self._by_file and _file_mode(table) and len(self._by_file) < self.file_tables_max:
            sections = table.sections  # nothing kept here is a view of the table's map
            self._by_file[s] = ({"shard": s, "mtime": mtime, **{name: sections[name] for name in _FILE_COLUMNS},
                                 "file": (os.fsencode(table.path), table.file_identity)},
                                spans, _located_args(table, found, by_file=True))

    def release(self, session: Any, s: int) -> None:
        """The tree let go of shard position ``s``'s table: the engine lets go of its columns,
        or, for a table it may read from its file, reads them from there from now on."""
        if self._attached.pop(s, None) is None:
            return
        by_file = self._by_file.get(s)
        if by_file is not None:
            attach, spans, located = by_file
            try:
                session.attach(**attach)
                self._attached[s] = _FROM_FILE
                _locate(session, s, spans, located)
                return
            except (ValueError, TypeError, BufferError, OSError) as exc:  # the file is gone or changed
                log.debug("shard %d: table not read from its file: %s", s, exc)
                del self._by_file[s]
        session.detach(s)


def file_tables_max() -> int:
    """How many tables may be read from their files: :data:`FILE_TABLES_MAX`, or fewer when
    the process may not open :data:`TABLE_DESCRIPTORS` for each beside
    :data:`OTHER_DESCRIPTORS`. The soft limit on open files is raised first, within the hard
    one, as far as that needs (a shell's soft limit is often 1,024, its hard one far more)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = TABLE_DESCRIPTORS * FILE_TABLES_MAX + OTHER_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < want:
        raised = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError) as exc:
            log.debug("open files limit not raised to %d: %s", raised, exc)
    if soft == resource.RLIM_INFINITY:
        return FILE_TABLES_MAX
    return max(0, min(FILE_TABLES_MAX, (soft - OTHER_DESCRIPTORS) // TABLE_DESCRIPTORS))


def _file_mode(table: Any) -> bool:
    """Whether the engine may read ``table`` from its file once the tree lets go of it: a table
    mapped from its file, every size known (its size column is the file's)."""
    return table.path is not None and table.file_identity is not None and table.size.base is not None


def _located_args(table: Any, found: Any, by_file: bool) -> dict[str, Any] | None:
    """The columns of ``Session.locate`` for ``table``'s locators (``found``: the tree's
    ``native_spans``), by keyword: views of them, or with ``by_file`` ranges of the table's
    file and copies of what is small (no view of the map is kept)."""
    if found is None:
        return None
    locators, _ = found
    ends = np.cumsum([len(p) for p in locators.prefixes], dtype=np.uint64)
    if by_file:
        sections = table.sections
        columns = [sections[name] for name in ("loc_offset", "loc_length", "loc_check", "loc_prefix")]
        inline, kept = sections["inline"], sections["kept"]
        kept_ends = np.array(locators.kept_ends, dtype=np.uint64)
    else:
        columns = [locators.offset, locators.length, locators.check, locators.prefix]
        inline, kept, kept_ends = locators.inline, locators.kept, locators.kept_ends
    offset, length, check, prefix = columns
    return {"offset": offset, "length": length, "check": check, "prefix": prefix, "prefix_ends": ends,
            "prefixes": b"".join(locators.prefixes), "inline": inline, "kept": kept, "kept_ends": kept_ends}


def _locate(session: Any, s: int, spans: Any, columns: dict[str, Any] | None) -> None:
    """Give the engine the locators of shard position ``s``'s attached table (``columns``) and
    where its blocks lie (``spans``), if the tree has them: it then reads located files itself
    (located.c)."""
    if spans is None or columns is None:
        return
    try:
        session.locate(shard=s, **columns, data_path=os.fsencode(spans.data_path),
                       index_path=os.fsencode(spans.index_path), signatures=spans.signatures, starts=spans.starts,
                       compressed=spans.compressed, dictionary=spans.dictionary,
                       max_block_bytes=spans.max_block_bytes, data_identity=spans.data_identity)
    except (ValueError, TypeError, BufferError, OSError, IndexError) as exc:  # Python reads them
        log.debug("shard %d: located reads stay in Python: %s", s, exc)
