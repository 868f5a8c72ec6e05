"""Modalities packed token files (``.pbin``): reading, without FUSE.

A ``.pbin`` file is three segments::

    header | data | index

The header is the data segment's length in bytes (uint64, little endian),
followed in the current Modalities writer by the token width in bytes
(uint32: 1, 2 or 4); the older form described in the format document has
only the length, and 4-byte tokens. The data segment is every document's
tokens, unsigned integers of that width, little endian. The index segment is
a pickled list of ``(start, length)`` byte pairs, relative to the data
segment, one per document. Which header form a file has is told by where the
index parses as such a list.

The index is a pickle: it is loaded with :mod:`atlasfs.safepickle`'s
allow-list (plain lists, tuples and ints load; nothing that runs code) unless
the user trusts the data. A document whose entry lies outside the data
segment, overlaps the document before it, or is not a whole number of tokens
is reported by name and fails alone; the others serve.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import safepickle
from ..errors import AtlasFormatError

SUFFIX = ".pbin"
#: Documents decoded together (a block of the tree): their token bytes are read in one pread.
DOCUMENTS_PER_BLOCK = 256
_WIDTHS = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}
#: The index may take at most this many bytes (a forged length cannot make us read more).
MAX_INDEX_BYTES = 1 << 32


class PbinError(AtlasFormatError):
    """A ``.pbin`` file or document that cannot be read; the message names it."""


@dataclass(frozen=True)
class Document:
    """Where one document's tokens are, or why they cannot be read."""

    start: int  # byte offset in the data segment
    length: int  # bytes
    problem: str | None = None


def _parse_index(raw: bytes, where: str, trust: bool) -> list[tuple[int, int]]:
    """The index pickle as ``(start, length)`` pairs; raises :class:`PbinError` if it is not one."""
    try:
        index = safepickle.loads(raw, trust=trust, where=where)
    except AtlasFormatError as exc:
        raise PbinError(str(exc)) from None
    if not isinstance(index, list):
        raise PbinError(f"{where}: the index is a {type(index).__name__}, not a list of (start, length) pairs")
    pairs = []
    for number, entry in enumerate(index):
        if (not isinstance(entry, (tuple, list)) or len(entry) != 2
                or not all(type(v) is int for v in entry)):
            raise PbinError(f"{where}: index entry {number} is {entry!r}, not a (start, length) pair of ints")
        pairs.append((entry[0], entry[1]))
    return pairs


