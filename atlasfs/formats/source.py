"""The one interface every source answers: a dataset as shards of blocks of samples.

A *source* reads one on-disk format and knows nothing of FUSE, file names or
caches. It gives a list of :class:`SourceShard`; each shard is a run of
samples (dicts such as ``{"__key__": "doc1", "text": "...", "json": b"..."}``,
or any value the naming layer accepts) read a *block* at a time. The block
tree (:mod:`atlasfs.tree.blocktree`) turns any source into the mounted tree: a
folder per shard, a file per field, through the naming contract, the block
cache and the stored file tables. Adding a format is adding a module beside
the others in :mod:`atlasfs.formats` and a line in :mod:`.factory`; nothing else
changes.

A shard may need a pass over its files before its blocks can be read (Dolma
finds where its blocks of lines start and builds gzip seek points).
:meth:`SourceShard.prepare` does that pass and returns what it learned as
bytes, which the tree stores with the shard's file table;
:meth:`SourceShard.restore` takes those bytes back on a later mount, so
that mount makes no pass.

A shard may also say where a file's bytes can be had without decoding its
block (:meth:`SourceShard.file_spans`, asked while the tree builds the shard's
file table, the :class:`Locator` of each file kept in that table), and read
them from there (:meth:`SourceShard.read_span`): a cold random read then costs
about what its own bytes cost. The tree knows nothing of what a locator means;
the source checks on every read that what it found there is what it recorded,
and raises :class:`SpanMismatch` otherwise (the tree then decodes the block).

Errors are :class:`atlasfs.errors.AtlasFormatError` with a one-line message
naming the file (and line, uid or document) that is wrong.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple, Protocol

from atlasfs.errors import AtlasFormatError
from atlasfs.storage import LOCAL, Storage, StorageUnavailableError, UnfitFileError
from atlasfs.storage.files import listdir_or_empty, relative

log = logging.getLogger("atlasfs")


class SpanMismatch(AtlasFormatError):
    """What a :class:`Locator` points at is not what it was when it was recorded (the
    data changed, or a stored table lies): the file must be read through its block."""


class Locator(NamedTuple):
    """Where one file's bytes can be had without decoding its block; the file is
    ``prefix`` followed by ``length`` bytes at ``offset`` of the block's decoded bytes
    (the *run*). What ``offset`` and ``check`` mean is the source's business; the tree
    only stores locators with the file table and hands them back.

    ``inline``: the whole file is ``prefix`` (``length`` 0), kept in the table because
    it is small; ``check`` then ties it to the block it came from, so that a changed
    block is still detected.
    """

    offset: int
    length: int
    check: int
    prefix: bytes = b""
    inline: bool = False

    @property
    def end(self) -> int:
        """Where the run ends in the block's decoded bytes: how far a read must decode."""
        return self.offset + self.length

    @property
    def size(self) -> int:
        """The file's size."""
        return len(self.prefix) + self.length


class NativeSpans(NamedTuple):
    """Where a local shard's blocks lie and how they are stored, for a reader outside Python
    (the native engine's located reads, atlasfs/formats/atlas/native/located.c) to serve the shard's
    locators itself, with the checks of the Atlas spans (atlasfs/formats/atlas/spans/read.py):
    a run is ``prefix`` + ``length`` bytes at ``offset`` of the block's decompressed bytes
    (its stored bytes, or its one zstd frame decompressed within ``max_block_bytes``), whose
    CRC-32 is the check; an inline file is tied to its block by the frame's content checksum
    (or the CRC-32 of a small block). Block ``b`` is ``starts[b]:starts[b + 1]`` of
    ``data_path``; ``signatures`` are (size, mtime_ns) of ``data_path`` and ``index_path`` when
    the shard was opened, which every read checks; ``data_identity`` is (device, inode) of the
    file ``data_path`` led to by the link rule (atlasfs.storage.links), which the reader's own
    open must find again."""

    data_path: str
    index_path: str
    signatures: tuple[int, int, int, int]
    starts: Any  # numpy uint64, one more than the blocks
    compressed: bool
    dictionary: bytes | None
    max_block_bytes: int
    data_identity: tuple[int, int]


