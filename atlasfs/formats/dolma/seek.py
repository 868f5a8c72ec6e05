"""Dolma's seek machinery: one pass over a file's text, and positioned reads after it.

A documents or attributes file is gzip, zstd or plain text. :class:`TextPass` reads its
text once, a chunk at a time, and builds its *seek state* on the way: for gzip,
``indexed_gzip``'s index (zran seek points every :data:`SEEK_SPACING` bytes of text, so a
read inflates at most that much before its bytes); for zstd, the start of every frame
(walked from the frame and block headers, :func:`zstd_frame_starts`); plain files need
none. It also finds where a compressed file ends early (:func:`gzip_damage`).
:class:`Reader` then reads any span of the text through that seek state, and
:class:`OpenFiles` bounds the handles the readers of a mount keep open.
:func:`check_gzip_index` checks a stored gzip index (zran trusts what it imports).
"""

from __future__ import annotations

import errno
import io
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import numpy as np
import zstandard

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.dolma.names import file_kind
from atlasfs.storage import LOCAL, LocalStorage, Storage
from atlasfs.storage.files import RANGED_RUN, transient_failure

#: Uncompressed bytes between two gzip seek points (a random read inflates at most this much in vain).
SEEK_SPACING = 1 << 20
#: Compressed files whose handles stay open at once, over all shards (the least recently read closes).
OPEN_FILES = 16
#: Bytes read or inflated at a time.
CHUNK = 1 << 20
#: Compressed bytes zran reads at a time for a block's read.
READ_BUFFER = 1 << 17


class DolmaError(AtlasFormatError):
    """A Dolma file or line that cannot be read; the message names it."""


def pack_gzip_index(index: bytes) -> bytes:
    """A gzip index as kept in memory and stored: zstd-compressed (its windows are text)."""
    return zstandard.ZstdCompressor(level=3).compress(index) if index else b""


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


def gzip_damage(path: str, storage: Storage = LOCAL) -> str | None:
    """Why the gzip file at ``path`` is not whole (a member cut short, corrupt data), or None:
    one inflation of every member, keeping nothing."""
    text = 0
    with storage.open(path, CHUNK) as f:
        inflater = zlib.decompressobj(wbits=31)
        data = b""
        while True:
            if not data:
                data = f.read(CHUNK)
                if not data:
                    break
            try:
                text += len(inflater.decompress(data, CHUNK))
            except zlib.error as exc:
                return f"{path}: gzip data is corrupt after {text} bytes of its text ({exc})"
            data = inflater.unconsumed_tail
            if inflater.eof:
                rest = inflater.unused_data + data or f.read(CHUNK)
                if not rest.startswith(b"\x1f\x8b"):
                    return None  # the end, or zero padding or bytes that are no member: ignored, as zran does
                inflater = zlib.decompressobj(wbits=31)
                data = rest
    if inflater.eof:
        return None
    return f"{path}: truncated gzip member: its text ends after {text} bytes (the file is cut short)"


# ---------------------------------------------------------------- zstd frames


def zstd_frame_starts(path: str, storage: Storage = LOCAL) -> tuple[list[int], int, str | None]:
    """Compressed offsets of the data frames of a zstd file (walked from their block
    headers, without decompressing), where the last complete one ends, and why the file
    ends early, or None. Headers only are read (small reads through the storage's buffer)."""
    starts: list[int] = []
    found = storage.stat(path)
    if found is None:
        raise FileNotFoundError(errno.ENOENT, f"{path}: no such file", path)
    size = found[0]
    with storage.open(path, 1 << 12) as f:
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
    """Bytes ``start:end`` of a file, read with the storage's ``pread`` (the zstd reader's source)."""

    def __init__(self, storage: Storage, path: str, start: int, end: int, ranged: bool = False) -> None:
        self.storage, self.path, self.pos, self.end, self.ranged = storage, path, start, end, ranged
        self.start = start

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.end - self.pos)
        if want <= 0:
            return 0
        if self.ranged and self.pos - self.start < RANGED_RUN:  # a random read: no windows (files.RangeFile)
            data = self.storage.read_ranges(self.path, [(self.pos, want)])[0]
        else:
            data = self.storage.pread(self.path, self.pos, want)
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


