"""Which files under ``documents/`` atlasfs reads as Dolma documents files, and their folder names.

What dolma 1.2.1's own tools read (``scripts/fixture-notes/dolma.md``): ``dolma tag`` reads
every file its glob matches, its compression decided by the last extension (``.gz``,
``.bz2``, ``.zst``, ``.zstd``; anything else is plain text); ``dolma mix`` decides by the last
piece of the name after its first dot (``gz``, ``zst``; anything else is plain text) and
writes ``<stream>-NNNN.jsonl.gz`` and, for its last shard, ``<stream>-NNNN.json.gz``. Their
docs and the datasets people download name documents ``*.json.gz``.

atlasfs reads a file whose name ends in ``.gz`` (gzip), ``.zst`` or ``.zstd`` (zstd) whatever
comes before it, as both tools decompress it (the mixer reads ``.zstd`` as plain text, which
is not JSON: ``dolma tag``'s reading is the one that works), and ``.json`` or ``.jsonl`` (plain
text). Any other file is not read: :func:`why_not_read` says why, in a line the source logs
and ``verify`` lists. ``.bz2`` is named as such: a bz2 stream has no cheap random access (a
block's read would decompress the file from its start), so atlasfs does not read it.
"""

from __future__ import annotations

#: Compression by a documents file's last extension.
COMPRESSED = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}
#: Plain text documents files.
PLAIN = (".jsonl", ".json")
#: What atlasfs reads, for messages.
READ = ("*.json", "*.jsonl", "*.gz", "*.zst", "*.zstd")
#: Compressions ``dolma tag`` reads that atlasfs does not, and why.
UNSUPPORTED = {".bz2": "bz2 has no cheap random access (every read would decompress the file from its start); "
                       "recompress it as .gz or .zst"}


def file_kind(path: str) -> str:
    """``gz``, ``zst`` or ``plain``, by the file's last extension."""
    for suffix, kind in COMPRESSED.items():
        if path.endswith(suffix):
            return kind
    return "plain"


def is_documents_file(name: str) -> bool:
    """Whether a file named ``name`` is read as a documents file (hidden files are not)."""
    return not name.startswith(".") and name.endswith((*COMPRESSED, *PLAIN))


def folder_name(relative: str) -> str:
    """A documents file's folder: its path under ``documents/`` without its compression
    extension and then its ``.json``/``.jsonl`` one (``cc/part-a.json.gz`` -> ``cc/part-a``)."""
    for suffix in COMPRESSED:
        if relative.endswith(suffix):
            relative = relative[:-len(suffix)]
            break
    for suffix in PLAIN:
        if relative.endswith(suffix):
            return relative[:-len(suffix)]
    return relative


def why_not_read(path: str) -> str:
    """The line that says why the file at ``path`` is not read as a documents file."""
    for suffix, why in UNSUPPORTED.items():
        if path.endswith(suffix):
            return f"{path}: not read: {why}"
    return f"{path}: not read: not a documents file name ({', '.join(READ)})"
