"""Dolma documents and attributes: reading, and mounting as a source.

A Dolma dataset is a folder with ``documents/`` (any tree of ``*.jsonl.gz``,
``*.jsonl.zst`` or ``*.jsonl`` files, one JSON document per line with at least
``id`` and ``text``) and ``attributes/<name>/`` folders mirroring it: the
attributes file at the same relative path holds, line for line, the
attributes of the same documents (``{"id": ..., "attributes": {...}}``).

Each documents file is a shard (:class:`DolmaFile`, a folder of the tree named
by its path under ``documents/`` without the suffix) read a block of
:data:`LINES_PER_BLOCK` lines at a time. Random access goes through seek
points made in the one pass over the file that :meth:`DolmaFile.prepare`
makes: for gzip, ``indexed_gzip``'s index (zran seek points every
:data:`SEEK_SPACING` bytes of text, so a read inflates at most that much
before its bytes); for zstd, the start of every frame (a reader going in
order continues where it stopped); plain files need none. What the pass
learned (block offsets, line count, alignment of every attribute set, bad
lines, seek points) is returned as bytes (:func:`encode_state`) that the tree
stores with the shard's file table; :meth:`DolmaFile.restore` takes them back
on a later mount, checked as untrusted input, so that mount makes no pass.

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
"""

from __future__ import annotations

import io
import json
import logging
import os
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zstandard

from ..errors import AtlasFormatError
from ..naming import MAX_NAME_BYTES, NO_KEY, example_fields, index_key_width
from .source import Source, SourceShard

if TYPE_CHECKING:
    from .factory import SourceOptions

log = logging.getLogger("atlasfs")

SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".jsonl")
#: Lines decoded together (a block of the tree).
LINES_PER_BLOCK = 512
#: Uncompressed bytes between two gzip seek points (a random read inflates at most this much in vain).
SEEK_SPACING = 1 << 20
#: A line longer than this is refused (a bomb or a broken file, not a document).
MAX_LINE_BYTES = 256 << 20
#: Bad lines kept per file for ``verify`` (the rest are counted); a file of garbage stays small.
MAX_PROBLEMS = 1000
#: Bad lines logged per file and mount before a summary line.
LOGGED_PROBLEMS = 10
#: Compressed files whose handles stay open at once, over all shards (the least recently read closes).
OPEN_FILES = 16
#: Version of the prepared state (:func:`encode_state`); another version is rebuilt.
STATE_VERSION = 1
STATE_MAGIC = b"atlasfs-dolma\n"
#: Most bytes a stored state may ask to be inflated to (its seek states; ~3% of a file's text).
MAX_STATE_BYTES = 1 << 32
_CHUNK = 1 << 20
#: Compressed bytes zran reads at a time for a block's read.
READ_BUFFER = 1 << 17


class DolmaError(AtlasFormatError):
    """A Dolma file or line that cannot be read; the message names it."""


def strip_suffix(name: str) -> str | None:
    """``name`` without its Dolma suffix, or None if it has none."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)]
    return None


def _kind(path: str) -> str:
    return "gz" if path.endswith(".gz") else "zst" if path.endswith(".zst") else "plain"


# ---------------------------------------------------------------- gzip seek states


_GZIDX_HEAD = struct.Struct("<5sBBQQIII")
_GZIDX_POINT = struct.Struct("<QQBB")


def check_gzip_index(state: bytes, compressed_size: int, text_bytes: int) -> list[tuple[int, int, int, int]]:
    """The points ``(compressed, uncompressed, bits, has window)`` of an ``indexed_gzip``
    index, after checking its whole structure against the file it is for; ``ValueError``
    if it does not fit (``zran`` trusts what it imports)."""
    if len(state) < _GZIDX_HEAD.size:
        raise ValueError("gzip index is too short")
    magic, version, _flags, csize, usize, spacing, window, npoints = _GZIDX_HEAD.unpack_from(state)
    if magic != b"GZIDX" or version > 1:
        raise ValueError("not an indexed_gzip index")
    if csize != compressed_size or 0 < usize < text_bytes:
        raise ValueError(f"gzip index is for {csize} -> {usize} bytes, not {compressed_size} -> {text_bytes}")
    text_bytes = max(usize, text_bytes)
    if not 32768 <= window <= 1 << 20 or spacing < window:
        raise ValueError("gzip index has a bad window or spacing")
    at = _GZIDX_HEAD.size
    if len(state) < at + npoints * _GZIDX_POINT.size:
        raise ValueError("gzip index is cut short")
    points = [_GZIDX_POINT.unpack_from(state, at + i * _GZIDX_POINT.size) for i in range(npoints)]
    windows = sum(p[3] for p in points)
    if len(state) != at + npoints * _GZIDX_POINT.size + windows * window:
        raise ValueError("gzip index has the wrong length")
    last = (0, 0)
    for cmp, uncmp, bits, flag in points:
        if bits > 7 or flag > 1 or cmp > compressed_size or uncmp > text_bytes or (cmp, uncmp) < last:
            raise ValueError("gzip index has a bad seek point")
        last = (cmp, uncmp)
    return points


def gzip_damage(path: str) -> str | None:
    """Why the gzip file at ``path`` is not whole (a member cut short, corrupt data), or None:
    one inflation of every member, keeping nothing."""
    text = 0
    with open(path, "rb") as f:
        inflater = zlib.decompressobj(wbits=31)
        data = b""
        while True:
            if not data:
                data = f.read(_CHUNK)
                if not data:
                    break
            try:
                text += len(inflater.decompress(data, _CHUNK))
            except zlib.error as exc:
                return f"{path}: gzip data is corrupt after {text} bytes of its text ({exc})"
            data = inflater.unconsumed_tail
            if inflater.eof:
                rest = inflater.unused_data + data or f.read(_CHUNK)
                if not rest.startswith(b"\x1f\x8b"):
                    return None  # the end, or zero padding or bytes that are no member: ignored, as zran does
                inflater = zlib.decompressobj(wbits=31)
                data = rest
    if inflater.eof:
        return None
    return f"{path}: truncated gzip member: its text ends after {text} bytes (the file is cut short)"


# ---------------------------------------------------------------- zstd frames


def zstd_frame_starts(path: str) -> tuple[list[int], int, str | None]:
    """Compressed offsets of the data frames of a zstd file (walked from their block
    headers, without decompressing), where the last complete one ends, and why the file
    ends early, or None."""
    starts: list[int] = []
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        at = 0
        while at < size:
            f.seek(at)
            head = f.read(18)
            if len(head) < 8:
                return starts, at, f"{path}: truncated zstd frame at byte {at}"
            magic = int.from_bytes(head[:4], "little")
            if 0x184D2A50 <= magic <= 0x184D2A5F:  # a skippable frame: its size follows
                at += 8 + int.from_bytes(head[4:8], "little")
                if at > size:
                    return starts, at, f"{path}: truncated skippable frame"
                continue
            if magic != 0xFD2FB528:
                return starts, at, f"{path}: not zstd data at byte {at}"
            descriptor = head[4]
            fcs_flag, single = descriptor >> 6, (descriptor >> 5) & 1
            checksum, dict_flag = (descriptor >> 2) & 1, descriptor & 3
            header = 1 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag] + ((1 if single else 0), 2, 4, 8)[fcs_flag]
            block_at = at + 4 + header
            while True:
                f.seek(block_at)
                raw = f.read(3)
                if len(raw) < 3:
                    return starts, at, f"{path}: truncated zstd frame at byte {at}"
                value = int.from_bytes(raw, "little")
                last, kind, block_size = value & 1, (value >> 1) & 3, value >> 3
                if kind == 3:
                    return starts, at, f"{path}: corrupt zstd block at byte {block_at}"
                block_at += 3 + (1 if kind == 1 else block_size)
                if last:
                    break
            end = block_at + (4 if checksum else 0)
            if end > size:
                return starts, at, f"{path}: truncated zstd frame at byte {at}"
            starts.append(at)
            at = end
    return starts, size, None


class _Slice(io.RawIOBase):
    """Bytes ``start:end`` of an open file, read with ``pread`` (the zstd reader's source)."""

    def __init__(self, fd: int, start: int, end: int) -> None:
        self.fd, self.pos, self.end = fd, start, end

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.end - self.pos)
        if want <= 0:
            return 0
        data = os.pread(self.fd, want, self.pos)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


