"""Where an Atlas file's bytes already lie, verbatim, in its block's decompressed
pickle, and reading them from there without unpickling (issue #18).

A cold read of one file through the block path pays for the whole block:
decompress it, unpickle every example, name and encode the example. Yet most
file bytes are already in the decompressed block as one run: the pickle
stores a ``bytes`` value and the UTF-8 of a ``str`` as length-prefixed runs
(``SHORT_BINBYTES``/``BINBYTES``/``BINBYTES8``,
``SHORT_BINUNICODE``/``BINUNICODE``/``BINUNICODE8``), and a contiguous numpy
array's data as one run too (``BINBYTES``..., or ``BYTEARRAY8`` under
protocol 5), so that a ``.npy`` file is a small header followed by that run.

:func:`find_spans` records, when a block is decoded anyway (while a shard's
file table is built), where each such file's run lies in the decompressed
block, as a :class:`~atlasfs.formats.source.Locator` (here called a *span*);
it keeps a span only after checking that the bytes there equal the file's real
encoding (:func:`atlasfs.formats.naming.encode_as`). :func:`file_locators` adds the
small files (:data:`INLINE_MAX` bytes or less: ``cls`` ints, small ``json``
dicts), and the files of no run up to :data:`WHOLE_MAX` (a ``json`` of a larger dict), as
*inline* locators holding their bytes, tied to the block by its fingerprint
(:func:`block_fingerprint`); the table keeps the larger ones compressed a block at a time. :func:`read_span` then
serves a file from the block's stored bytes alone: strategy 0 needs just a
``pread`` of the run; a zstd frame is decompressed only as far as the end of
the run; an inline file needs the block's fingerprint (4 bytes of its frame, or for a
block with no frame checksum the CRC-32 of its stored bytes, read once a block and
remembered while ``data.bin`` stays the same file: :class:`StoredFingerprints`);
nothing is unpickled, so no pickle code runs. The mount's reads go through
:class:`LocatedReads` (the shard's side), which reads runs over raw zstd blocks alone but
decompresses any other compressed block whole at its first read and keeps it for the next:
random readers come back to blocks, and in the benchmark's cold pass that cost 20-30% less
in all than decompressing each time only up to a run's end (docs/performance.md).
Every span carries a check (CRC-32 of its prefix and run), compared on every
read, so that a block that changed since the span was recorded raises
:class:`SpanMismatch` instead of serving wrong bytes.

No FUSE and no tree: functions, small value types, and two small process-wide
caches of decompressed blocks (:data:`PAYLOADS`, :data:`JUST_DECODED`). The
shard (:class:`~atlasfs.formats.atlas.dataset.Shard`) calls them.

The package's rooms: ``find.py`` (where a block's files lie in its decompressed pickle, and
the small files kept inline), ``read.py`` (reading a located file back from the block as
stored, with its checks), ``fingerprints.py`` (the blocks' stored CRC-32s a reader
remembers), ``payloads.py`` (the process-wide caches of decompressed blocks)
and ``located.py`` (:class:`LocatedReads`, the shard's side). The checksum of every check
is ``find._crc32``, in that one place.
"""

from __future__ import annotations

from atlasfs.formats.atlas.spans.find import (
                   INLINE_MAX,
                   PROTOCOLS,
                   SCAN_BUDGET,
                   WHOLE_MAX,
                   Span,
                   block_fingerprint,
                   file_locators,
                   find_spans,
                   inline_check,
                   pickle_protocol,
                   run_check,
                   stored_crc,
)
from atlasfs.formats.atlas.spans.fingerprints import StoredFingerprints, file_identity
from atlasfs.formats.atlas.spans.located import BlockStore, LocatedReads
from atlasfs.formats.atlas.spans.payloads import JUST_DECODED, PAYLOAD_KEEP_BYTES, PAYLOADS, PayloadCache
from atlasfs.formats.atlas.spans.read import (
                   STORED_RUN_HEADERS,
                   BlockReader,
                   check_run,
                   new_decompressor,
                   read_span,
                   run_in,
)
from atlasfs.formats.source import SpanMismatch

__all__ = ["Span", "SpanMismatch", "BlockReader", "BlockStore", "LocatedReads", "run_in", "find_spans",
           "file_locators", "block_fingerprint", "read_span", "check_run", "run_check",
           "INLINE_MAX", "JUST_DECODED", "PAYLOADS", "PAYLOAD_KEEP_BYTES", "PROTOCOLS",
           "SCAN_BUDGET", "STORED_RUN_HEADERS", "WHOLE_MAX", "PayloadCache", "inline_check", "new_decompressor",
           "pickle_protocol", "stored_crc", "StoredFingerprints", "file_identity"]
