"""Dolma documents and attributes: reading, without FUSE.

A Dolma dataset is a folder with ``documents/`` (any tree of ``*.jsonl.gz``,
``*.jsonl.zst`` or ``*.jsonl`` files, one JSON document per line with at least
``id`` and ``text``) and ``attributes/<name>/`` folders mirroring it: the
attributes file at the same relative path holds, line for line, the
attributes of the same documents (``{"id": ..., "attributes": {...}}``).

Each documents file is read a block of lines at a time. Random access goes
through seek points made in one pass over the file and kept (see
:meth:`DolmaFile.seek_state`): for gzip, ``indexed_gzip``'s index (zran
seek points every :data:`SEEK_SPACING` bytes); for zstd, the start of every
frame; plain files need none. A documents file's sample for line ``i`` is
``{"__key__": id, "text": text, "json": the line's bytes, "<name>.json": the
attributes line's bytes...}``, so the naming layer makes ``<id>.text``,
``<id>.json`` and ``<id>.<name>.json``. An attributes file that does not line
up with its documents file (another number of lines, or another id on a
line) is left out of that file's samples, with the reason kept for logs and
``verify``. A line that is not a JSON object or has no string ``id`` is kept
as a sample with only its raw line (``<index key>.json``), and named as a
problem.
"""

from __future__ import annotations

import io
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np
import zstandard

from ..errors import AtlasFormatError

SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".jsonl")
#: Lines decoded together (a block of the tree).
LINES_PER_BLOCK = 512
#: Uncompressed bytes between two gzip seek points.
SEEK_SPACING = 1 << 20
#: A line longer than this is refused (a bomb or a broken file, not a document).
MAX_LINE_BYTES = 256 << 20


class DolmaError(AtlasFormatError):
    """A Dolma file or line that cannot be read; the message names it."""


def strip_suffix(name: str) -> str | None:
    """``name`` without its Dolma suffix, or None if it has none."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return None


class _Reader:
    """Positioned reads of a file's uncompressed bytes, using its seek state."""

    def __init__(self, path: str, kind: str, state: bytes | None) -> None:
        self.path = path
        self.kind = kind
        self._lock = threading.Lock()
        self._gzip: Any = None
        self._frames: np.ndarray | None = None
        if kind == "gz":
            import indexed_gzip
            self._gzip = indexed_gzip.IndexedGzipFile(path, spacing=SEEK_SPACING, drop_handles=False,
                                                      auto_build=True)
            if state:
                self._gzip.raw.import_index(fileobj=io.BytesIO(state))
        elif kind == "zst" and state:
            self._frames = np.frombuffer(state, dtype=np.uint64).reshape(-1, 2)

    def read(self, start: int, end: int) -> bytes:
        """Uncompressed bytes ``start:end``."""
        if self.kind == "plain":
            with open(self.path, "rb") as f:
                f.seek(start)
                return f.read(end - start)
        if self.kind == "gz":
            with self._lock:  # one zran stream per file: reads take turns
                self._gzip.seek(start)
                return self._gzip.read(end - start)
        return self._read_zstd(start, end)

    def _read_zstd(self, start: int, end: int) -> bytes:
        frames = self._frames if self._frames is not None else np.zeros((1, 2), dtype=np.uint64)
        # the last frame starting at or before `start`: decompress from there
        i = int(np.searchsorted(frames[:, 1], start, side="right")) - 1
        compressed_at, plain_at = (int(v) for v in frames[max(i, 0)])
        with open(self.path, "rb") as f:
            f.seek(compressed_at)
            reader = zstandard.ZstdDecompressor().stream_reader(f, read_across_frames=True)
            skip = start - plain_at
            while skip:
                got = reader.read(min(skip, 1 << 20))
                if not got:
                    break
                skip -= len(got)
            return reader.read(end - start)

    def seek_state(self) -> bytes:
        """What to keep so that a later open seeks without a pass over the file."""
        if self.kind == "gz":
            with self._lock:
                out = io.BytesIO()
                self._gzip.raw.export_index(fileobj=out)
                return out.getvalue()
        if self.kind == "zst" and self._frames is not None:
            return self._frames.tobytes()
        return b""

    def close(self) -> None:
        if self._gzip is not None:
            self._gzip.close()


def _kind(path: str) -> str:
    return "gz" if path.endswith(".gz") else "zst" if path.endswith(".zst") else "plain"