def file_signature(path: str, storage: Storage = LOCAL) -> list[Any] | None:
    """``[size, mtime_ns]`` of a file, or None if it is missing: what a stored table depends on.
    In a store, its ETag too (an object rewritten within the same second keeps its mtime)."""
    if storage.remote:
        found = storage.stat(path)
        if found is None:
            return None
        return [found[0], found[1], getattr(storage, "etag", lambda _: None)(path)]
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def file_or_folder_of(path: str, suffix: str, storage: Storage = LOCAL) -> bool:
    """A file named ``*<suffix>``, or a folder with one directly inside (no file is opened):
    the layout of the formats whose dataset is files of one kind (``.pbin``, ``.tar``)."""
    if storage.isfile(path):
        return path.endswith(suffix)
    return any(n.endswith(suffix) and not n.startswith(".") and not is_dir
               for n, is_dir in listdir_or_empty(storage, path))


def stat_shard_file(path: str, storage: Storage = LOCAL) -> tuple[float, int, str | None]:
    """``(mtime in seconds, size, None)`` of a shard's one file, or ``(0.0, 0, why)`` if it
    cannot be stat'ed (missing, no permission) or is no regular file (a FIFO, a device: ``not a
    regular file (a FIFO)``, said now rather than met by the pass); a store that does not answer
    raises :class:`StorageUnavailableError` (transient, not the shard's fault)."""
    try:
        found = storage.stat(path)
        if found is not None:
            storage.check_file(path)  # a stat, nothing opened
    except StorageUnavailableError:
        raise
    except UnfitFileError as exc:
        return 0.0, 0, str(exc.strerror)
    except OSError as exc:
        return 0.0, 0, f"cannot be read ({exc.strerror or exc})"
    if found is None:
        return 0.0, 0, f"cannot be read ({os.strerror(errno.ENOENT)})"
    return found[1] / 1e9, found[0], None


@contextlib.contextmanager
def refused_in_one_line(root: str, storage: Storage) -> Iterator[None]:
    """While a dataset opens, a store that does not answer, or that refuses (access denied,
    no such bucket, fsspec missing), is one :class:`AtlasFormatError` naming the dataset."""
    try:
        yield
    except StorageUnavailableError as exc:
        raise AtlasFormatError(str(exc)) from None
    except OSError as exc:
        if not storage.remote:
            raise
        message = str(exc.strerror or exc)
        raise AtlasFormatError(message if message.startswith(root) else f"{root}: {message}") from None


class Scratch(Protocol):
    """A place the tree keeps one value per block for its source's located reads, within
    the tree's cache bound (evicted like a decoded block): what a source decoded of a block
    for one read, kept for the next (an Atlas shard keeps the block's decompressed first
    bytes there)."""

    def get(self) -> bytes | None:
        """What was put for this block, if it is still kept."""

    def put(self, value: bytes) -> None:
        """Keep ``value`` for this block (in place of what was there), charged its length."""


def shown_names(named: list[tuple[str, str]], logged: bool = True) -> list[str]:
    """Leave out of ``named`` (``(file path, folder name)`` of each shard, in place) each shard
    whose folder name (``/``-separated) breaks the rule every shown name keeps
    (:func:`~atlasfs.formats.naming.path_problem`: no control character, no leading ``-``, no
    leading or trailing whitespace...); returns one line each, logged as a warning if ``logged``. A shard's
    folder is named after its file (a tar, a .pbin, a Dolma documents file): a downloaded
    dataset's ``-rf.tar`` or ``x<ESC>]0;...<BEL>.tar`` was a folder ``-rf`` or a name that
    rewrites the terminal of whoever lists the mount, or reads verify's lines."""
    from atlasfs.formats.naming import path_problem

    problems = []
    kept = []
    for path, name in named:
        problem = path_problem(name)
        if problem is None:
            kept.append((path, name))
        else:
            problems.append(f"{path!r}: left out: its folder could not be named as it is ({problem})")
            if logged:
                log.warning("%s", problems[-1])
    named[:] = kept
    return problems