class PbinFile:
    """One ``.pbin`` file: its header, its documents' places, and reads of their tokens.

    Thread-safe: reads are positioned (``os.pread``).
    """

    def __init__(self, path: str, *, trust_pickle: bool = False) -> None:
        self.path = path
        try:
            st = os.stat(path)
            with open(path, "rb") as f:
                head = f.read(12)
        except OSError as exc:
            raise PbinError(f"{path}: cannot read ({exc.strerror})") from None
        self.file_size = st.st_size
        self.mtime = st.st_mtime
        if len(head) < 8:
            raise PbinError(f"{path}: {len(head)} bytes, too short for a .pbin header")
        self.data_bytes = int.from_bytes(head[:8], "little")
        pairs, self.header_bytes, width = self._read_index(head, trust_pickle)
        self.token_width = width
        self.dtype = _WIDTHS[width]
        self.documents = self._check(pairs)
        self._fd: int | None = None
        self._fd_lock = threading.Lock()

    def _read_index(self, head: bytes, trust: bool) -> tuple[list[tuple[int, int]], int, int]:
        """``(pairs, header bytes, token width)``: the 12-byte form if its index parses, else the 8-byte one."""
        failures = []
        candidates = []
        if len(head) == 12:
            width = int.from_bytes(head[8:12], "little")
            if width in _WIDTHS:
                candidates.append((12, width))
            else:
                failures.append(f"a 12-byte header would give token width {width}, not 1, 2 or 4")
        candidates.append((8, 4))
        for header, width in candidates:
            start = header + self.data_bytes
            size = self.file_size - start
            if size <= 0:
                failures.append(f"a {header}-byte header leaves no index after {self.data_bytes} data bytes")
                continue
            if size > MAX_INDEX_BYTES:
                failures.append(f"a {header}-byte header leaves an index of {size} bytes")
                continue
            with open(self.path, "rb") as f:
                f.seek(start)
                raw = f.read(size)
            try:
                return _parse_index(raw, f"{self.path} index", trust), header, width
            except PbinError as exc:
                failures.append(f"with a {header}-byte header: {exc}")
        raise PbinError(f"{self.path}: not a .pbin file ({'; '.join(failures)})")

    def _check(self, pairs: list[tuple[int, int]]) -> list[Document]:
        documents = []
        end_before = 0
        for number, (start, length) in enumerate(pairs):
            problem = None
            if start < 0 or length < 0 or start + length > self.data_bytes:
                problem = f"bytes {start}..{start + length} lie outside the data segment ({self.data_bytes} bytes)"
            elif length % self.token_width or start % self.token_width:
                problem = f"start {start} or length {length} is not a whole number of {self.token_width}-byte tokens"
            elif start < end_before:
                problem = f"starts at byte {start}, inside the document before it (which ends at {end_before})"
            else:
                end_before = start + length
            documents.append(Document(start, length, problem and f"{self.path} document {number}: {problem}"))
        return documents

    def __len__(self) -> int:
        return len(self.documents)

    def _descriptor(self) -> int:
        with self._fd_lock:
            if self._fd is None:
                try:
                    self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
                except OSError as exc:
                    raise PbinError(f"{self.path}: cannot open ({exc.strerror})") from None
            return self._fd

    def read_tokens(self, first: int, count: int) -> list[np.ndarray | PbinError]:
        """The tokens of documents ``first`` to ``first + count`` (one read for all), each a
        1-D array, or the error of a document that cannot be read."""
        chosen = self.documents[first:first + count]
        good = [d for d in chosen if d.problem is None]
        if not good:
            return [PbinError(d.problem or "") for d in chosen]
        lo = min(d.start for d in good)
        hi = max(d.start + d.length for d in good)
        offset = self.header_bytes + lo
        try:
            raw = os.pread(self._descriptor(), hi - lo, offset)
        except OSError as exc:
            raise PbinError(f"{self.path}: read of documents {first}..{first + count - 1} failed "
                            f"({exc.strerror})") from None
        if len(raw) != hi - lo:
            raise PbinError(f"{self.path}: truncated (documents {first}..{first + count - 1} need bytes up to "
                            f"{offset + hi - lo})")
        result: list[np.ndarray | PbinError] = []
        for d in chosen:
            if d.problem is not None:
                result.append(PbinError(d.problem))
            else:
                result.append(np.frombuffer(raw, dtype=self.dtype, count=d.length // self.token_width,
                                            offset=d.start - lo))
        return result

    def close(self) -> None:
        """Close the file descriptor (reopened on the next read)."""
        with self._fd_lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def find_pbin_files(path: str) -> list[str]:
    """The ``.pbin`` files a source path stands for: the file itself, or those in the folder (sorted)."""
    if os.path.isfile(path):
        return [path]
    try:
        names = sorted(n for n in os.listdir(path) if n.endswith(SUFFIX) and not n.startswith("."))
    except OSError as exc:
        raise PbinError(f"{path}: cannot list ({exc.strerror})") from None
    return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n))]


def write_pbin(path: str, documents: list[Any], token_width: int = 2, header: int = 12) -> None:
    """Write ``documents`` (sequences of token ids) as a ``.pbin`` file the way Modalities does
    (``header=8``: the older form, 4-byte tokens). For tests and demos."""
    dtype = _WIDTHS[4 if header == 8 else token_width]
    import pickle
    data = bytearray()
    index = []
    for tokens in documents:
        encoded = np.asarray(tokens, dtype=dtype).tobytes()
        index.append((len(data), len(encoded)))
        data += encoded
    with open(path, "wb") as f:
        f.write(len(data).to_bytes(8, "little"))
        if header == 12:
            f.write(token_width.to_bytes(4, "little"))
        f.write(data)
        f.write(pickle.dumps(index))