# ---------------------------------------------------------------- one pass over a file's text


class TextPass:
    """One streaming pass over a file's text, a chunk at a time, building its seek state.

    After :meth:`chunks` is exhausted: :attr:`seek_state` (what :class:`Reader` needs
    to seek), :attr:`damage` (why the text ended early, or None) and :attr:`text_bytes`.
    """

    def __init__(self, path: str, storage: Storage = LOCAL) -> None:
        self.path = path
        self.storage = storage
        self.kind = file_kind(path)
        found = storage.stat(path)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, f"{path}: no such file", path)
        self.compressed_size = found[0]
        self.seek_state = b""
        self.damage: str | None = None
        self.text_bytes = 0
        self.gzip: Any = None  # the scan's indexed_gzip file, handed on to the reader
        self.file: Any = None  # the storage file it reads

    def chunks(self) -> Iterator[bytes]:
        """The file's text in chunks of about a MiB."""
        if self.kind == "gz":
            yield from self._gzip_chunks()
        elif self.kind == "zst":
            yield from self._zstd_chunks()
        else:
            with self.storage.open(self.path, CHUNK) as f:
                while chunk := f.read(CHUNK):
                    self.text_bytes += len(chunk)
                    yield chunk

    def _gzip_chunks(self) -> Iterator[bytes]:
        import indexed_gzip
        # zran builds its seek points while we read: one inflation gives the text and the index
        file = self.file = self.storage.open(self.path, CHUNK)
        try:
            self.gzip = indexed_gzip.IndexedGzipFile(fileobj=file, spacing=SEEK_SPACING, drop_handles=False)
            raw = self.gzip.raw
            while True:
                chunk = raw.read(CHUNK)
                if not chunk:
                    break
                self.text_bytes += len(chunk)
                yield chunk
        except (OSError, ValueError, EOFError) as exc:  # corrupt data, a CRC error at a member's end
            failure = transient_failure(exc, file)
            if failure is not None:  # the store, not the data: nothing about the file is learned
                self.close()
                raise failure from None
            self.damage = f"{self.path}: gzip data cannot be read past byte {self.text_bytes} of its text ({exc})"
        if self.gzip is None:
            return
        out = io.BytesIO()
        self.gzip.raw.export_index(fileobj=out)
        self.seek_state = out.getvalue()
        if self.damage is None:
            self.damage = self._gzip_trailer_problem()

    def close(self) -> None:
        """Close the pass's gzip file and its storage file (when not handed on to a reader)."""
        if self.gzip is not None:
            self.gzip.close()
            self.gzip = None
        if self.file is not None:
            self.file.close()
            self.file = None

    def _gzip_trailer_problem(self) -> str | None:
        # zran stops quietly where a truncated member ends. A file of one member ends with
        # the length of its whole text (mod 2^32), which a cut file has by a 2^-32 chance;
        # any other file (several members, or cut) is checked by one more inflation
        tail = self.storage.pread(self.path, max(self.compressed_size - 4, 0), 4)
        if len(tail) == 4 and int.from_bytes(tail, "little") == self.text_bytes % (1 << 32):
            return None
        return gzip_damage(self.path, self.storage)

    def _zstd_chunks(self) -> Iterator[bytes]:
        starts, complete_end, self.damage = zstd_frame_starts(self.path, self.storage)
        frames: list[tuple[int, int]] = []
        try:
            for i, start in enumerate(starts):
                end = starts[i + 1] if i + 1 < len(starts) else complete_end
                frames.append((start, self.text_bytes))
                # read_size bounds what one read inflates: a bomb fails at MAX_LINE_BYTES, not in memory
                reader = zstandard.ZstdDecompressor().stream_reader(_Slice(self.storage, self.path, start, end),
                                                                     read_size=1 << 17, read_across_frames=True)
                try:
                    while chunk := reader.read(CHUNK):
                        self.text_bytes += len(chunk)
                        yield chunk
                except zstandard.ZstdError as exc:
                    failure = transient_failure(exc)
                    if failure is not None:
                        raise failure from None
                    self.damage = f"{self.path}: zstd frame at byte {start} cannot be read ({exc})"
                    break
        finally:
            self.seek_state = np.array(frames, dtype="<u8").reshape(-1, 2).tobytes()



