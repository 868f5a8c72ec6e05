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

The index is a pickle: it is loaded with :mod:`atlasfs.formats.safepickle`'s
allow-list (plain lists, tuples and ints load; nothing that runs code) unless
the user trusts the data. A document whose entry lies outside the data
segment, overlaps the document before it, or is not a whole number of tokens
is reported by name and fails alone; the others serve.

A file made by Modalities' merge (``join_embedded_stream_data``, what ``modalities data
merge_packed_data`` calls; checked against Modalities 0.5.0) has the parts' data segments
concatenated and the right header, but writes the index entries of part *k* (from 0) at
``offset + earlier parts' data bytes - 12 * k``: it subtracts its header size after each
part, though offsets are relative to the data segment. Read as written, every document of
a later part starts ``12 * k`` bytes early (Modalities' own reader returns those tokens
silently; the first of each part overlaps the document before it). :func:`unshift_merge`
recognises that signature (each entry starts where the one before it ends, or exactly a
multiple of 12 bytes before: a part boundary) and takes it back only when the corrected
index tiles the data segment exactly, from byte 0 to its end with no gap or overlap: the
documents are then served as their parts held them, and the file's one finding (logged
on mount, listed by ``verify``) names the writer's shifted offsets. Any other index is
judged as written.

As a mountable source (:class:`PbinSource`), each ``.pbin`` file is a folder
named by its stem, and each document a file ``<document number>.npy`` (the
number zero-padded to the width the file's document count needs): its tokens
as a 1-D array of the matching unsigned width, exactly the bytes
``naming.encode_as("npy", tokens)`` gives. The index tells every document's
length, so the file sizes are known without reading any token
(:meth:`PbinShard.describe_block`). A file whose index has bad documents is
read a document per block, so that each bad one is a block failing alone
(EIO, one line naming the file and document) while the rest serve.
"""

from __future__ import annotations

import errno
import functools
import io
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from atlasfs.errors import AtlasFormatError
from atlasfs.formats import safepickle, state
from atlasfs.formats.naming import NO_KEY, index_key_width
from atlasfs.formats.source import Source, SourceShard, file_or_folder_of, shown_names, stat_shard_file
from atlasfs.storage import LOCAL, LocalStorage, Storage, StorageChangedError, StorageUnavailableError

log = logging.getLogger("atlasfs")

SUFFIX = ".pbin"
#: Bytes Modalities' merge subtracts from each later part's offsets (its ``HEADER_SIZE_IN_BYTES``).
MERGE_SHIFT = 12
#: Part boundaries a merge finding names before "...".
NAMED_PARTS = 5
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


def unshift_merge(pairs: list[tuple[int, int]], data_bytes: int,
                  width: int) -> tuple[list[tuple[int, int]], str] | None:
    """If ``pairs`` is the index Modalities' merge writes (see the module's docstring),
    ``(the pairs where the parts held their documents, a finding without the file's name)``;
    else None (the index is judged as written).

    The signature: entry ``i`` starts where entry ``i - 1`` ends (entry -1 ending at 0), or
    ``12 * m`` bytes (``m >= 1``) before that, once at least (``m`` parts joined there, empty
    ones included); every length is a whole number of tokens; and the entries, each moved
    by the bytes of all the steps back up to it, tile the data segment exactly. A packer's
    own file never steps back, so it is never touched."""
    count = len(pairs)
    if count == 0 or data_bytes <= 0:
        return None
    try:
        table = np.array(pairs, dtype=np.int64).reshape(count, 2)
    except OverflowError:
        return None
    starts, lengths = table[:, 0], table[:, 1]
    # bounds first (empty parts step back 12 bytes each: a start may be below 0), so that no sum overflows
    if (np.any(lengths < 0) or np.any(lengths > data_bytes) or np.any(starts > data_bytes)
            or np.any(starts < -MERGE_SHIFT * count - data_bytes) or np.any(lengths % width)):
        return None
    ends_before = np.zeros(count, dtype=np.int64)
    ends_before[1:] = starts[:-1] + lengths[:-1]
    back = ends_before - starts
    if np.any(back < 0) or np.any(back % MERGE_SHIFT) or not np.any(back):
        return None
    shift = np.cumsum(back)
    fixed = starts + shift  # each entry now starts where the one before it ends, the first at 0
    if int(fixed[-1] + lengths[-1]) != data_bytes:
        return None
    boundaries = np.flatnonzero(back).tolist()
    named = ", ".join(str(b) for b in boundaries[:NAMED_PARTS]) + (", ..." if len(boundaries) > NAMED_PARTS else "")
    finding = (f"offsets shifted by Modalities' merge (join_embedded_stream_data): the {len(boundaries)} "
               f"part(s) from document(s) {named} have their index entries written {MERGE_SHIFT}..{int(shift[-1])} "
               f"bytes before their tokens ({MERGE_SHIFT} per part before them); atlasfs reads documents "
               f"{boundaries[0]}..{count - 1} where their parts held them (the corrected index tiles the "
               f"{data_bytes} data bytes)")
    return list(zip(fixed.tolist(), lengths.tolist())), finding


def _check(pairs: list[tuple[int, int]], data_bytes: int, width: int) -> tuple[np.ndarray, np.ndarray, dict[int, str]]:
    """``(starts, lengths, problems)``: the index as int64 arrays (kept instead of an object
    per document, which a file of millions would make heavy) and, by document number, why
    the bad ones cannot be read (without the file's name)."""
    count = len(pairs)
    try:
        table = np.array(pairs, dtype=np.int64).reshape(count, 2)
    except OverflowError:  # a value beyond int64 (a forged index): checked one by one below
        table = None
    problems: dict[int, str] = {}
    if table is not None:
        starts, lengths = table[:, 0].copy(), table[:, 1].copy()
        ends = starts + lengths
        in_range = (starts >= 0) & (lengths >= 0) & (ends <= data_bytes)
        whole = (starts % width == 0) & (lengths % width == 0)
        before = np.maximum.accumulate(np.where(in_range & whole, ends, 0))
        overlaps = np.zeros(count, dtype=bool)
        overlaps[1:] = starts[1:] < before[:-1]
        if in_range.all() and whole.all() and not overlaps.any():
            return starts, lengths, problems  # the usual case, with no loop over documents
    # Some document is bad: an overlap is judged against the good documents before it only,
    # which needs a pass in order.
    starts = np.zeros(count, dtype=np.int64)
    lengths = np.zeros(count, dtype=np.int64)
    end_before = 0
    for number, (start, length) in enumerate(pairs):
        if start < 0 or length < 0 or start + length > data_bytes:
            problems[number] = f"bytes {start}..{start + length} lie outside the data segment ({data_bytes} bytes)"
        elif length % width or start % width:
            problems[number] = f"start {start} or length {length} is not a whole number of {width}-byte tokens"
        elif start < end_before:
            problems[number] = f"starts at byte {start}, inside the document before it (which ends at {end_before})"
        else:
            end_before = start + length
            starts[number], lengths[number] = start, length
    return starts, lengths, problems


class PbinFile:
    """One ``.pbin`` file: its header, its documents' places, and reads of their tokens.

    Thread-safe: reads are positioned (``pread``). ``starts`` and ``lengths`` hold
    every document's place (0, 0 for a bad one); ``problems`` says, by document number,
    why a bad one cannot be read (one line naming the file and document).
    """

    def __init__(self, path: str, *, trust_pickle: bool = False, storage: Storage = LOCAL) -> None:
        self.path = path
        self._file = _own(storage)
        try:
            found = self._file.stat(path)
            if found is None:
                raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)
            head = self._file.pread(path, 0, 12)
        except StorageUnavailableError:
            raise
        except OSError as exc:
            raise PbinError(f"{path}: cannot read ({exc.strerror})") from None
        self.file_size = found[0]
        self.mtime = found[1] / 1e9
        if len(head) < 8:
            raise PbinError(f"{path}: {len(head)} bytes, too short for a .pbin header")
        self.data_bytes = int.from_bytes(head[:8], "little")
        pairs, self.header_bytes, width = self._read_index(head, trust_pickle)
        #: The finding of a file Modalities' merge wrote, whose offsets were corrected (one line), or None.
        self.merge_note: str | None = None
        unshifted = unshift_merge(pairs, self.data_bytes, width) if self.header_bytes == 12 else None
        if unshifted is not None:
            pairs, note = unshifted
            self.merge_note = f"{path}: {note}"
        self.token_width = width
        self.dtype = _WIDTHS[width]
        self.starts, self.lengths, problems = _check(pairs, self.data_bytes, width)
        self.problems = {n: f"{path} document {n}: {p}" for n, p in problems.items()}

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
            try:
                raw = self._file.pread(self.path, start, size)
            except StorageUnavailableError:
                raise
            except OSError as exc:
                raise PbinError(f"{self.path}: cannot read ({exc.strerror})") from None
            try:
                return _parse_index(raw, f"{self.path} index", trust), header, width
            except PbinError as exc:
                failures.append(f"with a {header}-byte header: {exc}")
        raise PbinError(f"{self.path}: not a .pbin file ({'; '.join(failures)})")

    @property
    def documents(self) -> list[Document]:
        """Every document as a :class:`Document` (made on each call: prefer the arrays)."""
        return [Document(int(s), int(n), self.problems.get(i))
                for i, (s, n) in enumerate(zip(self.starts.tolist(), self.lengths.tolist()))]

    def __len__(self) -> int:
        return len(self.starts)

    def read_tokens(self, first: int, count: int) -> list[np.ndarray | PbinError]:
        """The tokens of documents ``first`` to ``first + count`` (one read for all), each a
        1-D array, or the error of a document that cannot be read."""
        return _read_documents(self._file, self.path, self.header_bytes, self.dtype,
                               self.starts, self.lengths, self.problems, first, count)

    def close(self) -> None:
        """Close the file's descriptor (reopened on the next read)."""
        self._file.close_file(self.path)


def _own(storage: Storage) -> Storage:
    """The storage a file's reads go through: a store's own, or a local storage of its own
    (a descriptor kept per reader, closed by its close() without closing another's)."""
    return storage if storage.remote else LocalStorage()


def _read_documents(file: Storage, path: str, header_bytes: int, dtype: np.dtype, starts: np.ndarray,
                    lengths: np.ndarray, problems: dict[int, str], first: int,
                    count: int) -> list[np.ndarray | PbinError]:
    """Documents ``first`` to ``first + count`` of a file, read in one ``pread`` spanning the good
    ones (on ``file``'s kept descriptor): each a read-only 1-D
    array over that read's bytes, or the error of a bad one."""
    last = min(first + count, len(starts))
    numbers = range(first, last)
    good = [n for n in numbers if n not in problems]
    if not good:
        return [PbinError(problems[n]) for n in numbers]
    lo = int(min(starts[n] for n in good))
    hi = int(max(starts[n] + lengths[n] for n in good))
    offset = header_bytes + lo
    try:
        raw = file.pread(path, offset, hi - lo)
    except (StorageUnavailableError, StorageChangedError):
        raise  # the store, not the file: transient
    except OSError as exc:
        raise PbinError(f"{path}: read of documents {first}..{last - 1} failed ({exc.strerror})") from None
    if len(raw) != hi - lo:
        raise PbinError(f"{path}: truncated (documents {first}..{last - 1} need bytes up to {offset + hi - lo})")
    width = dtype.itemsize
    result: list[np.ndarray | PbinError] = []
    for n in numbers:
        if n in problems:
            result.append(PbinError(problems[n]))
        else:
            result.append(np.frombuffer(raw, dtype=dtype, count=int(lengths[n]) // width, offset=int(starts[n]) - lo))
    return result


@functools.lru_cache(maxsize=64)
def _npy_header_bytes(descr: str, digits: int) -> int:
    """Bytes of the ``.npy`` header of a 1-D array of ``descr`` whose length has ``digits`` digits.

    The header is a dict text padded to a multiple of 64 bytes; for a 1-D array it
    varies only with the number of digits of the length, so one is worked out per
    digit count, by numpy's own header writer (the one ``np.save`` uses)."""
    buffer = io.BytesIO()
    header = {"descr": descr, "fortran_order": False, "shape": (10 ** (digits - 1),)}
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.tell()


def npy_size(dtype: np.dtype, count: int) -> int:
    """Bytes of ``naming.encode_as("npy", array)`` for a 1-D array of ``count`` items of ``dtype``,
    without making the array."""
    return _npy_header_bytes(np.lib.format.dtype_to_descr(dtype), len(str(count))) + count * dtype.itemsize


# ---------------------------------------------------------------- the mountable source

#: Version of what :meth:`PbinShard.prepare` returns (:mod:`.state`); a stored state of another is not restored.
STATE_VERSION = 3


class PbinShard(SourceShard):
    """One ``.pbin`` file as a folder: document ``n`` is the file ``<n, zero-padded>.npy``.

    The file's index is read by :meth:`prepare` (the safe unpickler unless the user
    trusts the data); what it says is returned as plain arrays, so that a later mount
    :meth:`restore`\\ s them without unpickling anything.
    """

    def __init__(self, path: str, name: str, trust_pickle: bool, storage: Storage = LOCAL) -> None:
        self.path = path
        self.storage = storage
        self._file = _own(storage)
        self.name = name
        self.trust_pickle = trust_pickle
        self.first_index = 0  # each file numbers its documents from 0
        self.mtime, self.data_size, why = stat_shard_file(path, storage)
        if why is not None:
            self.error = PbinError(f"{path}: {why}")
        self._header_bytes = 0
        self._dtype = _WIDTHS[4]
        self._starts = np.zeros(0, dtype=np.int64)
        self._lengths = np.zeros(0, dtype=np.int64)
        self._problems: dict[int, str] = {}
        self._merge_note: str | None = None

    # -- the pass over the file

    def prepare(self) -> bytes:
        """Read and check the file's index; returns it as arrays (:meth:`restore` takes them)."""
        pbin = PbinFile(self.path, trust_pickle=self.trust_pickle, storage=self.storage)
        pbin.close()
        self._set(pbin.header_bytes, pbin.dtype, pbin.starts, pbin.lengths, pbin.problems, pbin.merge_note)
        bad = sorted(pbin.problems)
        return state.encode("pbin", STATE_VERSION, {
            "header": pbin.header_bytes, "width": pbin.token_width, "data_bytes": pbin.data_bytes,
            "starts": pbin.starts.astype("<i8"), "lengths": pbin.lengths.astype("<i8"),
            "bad": np.array(bad, dtype="<i8"), "problems": [pbin.problems[n] for n in bad],
            "merge": [pbin.merge_note] if pbin.merge_note else []})

    def restore(self, saved: bytes) -> None:
        """Take back what :meth:`prepare` returned; ``ValueError`` if it is not that, or if
        a document it places lies outside the file (the state is untrusted input)."""
        fields = state.decode(saved, "pbin", STATE_VERSION)
        header, width = fields.integer("header", 8, 12), fields.integer("width", 1, 4)
        data_bytes = fields.integer("data_bytes", 0, max(self.data_size - header, 0))
        if header not in (8, 12) or width not in _WIDTHS:
            raise state.StateError(f"{self.path}: stored header of {header} bytes or token width {width}")
        starts = fields.array("starts", "<i8")
        lengths = fields.array("lengths", "<i8", (len(starts),))
        bad = fields.array("bad", "<i8")
        problems = fields.texts("problems", max_count=len(bad), max_len=1 << 16, one_line=False)
        merge = fields.texts("merge", max_count=1, max_len=1 << 16)
        if len(problems) != len(bad) or (len(bad) and (bad.min() < 0 or bad.max() >= len(starts)
                                                       or np.any(np.diff(bad) <= 0))):
            raise state.StateError(f"{self.path}: stored bad documents are not documents of the file")
        good = np.ones(len(starts), dtype=bool)
        good[bad] = False
        s, n = starts[good], lengths[good]
        if np.any(s < 0) or np.any(n < 0) or np.any(s > data_bytes - n) or np.any((s | n) % width):
            raise state.StateError(f"{self.path}: stored documents lie outside its data segment")
        self._set(header, _WIDTHS[width], starts, lengths, dict(zip(bad.tolist(), problems)),
                  merge[0] if merge else None)
        if self._merge_note:  # a mount that restores makes no pass, and still says it (the tree logs a pass's)
            log.warning("%s", self._merge_note)

    def _set(self, header_bytes: int, dtype: np.dtype, starts: np.ndarray, lengths: np.ndarray,
             problems: dict[int, str], merge_note: str | None) -> None:
        self._header_bytes, self._dtype = header_bytes, dtype
        self._starts, self._lengths, self._problems = starts, lengths, problems
        self._merge_note = merge_note

    # -- blocks

    @property
    def num_documents(self) -> int:
        """Documents in the file (once prepared or restored)."""
        return len(self._starts)

    @property
    def block_size(self) -> int:
        """:data:`DOCUMENTS_PER_BLOCK`, or 1 in a file with bad documents (each then fails alone)."""
        return 1 if self._problems else DOCUMENTS_PER_BLOCK

    @property
    def num_blocks(self) -> int:
        return -(-self.num_documents // self.block_size)

    def block_length(self, block: int) -> int:
        return max(0, min(self.block_size, self.num_documents - block * self.block_size))

    @property
    def key_width(self) -> int:
        return index_key_width(self.num_documents)

    def block_where(self, block: int) -> str:
        first = block * self.block_size
        last = first + self.block_length(block) - 1
        return f"{self.path} document {first}" if first == last else f"{self.path} documents {first}..{last}"

    def stored_block_size(self, block: int) -> int:
        first = block * self.block_size
        return int(self._lengths[first:first + self.block_size].sum())

    def decode_block(self, block: int) -> tuple[list[Any], int]:
        """The block's documents as samples ``{"npy": tokens}`` (keyed by their index);
        :class:`PbinError` naming the file and document if one is bad."""
        first = block * self.block_size
        count = self.block_length(block)
        # Checked before anything is read: the index states each length, and a sparse .pbin
        # whose one document states 3 GiB had verify and the daemon read it (2 GiB, pread's cap,
        # then 'truncated'). A block's files may not take more than max_block_bytes.
        size = self.stored_block_size(block)
        if size > self.max_block_bytes:
            raise PbinError(f"{self.block_where(block)}: its documents take {size} bytes, more than the block bound "
                            f"of {self.max_block_bytes} bytes; not read")
        arrays = _read_documents(self._file, self.path, self._header_bytes, self._dtype, self._starts,
                                 self._lengths, self._problems, first, count)
        samples: list[Any] = []
        for array in arrays:
            if isinstance(array, PbinError):
                raise array  # only in a file read a document per block: this document alone fails
            samples.append({"npy": array})
        return samples, self.stored_block_size(block) + 100 * count

    def describe_block(self, block: int) -> list[tuple[Any, list[tuple[str, int]]]] | None:
        """Every document's ``.npy`` size from its length in the index, no token read; None
        for a bad document (the tree then decodes it, which fails and is logged)."""
        first = block * self.block_size
        numbers = range(first, first + self.block_length(block))
        if any(n in self._problems for n in numbers):
            return None
        width = self._dtype.itemsize
        return [(NO_KEY, [("npy", npy_size(self._dtype, int(self._lengths[n]) // width))]) for n in numbers]

    # -- what a stored table depends on

    def table_files(self) -> list[str]:
        return [self.path]

    def table_key(self) -> dict[str, Any]:
        """The file's signature plus the state's version and whether the index was trusted
        (a table built trusting a pickle must not serve a mount that does not)."""
        return {**super().table_key(), "pbin": STATE_VERSION, "trust_pickle": self.trust_pickle}

    def problems(self) -> list[str]:
        """The merge's shifted offsets (corrected, still a finding) and one line per bad
        document, each naming the file."""
        merge = [self._merge_note] if self._merge_note else []
        return merge + [self._problems[n] for n in sorted(self._problems)]

    def close(self) -> None:
        self._file.close_file(self.path)


class PbinSource(Source):
    """A ``.pbin`` file (one folder) or a folder of them (a folder per file, by stem)."""

    kind = "pbin"

    def __init__(self, root: str, trust_pickle: bool = False, storage: Storage = LOCAL) -> None:
        self.root = root
        self.storage = storage
        files = find_pbin_files(root, storage)
        if not files:
            raise PbinError(f"{root}: no .pbin file in it")
        named = [(path, os.path.basename(path)[:-len(SUFFIX)] or "_") for path in files]
        #: Files left out, one line each: their folder could not be named as they are (shown_names).
        self.layout_problems = shown_names(named)
        self._shards = [PbinShard(path, name, trust_pickle, storage) for path, name in named]
        if not self._shards:
            raise PbinError(f"{root}: no .pbin file whose name can be shown ({self.layout_problems[0]})")

    @property
    def shards(self) -> list[PbinShard]:  # type: ignore[override]
        """A shard per ``.pbin`` file, in name order."""
        return self._shards

    def problems(self) -> list[str]:
        return list(self.layout_problems)

    def info(self) -> list[str]:
        return [f"format       pbin: {len(self._shards)} .pbin file(s)"]


def looks_like(path: str, storage: Storage = LOCAL) -> bool:
    """A ``.pbin`` file, or a folder with one directly inside (no file is opened)."""
    return file_or_folder_of(path, SUFFIX, storage)


def open_source(path: str, options: Any, storage: Storage = LOCAL) -> PbinSource:
    """The ``.pbin`` file or folder at ``path``, read through ``storage`` (``options``:
    :class:`~.factory.SourceOptions`)."""
    return PbinSource(os.fspath(path), trust_pickle=bool(getattr(options, "trust_pickle", False)), storage=storage)


def find_pbin_files(path: str, storage: Storage = LOCAL) -> list[str]:
    """The ``.pbin`` files a source path stands for: the file itself, or those in the folder (sorted)."""
    if storage.isfile(path):
        return [path]
    try:
        names = sorted(n for n, is_dir in storage.listdir(path)
                       if n.endswith(SUFFIX) and not n.startswith(".") and not is_dir)
    except StorageUnavailableError:
        raise
    except OSError as exc:
        raise PbinError(f"{path}: cannot list ({exc.strerror})") from None
    # stat, not isfile: a FIFO or device named *.pbin is a shard that fails naming it, not left out
    return [os.path.join(path, n) for n in names if storage.stat(os.path.join(path, n)) is not None]


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