class SourceShard(ABC):
    """One shard: a folder of the tree, its samples read a block at a time.

    Attributes every shard sets:
        name: its folder's path in the tree, ``/``-separated (``"shard_00000"``,
            or ``"cc/part-0001"`` for a Dolma documents file in a sub-folder).
        path: what messages name for the shard as a whole.
        mtime: modification time shown for its folder and files (seconds).
        data_size: bytes its files take on disk (for ``statfs`` and ``info``).
        error: why the shard cannot be opened, or None. A shard with an error
            is a folder whose listing fails with EIO; the others serve.
        first_index: the index of its first sample among the source's, for index
            keys (``000042``) of samples without a usable key of their own.
        max_block_bytes: most bytes a block's files may take once encoded.
    """

    name: str
    path: str
    mtime: float = 0.0
    data_size: int = 0
    error: AtlasFormatError | None = None
    first_index: int = 0
    max_block_bytes: int = 1 << 30
    #: Where its files are read from (its source's storage).
    storage: Storage = LOCAL

    # -- the pass over its files (a no-op for formats with an index of their own)

    def prepare(self) -> bytes:
        """Make the shard ready to read blocks by a pass over its files, if it needs one,
        and return what the pass learned (stored with its file table). Raises
        :class:`AtlasFormatError` if the shard cannot be read at all."""
        return b""

    def restore(self, state: bytes) -> None:
        """Take back what :meth:`prepare` returned on an earlier mount, instead of the
        pass. Raises ``ValueError`` if ``state`` does not fit the shard (then the
        stored table is ignored and rebuilt)."""

    # -- what is known once prepared (or restored)

    @property
    @abstractmethod
    def num_blocks(self) -> int:
        """Blocks of samples."""

    @property
    @abstractmethod
    def block_size(self) -> int:
        """Most samples a block holds (a stored table's positions are checked against it)."""

    @abstractmethod
    def block_length(self, block: int) -> int:
        """Samples in ``block``."""

    @property
    @abstractmethod
    def key_width(self) -> int:
        """Digits of the index keys of its samples (:func:`atlasfs.formats.naming.index_key_width`)."""

    def block_where(self, block: int) -> str:
        """How messages name ``block`` (``.../data.bin block 3``, ``.../x.jsonl.gz lines 513-1024``)."""
        return f"{self.path} block {block}"

    def stored_block_size(self, block: int) -> int:
        """About the bytes read to decode ``block`` (read-ahead skips blocks too big for the cache)."""
        return 0

    @abstractmethod
    def decode_block(self, block: int) -> tuple[list[Any], int]:
        """The samples of ``block`` and about the bytes they hold in memory. Raises
        :class:`AtlasFormatError` naming the file and what is wrong; one block failing
        leaves the others readable."""

    def describe_block(self, block: int) -> list[tuple[Any, list[tuple[str, int]]]] | None:
        """Without decoding ``block``: each sample's declared key (``naming.NO_KEY`` for
        none) and its files' ``(suffix, size in bytes)``, in the order and with the bytes
        the naming layer would give its decoded samples, if the format's own index tells
        them (a ``.pbin`` index gives every document's length). None (the default): the
        tree decodes the block and names its samples to learn them."""
        return None

    # -- reading a file without decoding its block (optional)

    def file_spans(self, block: int, fields: list[list[tuple[str, Any]]]) -> list[list[Locator | None]] | None:
        """Where each file of ``block`` can be read without decoding it, or None for
        none of them (the default). ``fields[i]`` are the files of its sample ``i`` as
        :func:`~atlasfs.formats.naming.example_fields` names them (``(suffix, value)``, the
        decoded sample's own values); the result has the shape of ``fields``, None
        where a file has no locator. Called while the tree builds the shard's file
        table from the decoded block; each locator's :attr:`~Locator.size` must be the
        size of the file's bytes as :func:`~atlasfs.formats.naming.encode_as` makes them."""
        return None

    def read_span(self, block: int, locator: Locator, size: int, scratch: Scratch | None = None) -> bytes | None:
        """The ``size`` bytes of the file ``locator`` (from :meth:`file_spans`, or a
        stored table: untrusted) points at in ``block``; ``scratch``, the block's place in
        the tree's cache for what this method decoded of it for an earlier read. None: the
        block is better decoded (this read would cost about as much). Raises
        :class:`SpanMismatch` if what is there is not what was recorded,
        :class:`AtlasFormatError` if it cannot be read; the tree then reads the file
        through its block."""
        raise SpanMismatch(f"{self.block_where(block)}: this source reads no file without its block")

    def native_spans(self) -> NativeSpans | None:
        """What a reader outside Python needs to serve this shard's locators itself, or None
        (then every located read is :meth:`read_span`'s)."""
        return None

    # -- what its stored file table depends on

    @abstractmethod
    def table_files(self) -> list[str]:
        """The files its samples come from: a stored table is used only while they are unchanged."""

    def table_key(self) -> dict[str, Any]:
        """Everything a stored table of the shard was built from (JSON): its files'
        signatures, its first index, and any option that changes its samples. Files are
        named relative to the folder holding the shard, so that tables `atlasfs index`
        stored beside a dataset still serve where the dataset is mounted at another path
        (a network file system) or after it is moved."""
        base = os.path.dirname(self.path)
        return {"start": self.first_index,
                "files": {relative(path, base): file_signature(path, self.storage) for path in self.table_files()}}

    def summary(self) -> dict[str, object]:
        """This shard's columns in ``atlasfs info``, after its examples and blocks (by default
        its bytes); raises :class:`AtlasFormatError` if looking at it finds it bad."""
        return {"bytes": self.data_size}

    def problems(self) -> list[str]:
        """What a pass over the shard found wrong without failing a block (lines that are
        not documents, attribute sets left out), one line each: ``verify`` prints them."""
        return []

    def close(self) -> None:
        """Release open files (reopened on the next read)."""