# ---------------------------------------------------------------- one pass over a file's text


class _TextPass:
    """One streaming pass over a file's text, a chunk at a time, building its seek state.

    After :meth:`chunks` is exhausted: :attr:`seek_state` (what :class:`_Reader` needs
    to seek), :attr:`damage` (why the text ended early, or None) and :attr:`text_bytes`.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.kind = _kind(path)
        self.compressed_size = os.path.getsize(path)
        self.seek_state = b""
        self.damage: str | None = None
        self.text_bytes = 0
        self.gzip: Any = None  # the scan's indexed_gzip file, handed on to the reader

    def chunks(self) -> Iterator[bytes]:
        """The file's text in chunks of about a MiB."""
        if self.kind == "gz":
            yield from self._gzip_chunks()
        elif self.kind == "zst":
            yield from self._zstd_chunks()
        else:
            with open(self.path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    self.text_bytes += len(chunk)
                    yield chunk

    def _gzip_chunks(self) -> Iterator[bytes]:
        import indexed_gzip
        # zran builds its seek points while we read: one inflation gives the text and the index
        try:
            self.gzip = indexed_gzip.IndexedGzipFile(self.path, spacing=SEEK_SPACING, drop_handles=False)
            raw = self.gzip.raw
            while True:
                chunk = raw.read(_CHUNK)
                if not chunk:
                    break
                self.text_bytes += len(chunk)
                yield chunk
        except (OSError, ValueError, EOFError) as exc:  # corrupt data, a CRC error at a member's end
            self.damage = f"{self.path}: gzip data cannot be read past byte {self.text_bytes} of its text ({exc})"
        if self.gzip is None:
            return
        out = io.BytesIO()
        self.gzip.raw.export_index(fileobj=out)
        self.seek_state = out.getvalue()
        if self.damage is None:
            self.damage = self._gzip_trailer_problem()

    def _gzip_trailer_problem(self) -> str | None:
        # zran stops quietly where a truncated member ends. A file of one member ends with
        # the length of its whole text (mod 2^32), which a cut file has by a 2^-32 chance;
        # any other file (several members, or cut) is checked by one more inflation
        with open(self.path, "rb") as f:
            f.seek(max(self.compressed_size - 4, 0))
            tail = f.read(4)
        if len(tail) == 4 and int.from_bytes(tail, "little") == self.text_bytes % (1 << 32):
            return None
        return gzip_damage(self.path)

    def _zstd_chunks(self) -> Iterator[bytes]:
        starts, complete_end, self.damage = zstd_frame_starts(self.path)
        frames: list[tuple[int, int]] = []
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for i, start in enumerate(starts):
                end = starts[i + 1] if i + 1 < len(starts) else complete_end
                frames.append((start, self.text_bytes))
                # read_size bounds what one read inflates: a bomb fails at MAX_LINE_BYTES, not in memory
                reader = zstandard.ZstdDecompressor().stream_reader(_Slice(fd, start, end), read_size=1 << 17,
                                                                     read_across_frames=True)
                try:
                    while chunk := reader.read(_CHUNK):
                        self.text_bytes += len(chunk)
                        yield chunk
                except zstandard.ZstdError as exc:
                    self.damage = f"{self.path}: zstd frame at byte {start} cannot be read ({exc})"
                    break
        finally:
            os.close(fd)
            self.seek_state = np.array(frames, dtype="<u8").reshape(-1, 2).tobytes()


def _lines_of(chunks: Iterator[bytes], path: str) -> Iterator[tuple[int, bytes]]:
    """``(text offset, line without its newline)`` of every line in ``chunks``; the last
    line may lack a newline."""
    offset = 0  # of the first byte not yet yielded
    pending: list[bytes] = []
    pending_bytes = 0
    for chunk in chunks:
        if b"\n" not in chunk:  # a long line: gather its pieces, join once
            pending.append(chunk)
            pending_bytes += len(chunk)
            if pending_bytes > MAX_LINE_BYTES:
                raise DolmaError(f"{path}: a line at byte {offset} of its text is longer than {MAX_LINE_BYTES} bytes")
            continue
        if pending:
            chunk = b"".join([*pending, chunk])
            pending.clear()
            pending_bytes = 0
        parts = chunk.split(b"\n")
        rest = parts.pop()
        for line in parts:
            yield offset, line
            offset += len(line) + 1
        if rest:
            pending.append(rest)
            pending_bytes = len(rest)
    if pending:
        yield offset, b"".join(pending)


def _line_id(line: bytes) -> tuple[dict[str, Any] | None, str | None]:
    """The parsed line and its id, or None for what is missing."""
    try:
        # decoded here: json.loads would first guess the bytes' encoding, a third of its time
        value = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # not UTF-8 or not JSON
        return None, None
    if type(value) is not dict:
        return None, None
    doc_id = value.get("id")
    return value, doc_id if type(doc_id) is str else None


def _sample(line: bytes, value: dict[str, Any] | None, doc_id: str | None,
            attributes: dict[str, bytes]) -> dict[str, Any]:
    """The sample of one documents line (one place, so that decoding and describing agree)."""
    sample: dict[str, Any] = {"json": line}
    if value is not None and doc_id is not None:
        sample["__key__"] = doc_id
        if type(value.get("text")) is str:
            sample["text"] = value["text"]
        for name, attribute in attributes.items():
            sample[f"{name}.json"] = attribute
    return sample


#: ``text_len`` codes: no ``text`` field, and a text the naming layer would not show as ``.text``.
_NO_TEXT = -1
_ODD_TEXT = -2


def _text_len(value: dict[str, Any] | None, doc_id: str | None) -> int:
    if value is None or doc_id is None:
        return _NO_TEXT
    text = value.get("text")
    if type(text) is not str:
        return _NO_TEXT
    if text.isascii():
        return len(text)
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:  # lone surrogates from \\ud800 escapes: named otherwise
        return _ODD_TEXT


@dataclass
class Scan:
    """What one pass over a documents file and its attributes files learned."""

    block_starts: np.ndarray  # text offset of each block's first line, and the end (uint64)
    lines: int  # complete lines read
    problems: list[str] = field(default_factory=list)  # lines that are not documents
    more_problems: int = 0  # bad lines beyond MAX_PROBLEMS
    attribute_starts: dict[str, np.ndarray] = field(default_factory=dict)  # sets that line up
    left_out: dict[str, str] = field(default_factory=dict)  # set name -> why it does not line up
    seek_states: dict[str, bytes] = field(default_factory=dict)  # file path -> its seek state
    damage: str | None = None  # why the documents text ends early: its last block fails
    text_bytes: int = 0  # documents text read


@dataclass
class _Described:
    """What the pass measured of every line, for :meth:`DolmaFile.describe_block` (kept until
    every block has been described once: a listing needs it once)."""

    ids: list[str | None]
    json_len: np.ndarray
    text_len: np.ndarray
    attribute_len: dict[str, np.ndarray]
    pending: set[int]


# ---------------------------------------------------------------- positioned reads


class _OpenFiles:
    """Bounds the file handles readers keep open, over every shard: the least recently
    read reader is closed (and reopens from its seek state when read again)."""

    def __init__(self, limit: int = OPEN_FILES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[int, _Reader] = OrderedDict()

    def touch(self, reader: "_Reader") -> list["_Reader"]:
        """Mark ``reader`` as just read; the readers to close now (by the caller, holding no lock)."""
        with self._lock:
            self._open[id(reader)] = reader
            self._open.move_to_end(id(reader))
            victims = []
            while len(self._open) > self.limit:
                victims.append(self._open.popitem(last=False)[1])
            return victims

    def forget(self, reader: "_Reader") -> None:
        with self._lock:
            self._open.pop(id(reader), None)


class _Reader:
    """Positioned reads of a file's text, through its seek state (for gzip, zstd-compressed).

    Safe for use from many threads: one lock per file, held for a seek and its read
    (one zran stream or zstd cursor per file); reads of different files run at once.
    It keeps one handle open while it is among the :data:`OPEN_FILES` most recently read.
    """

    def __init__(self, path: str, state: bytes, files: _OpenFiles, gzip_file: Any = None) -> None:
        self.path = path
        self.kind = _kind(path)
        self._state = state
        self._files = files
        self._lock = threading.Lock()
        self._gzip: Any = gzip_file  # indexed_gzip file (its seek points imported)
        self._fd: int | None = None
        self._frames = (np.frombuffer(state, dtype="<u8").reshape(-1, 2) if self.kind == "zst" and state
                        else np.zeros((0, 2), dtype="<u8"))
        self._cursor: tuple[Any, int, int] | None = None  # zstd: (stream reader, frame, text offset)
        #: seeks into compressed data so far (a random read of one block is one)
        self.seeks = 0

    def read(self, start: int, end: int) -> bytes:
        """Text bytes ``start:end``; :class:`DolmaError` naming the file if they cannot be read."""
        with self._lock:
            try:
                data = self._read(start, end)
            except DolmaError:
                raise
            except (OSError, ValueError, EOFError, zstandard.ZstdError) as exc:
                self._close()
                raise DolmaError(f"{self.path}: cannot read bytes {start}-{end} of its text ({exc})") from None
        for victim in self._files.touch(self):
            if victim is not self:
                victim.close()
        return data

    def _read(self, start: int, end: int) -> bytes:
        if self.kind == "gz":
            if self._gzip is None:
                import indexed_gzip
                # small reads of compressed data: a random read wants a block's span, not a MiB more
                gzip_file = indexed_gzip.IndexedGzipFile(self.path, spacing=SEEK_SPACING, drop_handles=False,
                                                         readbuf_size=READ_BUFFER)
                if self._state:  # kept compressed: zran's index holds 32 KiB per seek point
                    index = zstandard.ZstdDecompressor().decompress(self._state)
                    gzip_file.raw.import_index(fileobj=io.BytesIO(index))
                self._gzip = gzip_file
            self.seeks += 1
            raw = self._gzip.raw  # unbuffered: reads exactly the span asked for
            raw.seek(start)
            return raw.read(end - start)
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        if self.kind == "plain":
            return os.pread(self._fd, end - start, start)
        return self._read_zstd(start, end)

    def _read_zstd(self, start: int, end: int) -> bytes:
        assert self._fd is not None
        frames = self._frames
        frame = max(int(np.searchsorted(frames[:, 1], start, side="right")) - 1, 0) if len(frames) else -1
        if frame < 0:
            return b""
        cursor = self._cursor
        # a reader going in order continues the decompression where it stopped (a frame may
        # hold the whole file); any other read starts at the frame holding its first byte
        if cursor is None or not int(frames[frame, 1]) <= cursor[2] <= start:
            self.seeks += 1
            reader = zstandard.ZstdDecompressor().stream_reader(
                _Slice(self._fd, int(frames[frame, 0]), os.fstat(self._fd).st_size), read_size=1 << 17,
                read_across_frames=True)
            cursor = (reader, frame, int(frames[frame, 1]))
        reader, _, at = cursor
        while at < start:
            got = reader.read(min(start - at, _CHUNK))
            if not got:
                break
            at += len(got)
        out = []
        while at < end:
            got = reader.read(min(end - at, 4 * _CHUNK))
            if not got:
                break
            out.append(got)
            at += len(got)
        self._cursor = (reader, frame, at)
        return b"".join(out)

    def _close(self) -> None:
        if self._gzip is not None:
            self._gzip.close()
            self._gzip = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self._cursor = None

    def close(self) -> None:
        """Close its handle (reopened by the next read)."""
        with self._lock:
            self._close()
        self._files.forget(self)


# ---------------------------------------------------------------- the prepared state


def _pack(index: bytes) -> bytes:
    """A gzip index as kept in memory and stored: zstd-compressed (its windows are text)."""
    return zstandard.ZstdCompressor(level=3).compress(index) if index else b""


def _array_ok(values: np.ndarray, count: int, limit: int, what: str) -> None:
    if values.shape != (count,):
        raise ValueError(f"{what}: {values.shape[0]} values where {count} are needed")
    if count and (int(values[0]) < 0 or int(values[-1]) > limit or bool(np.any(np.diff(values.astype(np.int64)) < 0))):
        raise ValueError(f"{what}: offsets out of order or past the text's end")


def encode_state(scan: Scan, path: str, attributes: dict[str, str]) -> bytes:
    """``scan`` as bytes: a magic line, a JSON header, then the arrays and seek states it
    points at (little-endian uint64 arrays; zstd frame offsets; gzip indexes zstd-compressed,
    ~1% of the text). ``attributes`` maps set names to files, for their seek states."""
    body = bytearray()

    def put(data: bytes, packed: bool = False) -> list[int]:
        body.extend(data)
        ref = [len(body) - len(data), len(data)]
        return [*ref, zstandard.frame_content_size(data)] if packed else ref

    sets: dict[str, Any] = {}
    for name in sorted(attributes):
        if name in scan.left_out:
            sets[name] = {"left_out": scan.left_out[name]}
        else:
            sets[name] = {"starts": put(scan.attribute_starts[name].astype("<u8").tobytes())}
    seek = {}
    for role, file in [("documents", path), *((f"attributes/{n}", p) for n, p in sorted(attributes.items()))]:
        if scan.seek_states.get(file):
            seek[role] = put(scan.seek_states[file], packed=_kind(file) == "gz")
    header = {
        "version": STATE_VERSION,
        "lines_per_block": LINES_PER_BLOCK,
        "lines": scan.lines,
        "text_bytes": scan.text_bytes,
        "damage": scan.damage,
        "problems": scan.problems,
        "more_problems": scan.more_problems,
        "blocks": put(scan.block_starts.astype("<u8").tobytes()),
        "sets": sets,
        "seek": seek,
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return STATE_MAGIC + struct.pack("<I", len(head)) + head + bytes(body)


# ---------------------------------------------------------------- a documents file: a shard


class DolmaFile(SourceShard):
    """One documents file with its attribute sets: a shard, a folder of the tree."""

    first_index = 0

    def __init__(self, root: str, relative: str, attributes: dict[str, str],
                 files: _OpenFiles | None = None) -> None:
        self.root = root
        self.relative = relative  # path under documents/
        self.path = os.path.join(root, "documents", relative)
        self.name = strip_suffix(relative) or relative
        self.attributes = attributes  # set name -> its file's path
        self.error = None
        self._sizes: dict[str, int] = {}
        try:
            st = os.stat(self.path)
            self.mtime = st.st_mtime
            self._sizes = {path: os.path.getsize(path) for path in self.files()}
        except OSError as exc:
            self.error = DolmaError(f"{exc.filename or self.path}: cannot be read ({exc.strerror})")
            self.mtime = 0.0
        self.data_size = sum(self._sizes.values())
        self.scan_result: Scan | None = None
        self._described: _Described | None = None
        self._files = files or _OpenFiles()
        self._readers: dict[str, _Reader] = {}
        self._readers_lock = threading.Lock()
        self._prepare_lock = threading.Lock()

    def files(self) -> list[str]:
        """The files its samples come from."""
        return [self.path, *self.attributes.values()]

    def table_files(self) -> list[str]:
        """The documents file and its attributes files."""
        return self.files()

    def table_key(self) -> dict[str, Any]:
        """The base key plus what decides this format's blocks."""
        return {**super().table_key(), "dolma": STATE_VERSION, "lines_per_block": LINES_PER_BLOCK}

    # -- the pass

    def scan(self) -> Scan:
        """One pass over the documents file and every attributes file: block offsets, ids,
        alignment, sizes and seek points (one decompression of each file)."""
        if self.error is not None:
            raise self.error
        starts: list[int] = []
        ids: list[str | None] = []
        json_len: list[int] = []
        text_len: list[int] = []
        problems: list[str] = []
        more = 0
        end = 0  # text offset after the last line's newline
        last_offset = 0
        text = _TextPass(self.path)
        loads, add_id, add_json, add_text = json.loads, ids.append, json_len.append, text_len.append
        for number, (offset, line) in enumerate(_lines_of(text.chunks(), self.path)):
            if not number % LINES_PER_BLOCK:
                starts.append(offset)
            # _line_id and _text_len inlined: this loop runs once per document of the dataset
            try:
                value = loads(line.decode("utf-8"))
            except (ValueError, RecursionError):
                value = None
            doc_id = value.get("id") if type(value) is dict else None
            if type(doc_id) is str:
                body = value.get("text")  # type: ignore[union-attr]
                add_text(_NO_TEXT if type(body) is not str else len(body) if body.isascii()
                         else _text_len(value, doc_id))
            else:
                add_text(_NO_TEXT)
                if len(problems) < MAX_PROBLEMS:
                    what = "no string id" if type(value) is dict else "not a JSON object"
                    problems.append(f"{self.path} line {number + 1}: {what}; shown only as its index key's .json")
                else:
                    more += 1
                doc_id = None
            add_id(doc_id)
            add_json(len(line))
            last_offset, end = offset, offset + len(line) + 1
        if text.damage is not None and text.text_bytes == 0:
            raise DolmaError(text.damage)
        if text.damage is not None and ids and end > text.text_bytes:
            # the damage cut the last line: it is lost with the rest, not a document
            if ids.pop() is None:
                if more:
                    more -= 1
                else:
                    problems.pop()
            json_len.pop()
            text_len.pop()
            if len(ids) % LINES_PER_BLOCK == 0:
                starts.pop()
            end = last_offset
        lines = len(ids)
        end = min(end, text.text_bytes)
        if text.damage is not None:
            # the lines after the damage are lost: the block they fall in fails alone
            if lines % LINES_PER_BLOCK == 0:
                starts.append(end)
            end = text.text_bytes
        self._drop_readers()
        scan = Scan(np.array([*starts, end], dtype=np.uint64), lines, problems, more,
                    damage=text.damage, text_bytes=text.text_bytes)
        if text.kind == "gz":
            scan.seek_states[self.path] = _pack(text.seek_state)
            if text.gzip is not None:  # keep the scan's zran index rather than importing it again
                with self._readers_lock:
                    self._readers[self.path] = _Reader(self.path, scan.seek_states[self.path], self._files, text.gzip)
        elif text.seek_state:
            scan.seek_states[self.path] = text.seek_state
        attribute_len: dict[str, np.ndarray] = {}
        for name, path in sorted(self.attributes.items()):
            why, attribute_starts, lengths, state = self._line_up(path, ids, scan)
            if why is None:
                if state:
                    scan.seek_states[path] = _pack(state) if _kind(path) == "gz" else state
                scan.attribute_starts[name] = attribute_starts
                attribute_len[name] = lengths
            else:
                scan.left_out[name] = why
        self._described = _Described(ids, np.array(json_len, dtype=np.int64), np.array(text_len, dtype=np.int64),
                                      attribute_len, set(range(len(scan.block_starts) - 1)))
        self.scan_result = scan
        return scan

    def _drop_readers(self) -> None:
        with self._readers_lock:
            readers = list(self._readers.values())
            self._readers.clear()
        for reader in readers:
            reader.close()

    def _line_up(self, path: str, ids: list[str | None], scan: Scan) -> tuple[str | None, np.ndarray, np.ndarray, bytes]:
        """Why the attributes file at ``path`` does not line up with the documents (None if it
        does), its block starts, its lines' lengths and its seek state."""
        starts: list[int] = []
        lengths: list[int] = []
        end = 0
        number = -1
        text = _TextPass(path)
        why = None
        try:
            for number, (offset, line) in enumerate(_lines_of(text.chunks(), path)):
                if number >= len(ids):
                    if scan.damage is None:
                        _, attribute_id = _line_id(line)
                        why = (f"{path} line {number + 1}: id {attribute_id!r} where {self.path} has no line "
                               f"(it has {len(ids)})")
                    break
                if number % LINES_PER_BLOCK == 0:
                    starts.append(offset)
                _, attribute_id = _line_id(line)
                if attribute_id != ids[number]:
                    why = f"{path} line {number + 1}: id {attribute_id!r} where {self.path} has {ids[number]!r}"
                    break
                lengths.append(len(line))
                end = offset + len(line) + 1
        except DolmaError as exc:
            why = str(exc)
        finally:
            if text.gzip is not None:
                text.gzip.close()
        if why is None and text.damage is not None:
            why = text.damage
        if why is None and number + 1 < len(ids):
            why = (f"{path} line {number + 2}: no line (it has {number + 1}) where {self.path} has "
                   f"{ids[number + 1]!r}")
        if why is not None:
            return why, np.zeros(0, np.uint64), np.zeros(0, np.int64), b""
        end = min(end, text.text_bytes)
        blocks = len(scan.block_starts) - 1
        while len(starts) < blocks:  # the documents' failing block: no attribute lines read for it
            starts.append(end)
        return None, np.array([*starts, end], dtype=np.uint64), np.array(lengths, dtype=np.int64), text.seek_state

    def prepare(self) -> bytes:
        """Scan the files (see :meth:`scan`) and return all the scan learned
        (:func:`encode_state`). The tree logs :meth:`problems` after a prepare."""
        with self._prepare_lock:
            return encode_state(self.scan(), self.path, self.attributes)

    def restore(self, state: bytes) -> None:
        """Take back :meth:`prepare`'s bytes without reading the files; ``ValueError`` if they
        are malformed or do not fit the files as they are now (sizes, attribute sets)."""
        try:
            scan = self._decode_state(state)
        except ValueError:
            raise
        except Exception as exc:  # untrusted bytes: anything odd in them is "does not fit"
            raise ValueError(f"{self.path}: stored state is malformed ({type(exc).__name__}: {exc})") from None
        with self._prepare_lock:
            self._drop_readers()
            self.scan_result = scan
            self._described = None
        self._log_findings()

    def _decode_state(self, state: bytes) -> Scan:
        if self.error is not None:
            raise ValueError(str(self.error))
        state = bytes(state)
        if not state.startswith(STATE_MAGIC) or len(state) < len(STATE_MAGIC) + 4:
            raise ValueError(f"{self.path}: stored state is not a Dolma state")
        at = len(STATE_MAGIC)
        (head_len,) = struct.unpack_from("<I", state, at)
        at += 4
        if at + head_len > len(state):
            raise ValueError(f"{self.path}: stored state is cut short")
        header = json.loads(state[at:at + head_len])
        body = memoryview(state)[at + head_len:]
        if type(header) is not dict or header.get("version") != STATE_VERSION \
                or header.get("lines_per_block") != LINES_PER_BLOCK:
            raise ValueError(f"{self.path}: stored state has another version")
        expected = {"version", "lines_per_block", "lines", "text_bytes", "damage", "problems", "more_problems",
                    "blocks", "sets", "seek"}
        if set(header) != expected:
            raise ValueError(f"{self.path}: stored state has fields {sorted(header)}")

        def integer(value: Any, what: str, limit: int = 1 << 62) -> int:
            if type(value) is not int or not 0 <= value <= limit:
                raise ValueError(f"{self.path}: stored {what} is not a count")
            return value

        def text(value: Any, what: str) -> str:
            if type(value) is not str or "\n" in value or len(value) > 4096:
                raise ValueError(f"{self.path}: stored {what} is not one line")
            return value

        def blob(ref: Any, what: str, packed: bool = False) -> bytes:
            if type(ref) is not list or len(ref) != (3 if packed else 2) \
                    or any(type(v) is not int or v < 0 for v in ref) or ref[0] + ref[1] > len(body):
                raise ValueError(f"{self.path}: stored {what} lies outside the state")
            return bytes(body[ref[0]:ref[0] + ref[1]])

        def unpack(data: bytes, raw_length: int, what: str) -> bytes:
            # a bomb cannot pass: the frame must say the length the header says, within bounds
            if raw_length > MAX_STATE_BYTES or zstandard.frame_content_size(data) != raw_length:
                raise ValueError(f"{self.path}: stored {what} has a bad length")
            raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=raw_length)
            if len(raw) != raw_length:
                raise ValueError(f"{self.path}: stored {what} has the wrong length")
            return raw

        def offsets(ref: Any, count: int, limit: int, what: str) -> np.ndarray:
            data = blob(ref, what)
            if len(data) % 8:
                raise ValueError(f"{self.path}: stored {what} is not uint64 values")
            values = np.frombuffer(data, dtype="<u8").astype(np.uint64)
            _array_ok(values, count, limit, f"{self.path}: stored {what}")
            return values

        lines = integer(header["lines"], "line count")
        text_bytes = integer(header["text_bytes"], "text size")
        damage = None if header["damage"] is None else text(header["damage"], "damage")
        kind = _kind(self.path)
        size = self._sizes[self.path]
        if kind == "plain" and (text_bytes != size or damage is not None):
            raise ValueError(f"{self.path}: stored state is for another file ({text_bytes} bytes, not {size})")
        if lines > text_bytes + 1:
            raise ValueError(f"{self.path}: stored line count exceeds the text")
        blocks = -(-lines // LINES_PER_BLOCK) + (1 if damage is not None and lines % LINES_PER_BLOCK == 0 else 0)
        block_starts = offsets(header["blocks"], blocks + 1, text_bytes, "block offsets")
        if blocks and (int(block_starts[0]) != 0 or (damage is None and int(block_starts[-1]) + 1 < text_bytes)):
            raise ValueError(f"{self.path}: stored block offsets do not span the text")
        problems = header["problems"]
        if type(problems) is not list or len(problems) > MAX_PROBLEMS:
            raise ValueError(f"{self.path}: stored problems are not a list")
        scan = Scan(block_starts, lines, [text(p, "problem") for p in problems],
                    integer(header["more_problems"], "problem count"), damage=damage, text_bytes=text_bytes)
        sets, seek = header["sets"], header["seek"]
        if type(sets) is not dict or set(sets) != set(self.attributes):
            raise ValueError(f"{self.path}: stored attribute sets {sorted(sets) if type(sets) is dict else sets!r} "
                             f"are not the ones there are now {sorted(self.attributes)}")
        if type(seek) is not dict:
            raise ValueError(f"{self.path}: stored seek states are not a mapping")
        roles = {"documents": self.path, **{f"attributes/{n}": p for n, p in self.attributes.items()}}
        if not set(seek) <= set(roles):
            raise ValueError(f"{self.path}: stored seek states for unknown files")
        text_of: dict[str, int] = {self.path: text_bytes}
        for name, entry in sets.items():
            if type(entry) is not dict or set(entry) not in ({"left_out"}, {"starts"}):
                raise ValueError(f"{self.path}: stored attribute set {name!r} is malformed")
            if "left_out" in entry:
                scan.left_out[name] = text(entry["left_out"], "reason")
            else:
                path = self.attributes[name]
                starts = offsets(entry["starts"], blocks + 1, 1 << 62, f"offsets of {path}")
                if _kind(path) == "plain" and int(starts[-1]) > self._sizes[path]:
                    raise ValueError(f"{self.path}: stored offsets of {path} pass its end")
                scan.attribute_starts[name] = starts
                text_of[path] = int(starts[-1])
        for role, ref in seek.items():
            path = roles[role]
            packed = _kind(path) == "gz"
            data = blob(ref, f"seek state of {path}", packed)
            if path not in text_of:
                raise ValueError(f"{self.path}: stored seek state for the left-out {path}")
            self._check_seek_state(path, unpack(data, ref[2], f"seek state of {path}") if packed else data,
                                   text_of[path])
            scan.seek_states[path] = data
        for path in text_of:
            if _kind(path) != "plain" and path not in scan.seek_states and text_of[path]:
                raise ValueError(f"{self.path}: stored state has no seek state for {path}")
        return scan

    def _check_seek_state(self, path: str, data: bytes, text_end: int) -> None:
        kind = _kind(path)
        size = self._sizes[path]
        if kind == "gz":
            points = check_gzip_index(data, size, max(text_end, 0))
            if path == self.path and points and max(p[1] for p in points) > text_end:
                raise ValueError(f"{self.path}: stored gzip index passes the text's end")
        elif kind == "zst":
            if len(data) % 16:
                raise ValueError(f"{self.path}: stored zstd frames of {path} are not offset pairs")
            frames = np.frombuffer(data, dtype="<u8").reshape(-1, 2).astype(np.int64)
            if len(frames) and (tuple(frames[0]) != (0, 0) or bool(np.any(np.diff(frames[:, 0]) <= 0))
                                or bool(np.any(np.diff(frames[:, 1]) < 0)) or int(frames[-1, 0]) >= size):
                raise ValueError(f"{self.path}: stored zstd frames of {path} are out of order")
        elif data:
            raise ValueError(f"{self.path}: stored seek state for the plain file {path}")

    def _log_findings(self) -> None:
        """What a mount that restores (and so makes no pass) still tells, as the tree does
        after a prepare: a line per attribute set left out and per damage, the first
        :data:`LOGGED_PROBLEMS` bad lines and a count of the rest."""
        bad_line = f"{self.path} line "
        shown = hidden = 0
        for problem in self.problems():
            if problem.startswith(bad_line):
                if shown == LOGGED_PROBLEMS:
                    hidden += 1
                    continue
                shown += 1
            log.warning("%s", problem)
        if hidden:
            log.warning("%s: %d more lines that are not documents (atlasfs verify lists them)", self.path, hidden)

    def problems(self) -> list[str]:
        """Bad lines, attribute sets left out, and damage, one line each."""
        scan = self.scan_result
        if scan is None:
            return [str(self.error)] if self.error else []
        found = list(scan.problems)
        if scan.more_problems:
            found.append(f"{self.path}: {scan.more_problems} more lines that are not documents")
        found += [f"{why} (attribute set {name!r} left out)" for name, why in sorted(scan.left_out.items())]
        if scan.damage:
            found.append(f"{scan.damage} (block {self.num_blocks - 1} fails)")
        return found

    # -- blocks

    def _reader(self, path: str) -> _Reader:
        with self._readers_lock:
            reader = self._readers.get(path)
            if reader is None:
                state = self.scan_result.seek_states.get(path, b"") if self.scan_result else b""
                reader = self._readers[path] = _Reader(path, state, self._files)
            return reader

    def _scanned(self) -> Scan:
        if self.scan_result is None:
            raise DolmaError(f"{self.path}: read before it was prepared")
        return self.scan_result

    @property
    def num_blocks(self) -> int:
        """Blocks of lines (needs :meth:`prepare` or :meth:`restore`)."""
        return len(self._scanned().block_starts) - 1

    @property
    def block_size(self) -> int:
        """Lines per block."""
        return LINES_PER_BLOCK

    @property
    def key_width(self) -> int:
        """Digits of its lines' index keys."""
        scan = self._scanned()
        return index_key_width(scan.lines + (1 if scan.damage else 0))

    def block_length(self, block: int) -> int:
        """Lines in ``block`` (the failing last block of a damaged file counts one for what is lost)."""
        scan = self._scanned()
        if scan.damage is not None and block == self.num_blocks - 1:
            return scan.lines - block * LINES_PER_BLOCK + 1
        return min(LINES_PER_BLOCK, scan.lines - block * LINES_PER_BLOCK)

    def block_where(self, block: int) -> str:
        """``<file> lines <first>-<last>`` of ``block`` (1-based, as editors count)."""
        first = block * LINES_PER_BLOCK + 1
        return f"{self.path} lines {first}-{first + self.block_length(block) - 1}"

    def stored_block_size(self, block: int) -> int:
        """Compressed bytes a block's read takes, estimated from the files' compression ratios."""
        scan = self._scanned()
        total = 0
        for path, starts in [(self.path, scan.block_starts), *((self.attributes[n], s) for n, s in scan.attribute_starts.items())]:
            span = int(starts[block + 1]) - int(starts[block])
            text_end = max(int(starts[-1]), 1)
            total += min(span, span * self._sizes.get(path, text_end) // text_end)
        return total

    def decode_block(self, block: int) -> tuple[list[Any], int]:
        """The samples of ``block`` and about the bytes they hold."""
        scan = self._scanned()
        if not 0 <= block < self.num_blocks:
            raise DolmaError(f"{self.path}: no block {block}")
        if scan.damage is not None and block == self.num_blocks - 1:
            raise DolmaError(f"{scan.damage}; lines from {block * LINES_PER_BLOCK + 1} on are lost")
        lo, hi = (int(v) for v in scan.block_starts[block:block + 2])
        expected = self.block_length(block)
        lines = self._split(self._reader(self.path).read(lo, hi), expected, self.path, block)
        cost = hi - lo
        attribute_lines: dict[str, list[bytes]] = {}
        for name, starts in scan.attribute_starts.items():
            path = self.attributes[name]
            a, b = (int(v) for v in starts[block:block + 2])
            attribute_lines[name] = self._split(self._reader(path).read(a, b), expected, path, block)
            cost += b - a
        samples = []
        for i, line in enumerate(lines):
            value, doc_id = _line_id(line)
            samples.append(_sample(line, value, doc_id, {n: al[i] for n, al in attribute_lines.items()}))
        # the lines' bytes are held twice (raw .json and parsed text), plus a dict per sample
        return samples, 2 * cost + 400 * len(samples)

    @staticmethod
    def _split(data: bytes, expected: int, path: str, block: int) -> list[bytes]:
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        if len(lines) != expected:
            raise DolmaError(f"{path}: block {block} has {len(lines)} lines where its scan found {expected} "
                             f"(the file changed?)")
        return lines

    def describe_block(self, block: int) -> list[tuple[Any, list[tuple[str, int]]]] | None:
        """Each line's key and files with their sizes, from what :meth:`prepare` measured
        (no decompression); given once per block after a pass, else None (decode instead)."""
        described, scan = self._described, self.scan_result
        if described is None or scan is None or block not in described.pending:
            return None
        if scan.damage is not None and block == self.num_blocks - 1:
            return None
        described.pending.discard(block)
        if not described.pending:
            self._described = None  # every block described: the listing has it all now
        lo = block * LINES_PER_BLOCK
        hi = lo + self.block_length(block)
        max_suffix = MAX_NAME_BYTES - 1 - self.key_width
        sets = list(scan.attribute_starts)
        ids = described.ids[lo:hi]
        columns = {"json": described.json_len[lo:hi].tolist(), "text": described.text_len[lo:hi].tolist(),
                   **{f"{n}.json": described.attribute_len[n][lo:hi].tolist() for n in sets}}
        if _ODD_TEXT in columns["text"]:
            return None  # named otherwise by the naming layer: let the tree decode the block
        patterns: dict[tuple[bool, bool], list[str]] = {}
        out: list[tuple[Any, list[tuple[str, int]]]] = []
        for i, doc_id in enumerate(ids):
            shape = (doc_id is not None, columns["text"][i] >= 0)
            suffixes = patterns.get(shape)
            if suffixes is None:
                # the naming layer decides names and order, from a stand-in sample of the same shape
                stand_in = _sample(b"", {"text": ""} if shape[1] else {}, "x" if shape[0] else None,
                                   {n: b"" for n in sets})
                fields, note = example_fields(stand_in, max_suffix)
                if note is not None:
                    return None
                suffixes = patterns[shape] = [suffix for suffix, _ in fields]
            out.append((doc_id if doc_id is not None else NO_KEY, [(s, columns[s][i]) for s in suffixes]))
        return out

    def close(self) -> None:
        """Close the files' readers."""
        with self._readers_lock:
            readers = list(self._readers.values())
        for reader in readers:
            reader.close()


# ---------------------------------------------------------------- the dataset


class DolmaDataset:
    """A Dolma dataset folder: its documents files (sorted by path), each with the attribute
    sets that have a file at the same relative path."""

    def __init__(self, root: str) -> None:
        self.root = os.fspath(root)
        documents = os.path.join(self.root, "documents")
        if not os.path.isdir(documents):
            raise DolmaError(f"{self.root}: no documents/ folder (not a Dolma dataset)")
        self.sets_folder = os.path.join(self.root, "attributes")
        try:
            self.sets = sorted(n for n in os.listdir(self.sets_folder)
                               if not n.startswith(".") and os.path.isdir(os.path.join(self.sets_folder, n)))
        except OSError:
            self.sets = []
        files = _OpenFiles()
        self.files: list[DolmaFile] = []
        for relative in _document_files(documents):
            attributes = {}
            for name in self.sets:
                path = os.path.join(self.sets_folder, name, relative)
                if os.path.isfile(path):
                    attributes[name] = path
            self.files.append(DolmaFile(self.root, relative, attributes, files))
        if not self.files:
            raise DolmaError(f"{documents}: no {', '.join('*' + s for s in SUFFIXES)} files")
        _unique_names(self.files)


def _unique_names(files: Sequence[DolmaFile]) -> None:
    """Give the files whose names clash (``a.jsonl.gz`` and ``a.jsonl``), or whose name is a
    folder of another's (``a.jsonl.gz`` and ``a/b.jsonl.gz``), their full relative path
    instead: two files cannot have one path, nor a file and a folder."""
    while True:
        seen: dict[str, list[DolmaFile]] = {}
        for file in files:
            seen.setdefault(file.name, []).append(file)
        folders = {"/".join(file.name.split("/")[:i]) for file in files for i in range(1, file.name.count("/") + 1)}
        clashing = [f for name, group in seen.items() for f in group
                    if (len(group) > 1 or name in folders) and f.name != f.relative]
        if not clashing:
            return
        for file in clashing:
            file.name = file.relative


def _document_files(documents: str) -> list[str]:
    found = []
    for folder, dirs, names in os.walk(documents):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if strip_suffix(name) is not None and not name.startswith("."):
                found.append(os.path.relpath(os.path.join(folder, name), documents).replace(os.sep, "/"))
    return sorted(found)


class DolmaSource(Source):
    """A Dolma dataset as a source: a shard per documents file, in path order."""

    kind = "dolma"

    def __init__(self, root: str) -> None:
        self.dataset = DolmaDataset(root)
        self.root = self.dataset.root

    @property
    def shards(self) -> Sequence[DolmaFile]:
        """Its documents files."""
        return self.dataset.files

    def problems(self) -> list[str]:
        """Attributes files with no documents file at their path (no shard would show them)."""
        found = []
        relatives = {file.relative for file in self.dataset.files}
        for name in self.dataset.sets:
            folder = os.path.join(self.dataset.sets_folder, name)
            for relative in _document_files(folder):
                if relative not in relatives:
                    found.append(f"{os.path.join(folder, relative)}: no documents file "
                                 f"documents/{relative} (attribute set {name!r})")
        return found

    def info(self) -> list[str]:
        """The dataset, its documents files and attribute sets."""
        files = self.dataset.files
        sets = ", ".join(self.dataset.sets) or "none"
        return [f"dolma dataset {self.root}",
                f"documents files: {len(files)} ({sum(f.data_size for f in files)} bytes with their attributes); "
                f"attribute sets: {sets}; {LINES_PER_BLOCK} lines per block"]


def looks_like(path: str) -> bool:
    """A folder with a ``documents/`` folder (no file is opened)."""
    return os.path.isdir(os.path.join(path, "documents"))


def open_source(path: str, options: "SourceOptions") -> DolmaSource:
    """The Dolma dataset at ``path`` (``options`` change nothing for this format)."""
    return DolmaSource(path)