# ---------------------------------------------------------------- positioned reads


class OpenFiles:
    """Bounds the file handles readers keep open, over every shard: the least recently
    read reader is closed (and reopens from its seek state when read again)."""

    def __init__(self, limit: int = OPEN_FILES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._open: OrderedDict[int, Reader] = OrderedDict()

    def touch(self, reader: "Reader") -> list["Reader"]:
        """Mark ``reader`` as just read; the readers to close now (by the caller, holding no lock)."""
        with self._lock:
            self._open[id(reader)] = reader
            self._open.move_to_end(id(reader))
            victims = []
            while len(self._open) > self.limit:
                victims.append(self._open.popitem(last=False)[1])
            return victims

    def forget(self, reader: "Reader") -> None:
        with self._lock:
            self._open.pop(id(reader), None)


class Reader:
    """Positioned reads of a file's text, through its seek state (for gzip, zstd-compressed).

    Safe for use from many threads: one lock per file, held for a seek and its read
    (one zran stream or zstd cursor per file); reads of different files run at once.
    It keeps one handle open while it is among the :data:`OPEN_FILES` most recently read.
    """

    def __init__(self, path: str, state: bytes, files: OpenFiles, gzip_file: tuple[Any, Any] | None = None,
                 storage: Storage | None = None) -> None:
        self.path = path
        # its own local storage: closing this reader's descriptor must not close another's
        self._storage = storage if storage is not None and storage.remote else LocalStorage()
        # the gzip file (its seek points imported) and the storage file zran reads through
        self._gzip, self._file = gzip_file or (None, None)
        self.kind = file_kind(path)
        self._state = state
        self._files = files
        self._lock = threading.Lock()
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
                failure = transient_failure(exc, self._file)
                self._close()
                if failure is not None:  # transient: the same read may work a second later
                    raise failure from None
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
                # its file's buffer is small too: a store's ranged GETs fetch about what zran reads
                self._file = self._storage.open(self.path, READ_BUFFER, ranged=True)
                gzip_file = indexed_gzip.IndexedGzipFile(fileobj=self._file, spacing=SEEK_SPACING,
                                                         drop_handles=False, readbuf_size=READ_BUFFER)
                if self._state:  # kept compressed: zran's index holds 32 KiB per seek point
                    index = zstandard.ZstdDecompressor().decompress(self._state)
                    gzip_file.raw.import_index(fileobj=io.BytesIO(index))
                self._gzip = gzip_file
            self.seeks += 1
            raw = self._gzip.raw  # unbuffered: reads exactly the span asked for
            raw.seek(start)
            return raw.read(end - start)
        if self.kind == "plain":
            return self._storage.pread(self.path, start, end - start)
        return self._read_zstd(start, end)

    def _read_zstd(self, start: int, end: int) -> bytes:
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
                _Slice(self._storage, self.path, int(frames[frame, 0]), self._size(), ranged=True),
                read_size=1 << 17, read_across_frames=True)
            cursor = (reader, frame, int(frames[frame, 1]))
        reader, _, at = cursor
        while at < start:
            got = reader.read(min(start - at, CHUNK))
            if not got:
                break
            at += len(got)
        out = []
        while at < end:
            got = reader.read(min(end - at, 4 * CHUNK))
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
        if self._file is not None:
            self._file.close()
            self._file = None
        self._storage.close_file(self.path)
        self._cursor = None

    def _size(self) -> int:
        found = self._storage.stat(self.path)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, "no such file", self.path)
        return found[0]

    def close(self) -> None:
        """Close its handle (reopened by the next read)."""
        with self._lock:
            self._close()
        self._files.forget(self)