def _lines(path: str) -> Iterator[tuple[int, bytes]]:
    """``(uncompressed offset, line)`` of every line of the file, in one streaming pass."""
    kind = _kind(path)
    with open(path, "rb") as raw:
        if kind == "gz":
            import gzip
            stream: Any = gzip.GzipFile(fileobj=raw)
        elif kind == "zst":
            stream = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        else:
            stream = raw
        stream = io.BufferedReader(stream, 1 << 20) if kind == "zst" else stream
        offset = 0
        try:
            for line in stream:
                if len(line) > MAX_LINE_BYTES:
                    raise DolmaError(f"{path}: a line at byte {offset} is longer than {MAX_LINE_BYTES} bytes")
                yield offset, line
                offset += len(line)
        except (EOFError, OSError, zstandard.ZstdError) as exc:  # truncated or corrupt compressed data
            raise DolmaError(f"{path}: cannot be read past byte {offset} of its text ({exc})") from None


def _zstd_frames(path: str) -> bytes:
    """(compressed offset, uncompressed offset) of every zstd frame of the file, as uint64 pairs."""
    points = []
    plain = 0
    with open(path, "rb") as f:
        data_at = 0
        while True:
            f.seek(data_at)
            head = f.read(18)
            if not head:
                break
            points.append((data_at, plain))
            obj = zstandard.ZstdDecompressor().decompressobj()
            f.seek(data_at)
            used = 0
            while not obj.eof:
                chunk = f.read(1 << 20)
                if not chunk:
                    raise DolmaError(f"{path}: truncated zstd frame at byte {data_at}")
                plain += len(obj.decompress(chunk))
                used += len(chunk)
            data_at += used - len(obj.unused_data)
    return np.array(points, dtype=np.uint64).tobytes()