class Source(ABC):
    """A dataset of one format: its shards, in the order their samples come.

    Attributes:
        kind: the format's name, as ``--format`` spells it.
        root: the dataset's folder or file.
        shards: its shards in sample order. Names are unique; a name that is also a
            folder of others' names (``a`` beside ``a/b``) is left out by the tree.
        storage: where its files are read from.
    """

    kind: str
    root: str
    shards: Sequence[SourceShard]
    #: Where its files are read from: the local disk, or an object store (docs/storage.md).
    #: Tables ``atlasfs index`` stores beside the dataset go through it too.
    storage: Storage = LOCAL

    @property
    def mtime(self) -> float:
        """Modification time of the tree's root folder."""
        try:
            if self.storage.remote:  # a prefix has no time of its own: its newest object's
                return max((found[1] for found in map(self.storage.stat, self.storage_files()) if found),
                           default=0) / 1e9
            return os.stat(self.root).st_mtime
        except OSError:
            return 0.0

    def storage_files(self) -> list[str]:
        """The files of its shards (for a dataset in a store, what its time is taken from)."""
        return [path for shard in self.shards for path in shard.table_files()]

    #: What ``info`` checks beyond opening, for its ``checked`` line.
    checked: str = "layout and indexes"

    def warnings(self) -> list[str]:
        """What ``verify`` notes that is not wrong (the dataset still serves), one line each."""
        return []

    def problems(self) -> list[str]:
        """What is wrong across shards (a Lavender uid in two shard indices), one line each,
        for ``verify``; each shard's own are :meth:`SourceShard.problems`."""
        return []

    def info(self) -> list[str]:
        """Lines of ``atlasfs info`` after the counts (``label        value``), once every
        shard's :meth:`SourceShard.summary` has been asked for."""
        return [f"format       {self.kind}"]

    def close(self) -> None:
        """Release every shard's open files."""
        for shard in self.shards:
            shard.close()

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
