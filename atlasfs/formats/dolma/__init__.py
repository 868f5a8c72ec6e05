"""Dolma documents and attributes: reading, and mounting as a source.

A Dolma dataset is a folder with ``documents/`` (any tree of ``*.json.gz``,
``*.jsonl.gz``, ``*.jsonl.zst``, ``*.jsonl`` ... files, :mod:`.names` says which; one
JSON document per line with at least ``id`` and ``text``) and ``attributes/<name>/``
folders mirroring it: the attributes file at the same relative path holds, line for
line, the attributes of the same documents (``{"id": ..., "attributes": {...}}``).

Each documents file is a shard (:class:`DolmaFile`, a folder of the tree named
by its path under ``documents/`` without the suffix) read a block of
:data:`LINES_PER_BLOCK` lines at a time. Random access goes through seek
points made in the one pass over the file that :meth:`DolmaFile.prepare`
makes: for gzip, ``indexed_gzip``'s index (zran seek points every
:data:`SEEK_SPACING` bytes of text, so a read inflates at most that much
before its bytes); for zstd, the start of every frame (a reader going in
order continues where it stopped); plain files need none. What the pass
learned (block offsets, line count, alignment of every attribute set, bad
lines, seek points) is returned as a saved state (:func:`.saved.encode_state`,
on :mod:`atlasfs.formats.state`) that the tree stores with the shard's file
table; :meth:`DolmaFile.restore` takes it back on a later mount, checked as
untrusted input, so that mount makes no pass.

A documents file's sample for line ``i`` is ``{"__key__": id, "text": text,
"json": the line's bytes, "<name>.json": the attributes line's bytes...}``,
so the naming layer makes ``<id>.text``, ``<id>.json`` and ``<id>.<name>.json``.
The pass also measures those files, so a first listing needs no second
decompression (:meth:`DolmaFile.describe_block`). An attributes file that does
not line up with its documents file (another number of lines, or another id
on a line) is left out of that file's samples, with one log line per mount
naming the file, the line and both ids, and a line in ``verify``. A line that
is not a JSON object or has no string ``id`` is kept as a sample with only
its raw line (``<index key>.json``), logged and named in ``verify``. A
compressed file that ends early (a truncated gzip member, a cut zstd frame)
keeps the blocks before the damage; the block it falls in fails, with one
line naming the file.

The package's rooms: ``names.py`` (which files are documents files, their folder names),
``seek.py`` (the gzip and zstd seek machinery: one pass over a
file's text, positioned reads after it), ``scan.py`` (the pass over a documents file
and its attributes files, and a line as a sample), ``saved.py`` (the pass's result as a
saved state, checked on the way back), ``shard.py`` (:class:`DolmaFile`, a shard) and
``source.py`` (:class:`DolmaSource`, the dataset folder).
"""

from __future__ import annotations

from atlasfs.formats.dolma.saved import STATE_VERSION, decode_state, encode_state
from atlasfs.formats.dolma.scan import LINES_PER_BLOCK, MAX_LINE_BYTES, MAX_PROBLEMS, Scan
from atlasfs.formats.dolma.seek import (
                   OPEN_FILES,
                   SEEK_SPACING,
                   DolmaError,
                   TextPass,
                   check_gzip_index,
                   gzip_damage,
                   zstd_frame_starts,
)
from atlasfs.formats.dolma.names import READ, file_kind, folder_name, is_documents_file, why_not_read
from atlasfs.formats.dolma.shard import LOGGED_PROBLEMS, DolmaFile
from atlasfs.formats.dolma.source import DolmaSource, looks_like, open_source

__all__ = ["LINES_PER_BLOCK", "LOGGED_PROBLEMS", "MAX_LINE_BYTES", "MAX_PROBLEMS", "OPEN_FILES", "SEEK_SPACING",
           "READ", "STATE_VERSION", "DolmaError", "DolmaFile", "DolmaSource", "Scan", "TextPass",
           "check_gzip_index", "decode_state", "encode_state", "file_kind", "folder_name", "gzip_damage",
           "is_documents_file", "looks_like", "open_source", "why_not_read", "zstd_frame_starts"]