def _line_id(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """The parsed line and its id, or None for what is missing."""
    try:
        value = json.loads(line)
    except ValueError:
        return None, None
    if not isinstance(value, dict):
        return None, None
    doc_id = value.get("id")
    return value, doc_id if isinstance(doc_id, str) else None


@dataclass
class Scan:
    """What one pass over a documents file and its attributes files learned."""

    block_starts: np.ndarray  # uncompressed offset of each block's first line, and the end
    lines: int
    problems: list[str] = field(default_factory=list)  # lines that are not documents
    attribute_starts: dict[str, np.ndarray] = field(default_factory=dict)  # sets that line up
    left_out: dict[str, str] = field(default_factory=dict)  # set name -> why it does not line up
    seek_states: dict[str, bytes] = field(default_factory=dict)  # file path -> its seek state


class DolmaFile:
    """One documents file with its attribute sets: a folder of the tree."""

    def __init__(self, root: str, relative: str, attributes: dict[str, str]) -> None:
        self.root = root
        self.relative = relative  # path under documents/
        self.path = os.path.join(root, "documents", relative)
        self.name = strip_suffix(relative) or relative
        self.attributes = attributes  # set name -> its file's path
        st = os.stat(self.path)
        self.mtime = st.st_mtime
        self.data_size = st.st_size + sum(os.path.getsize(p) for p in attributes.values())
        self.scan_result: Scan | None = None
        self._readers: dict[str, _Reader] = {}
        self._readers_lock = threading.Lock()

    def files(self) -> list[str]:
        """The files its samples come from."""
        return [self.path, *self.attributes.values()]

    def scan(self) -> Scan:
        """One pass over the documents file and every attributes file: block offsets, ids,
        alignment, and (for compressed files) seek points."""
        starts: list[int] = []
        ids: list[str | None] = []
        problems: list[str] = []
        end = 0
        for number, (offset, line) in enumerate(_lines(self.path)):
            if number % LINES_PER_BLOCK == 0:
                starts.append(offset)
            value, doc_id = _line_id(line)
            if value is None:
                problems.append(f"{self.path} line {number + 1}: not a JSON object")
            elif doc_id is None:
                problems.append(f"{self.path} line {number + 1}: no string id")
            ids.append(doc_id)
            end = offset + len(line)
        scan = Scan(np.array([*starts, end], dtype=np.uint64), len(ids), problems)
        for name, path in sorted(self.attributes.items()):
            why, attribute_starts = self._line_up(path, ids)
            if why is None:
                scan.attribute_starts[name] = attribute_starts
            else:
                scan.left_out[name] = why
        for path in self.files():
            if _kind(path) == "zst":
                scan.seek_states[path] = _zstd_frames(path)
        self.scan_result = scan
        for path in self.files():  # gzip seek points: made by one pass of indexed_gzip, then kept
            if _kind(path) == "gz":
                reader = self._reader(path)
                reader.read(0, 0)
                reader._gzip.raw.build_full_index()
                scan.seek_states[path] = reader.seek_state()
        return scan

    def _line_up(self, path: str, ids: list[str | None]) -> tuple[str | None, np.ndarray]:
        starts: list[int] = []
        end = 0
        number = -1
        for number, (offset, line) in enumerate(_lines(path)):
            if number >= len(ids):
                return f"{path}: more lines than {self.path} ({len(ids)})", np.zeros(0, np.uint64)
            if number % LINES_PER_BLOCK == 0:
                starts.append(offset)
            _, attribute_id = _line_id(line)
            if attribute_id != ids[number]:
                return (f"{path} line {number + 1}: id {attribute_id!r} where {self.path} has {ids[number]!r}",
                        np.zeros(0, np.uint64))
            end = offset + len(line)
        if number + 1 != len(ids):
            return f"{path}: {number + 1} lines where {self.path} has {len(ids)}", np.zeros(0, np.uint64)
        return None, np.array([*starts, end], dtype=np.uint64)

    def _reader(self, path: str) -> _Reader:
        with self._readers_lock:
            reader = self._readers.get(path)
            if reader is None:
                state = self.scan_result.seek_states.get(path) if self.scan_result else None
                reader = self._readers[path] = _Reader(path, _kind(path), state)
            return reader

    @property
    def num_blocks(self) -> int:
        """Blocks of lines (needs :meth:`scan`)."""
        assert self.scan_result is not None
        return len(self.scan_result.block_starts) - 1

    def block_length(self, block: int) -> int:
        """Lines in ``block``."""
        assert self.scan_result is not None
        return min(LINES_PER_BLOCK, self.scan_result.lines - block * LINES_PER_BLOCK)

    def decode_block(self, block: int) -> tuple[list[Any], int]:
        """The samples of ``block`` and their cost in bytes."""
        scan = self.scan_result
        assert scan is not None
        lo, hi = (int(v) for v in scan.block_starts[block:block + 2])
        lines = self._reader(self.path).read(lo, hi).splitlines(keepends=True)
        if len(lines) != self.block_length(block):
            raise DolmaError(f"{self.path}: block {block} has {len(lines)} lines where its scan found "
                             f"{self.block_length(block)} (the file changed?)")
        cost = hi - lo
        attribute_lines: dict[str, list[bytes]] = {}
        for name, starts in scan.attribute_starts.items():
            path = self.attributes[name]
            a, b = (int(v) for v in starts[block:block + 2])
            attribute_lines[name] = self._reader(path).read(a, b).splitlines(keepends=True)
            cost += b - a
        samples = []
        for i, line in enumerate(lines):
            value, doc_id = _line_id(line)
            sample: dict[str, Any] = {"json": line.rstrip(b"\n")}
            if value is not None and doc_id is not None:
                sample["__key__"] = doc_id
                if isinstance(value.get("text"), str):
                    sample["text"] = value["text"]
                for name, attribute in attribute_lines.items():
                    sample[f"{name}.json"] = attribute[i].rstrip(b"\n")
            samples.append(sample)
        return samples, 2 * cost

    def close(self) -> None:
        """Close the files' readers."""
        with self._readers_lock:
            for reader in self._readers.values():
                reader.close()
            self._readers.clear()


class DolmaDataset:
    """A Dolma dataset folder: its documents files (sorted by path), each with the attribute
    sets that have a file at the same relative path."""

    def __init__(self, root: str) -> None:
        self.root = os.fspath(root)
        documents = os.path.join(self.root, "documents")
        if not os.path.isdir(documents):
            raise DolmaError(f"{self.root}: no documents/ folder (not a Dolma dataset)")
        sets_folder = os.path.join(self.root, "attributes")
        sets = sorted(n for n in os.listdir(sets_folder) if not n.startswith(".")) if os.path.isdir(sets_folder) else []
        self.files: list[DolmaFile] = []
        for relative in _document_files(documents):
            attributes = {}
            for name in sets:
                path = os.path.join(sets_folder, name, relative)
                if os.path.isfile(path):
                    attributes[name] = path
            self.files.append(DolmaFile(self.root, relative, attributes))
        if not self.files:
            raise DolmaError(f"{documents}: no {', '.join('*' + s for s in SUFFIXES)} files")


def _document_files(documents: str) -> list[str]:
    found = []
    for folder, dirs, names in os.walk(documents):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if strip_suffix(name) is not None and not name.startswith("."):
                found.append(os.path.relpath(os.path.join(folder, name), documents))
    return sorted(found)
