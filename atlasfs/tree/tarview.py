"""Tar shards as seekable files: the bytes of ``atlasfs export``, made on read.

A :class:`TarLayout` places every member of one folder's tar (a pax-format
tar of its files in example order, :meth:`~atlasfs.tree.base.Tree.members`)
from the members' names and sizes alone: where each header, each file's
bytes and the end blocks lie. Any byte range can then be produced by
reading only the files under it. ``atlasfs export`` streams a layout into
a file; :class:`TarView` shows each shard folder of a tree as
``<shard>.tar`` beside a wids index, ``shards.json``.

A shard whose tar cannot be laid out (the shard cannot be opened, or a block
cannot be decoded when its files are sized: :class:`~atlasfs.tree.base.Unreadable`)
fails alone: its ``<shard>.tar`` is listed but fails with EIO, and
``shards.json`` lists the other shards (the log says which it leaves out), so
that wids and webdataset read every good shard.

Headers are made by :class:`tarfile.TarInfo` exactly as :mod:`tarfile`
writes them: members are mode 0444, uid and gid 0, no user or group names,
mtime the file's (whole seconds). A header is one 512-byte block unless the
name is longer than 100 bytes or not ASCII, or a number does not fit, when
a pax extended header goes before it.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import logging
import os
import tarfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Callable

import numpy as np

from atlasfs.tree.base import Entry, Tree, Unreadable, not_found, split_path
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.indexes.served import LoaderFiles, LoaderSettings, Served
from atlasfs.tree.table.layout import UNKNOWN_SIZE, UNREADABLE
from atlasfs.tree.tarstream import Streams

BLOCK = tarfile.BLOCKSIZE
RECORD = tarfile.RECORDSIZE
MEMBER_MODE = 0o444
#: The wids shard index file of the tar view.
INDEX_NAME = "shards.json"
#: Bytes of tar layouts kept (the most recently used; at least one): a layout is made again
#: from the tree when its tar is next looked up.
LAYOUT_BYTES = 16 << 20
#: A pass's pieces shorter than this are joined with their neighbours (:meth:`TarLayout.pieces`).
SMALL_PIECE = 16 << 10
#: ... into pieces of about this many bytes (for the tar view's passes, tree/tarstream.py).
GATHER_BYTES = 64 << 10
#: Most bytes of files a pass reads together, of one block (:func:`_pass_reader`).
PASS_BATCH_BYTES = 2 << 20
#: Inode numbers of the view's own files start here (the base tree's stay below).
VIEW_INO_BASE = 1 << 62
#: Inode numbers of the loaders' indexes (atlasfs/tree/indexes/) start here.
LOADER_INO_BASE = VIEW_INO_BASE + (1 << 60)

log = logging.getLogger("atlasfs")


def _tarfile_header(name: str, size: int, mtime: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = mtime
    info.mode = MEMBER_MODE
    info.uname = info.gname = ""
    return info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def _plain(name: str, size: int, mtime: int) -> bool:
    """True if the member's header is one ustar block (no pax header: tarfile's rule)."""
    return name.isascii() and len(name) <= tarfile.LENGTH_NAME and size < 8**11 and 0 <= mtime < 8**11


# A plain header is tarfile's header of an empty name with the name, size, mtime and
# checksum put in: made here without tarfile's per-field Python calls (most of export's
# time for small files otherwise). Checked against tarfile at import: if they ever differ
# (another Python's tarfile), tarfile makes every header.
_TEMPLATE = _tarfile_header("", 0, 0)
_TEMPLATE_SUM = sum(_TEMPLATE[:148]) + sum(_TEMPLATE[156:]) + 8 * 0x20  # the checksum field counts as spaces


_MODE_IDS = _TEMPLATE[100:124]  # mode, uid, gid: the same in every header
_TYPE_ON = _TEMPLATE[156:]  # type flag, link name, magic, version, names, device numbers, prefix
_SUM_BASE = _TEMPLATE_SUM - sum(_TEMPLATE[124:148])  # without size and mtime
_NAME_PADS = tuple(bytes(n) for n in range(tarfile.LENGTH_NAME + 1))
#: Zeros after a file's bytes up to the next block, for each length (no bytes made per member).
_PADS = tuple(bytes(n) for n in range(BLOCK))


def _fast_header(name: bytes, size: int, mtime: int) -> bytes:
    numbers = b"%011o\0%011o\0" % (size, mtime)
    checksum = _SUM_BASE + sum(name) + sum(numbers)
    return b"".join((name, _NAME_PADS[tarfile.LENGTH_NAME - len(name)], _MODE_IDS, numbers,
                     b"%06o\0 " % checksum, _TYPE_ON))


_FAST = all(_fast_header(n.encode(), z, t) == _tarfile_header(n, z, t)
            for n, z, t in (("a", 0, 0), ("x" * 100, 8**11 - 1, 8**11 - 1), ("0001.json", 1234, 1_700_000_000)))


def _header(name: str, size: int, mtime: int) -> bytes:
    if _FAST and _plain(name, size, mtime):
        return _fast_header(name.encode("ascii"), size, mtime)
    return _tarfile_header(name, size, mtime)


def _padded(size: int) -> int:
    return -(-size // BLOCK) * BLOCK


class TarLayout:
    """Where the members of the tar of folder ``folder`` of ``tree`` lie.

    Holds, per member, its header offset, size and mtime in numpy arrays and its
    name in one blob: about 40 bytes per member plus its name.
    """

    def __init__(self, tree: Tree, folder: str) -> None:
        self.tree = tree
        self.folder = folder.rstrip("/")
        self._members_of = folder
        found = _shard_members(tree, folder)
        if found is not None:  # a shard's table: its columns as they are
            self._names, self._name_offsets, self.sizes, mtime = found
            self.mtimes = np.full(len(self.sizes), mtime, dtype=np.int64)
            texts = self.names()
        else:
            texts, sizes, mtimes = [], [], []
            for name, entry in tree.members(folder):
                texts.append(name)
                sizes.append(entry.size)
                mtimes.append(int(entry.mtime))
            names = [name.encode("utf-8", "surrogateescape") for name in texts]
            self.sizes = np.array(sizes, dtype=np.uint64)
            self.mtimes = np.array(mtimes, dtype=np.int64)
            self._name_offsets = np.zeros(len(names) + 1, dtype=np.uint64)
            np.cumsum([len(b) for b in names], out=self._name_offsets[1:])
            self._names = b"".join(names)
        #: offset of member i's header; entry n is where the end blocks start
        self.starts = np.zeros(len(texts) + 1, dtype=np.uint64)
        np.cumsum(self._spans(texts), out=self.starts[1:])
        end = int(self.starts[-1]) + 2 * BLOCK
        self.size = -(-end // RECORD) * RECORD
        self._samples: int | None = None  # counted when asked (shards.json): .nv-meta needs none

    def _spans(self, texts: list[str]) -> np.ndarray:
        """Each member's bytes in the tar: its header blocks and its bytes padded to a block.
        A plain header is one block (:func:`_plain`, for every member at once); the others are made."""
        sizes, mtimes = self.sizes, self.mtimes
        lengths = np.diff(self._name_offsets)  # bytes: characters too when every name is ASCII
        plain = (lengths <= tarfile.LENGTH_NAME) & (sizes < 8**11) & (mtimes >= 0) & (mtimes < 8**11)
        if not self._names.isascii():
            plain &= np.fromiter((name.isascii() for name in texts), dtype=bool, count=len(texts))
        spans = (sizes + np.uint64(BLOCK - 1)) // np.uint64(BLOCK) * np.uint64(BLOCK) + np.uint64(BLOCK)
        for i in np.flatnonzero(~plain).tolist():
            spans[i] += len(_header(texts[i], sizes.item(i), mtimes.item(i))) - BLOCK
        return spans

    def names(self) -> list[str]:
        """Every member's name, in tar order (made each time: the layout keeps one blob)."""
        offsets = self._name_offsets.tolist()
        if self._names.isascii():
            text = self._names.decode("ascii")
            return [text[a:b] for a, b in zip(offsets, offsets[1:])]
        names = self._names
        return [names[a:b].decode("utf-8", "surrogateescape") for a, b in zip(offsets, offsets[1:])]

    def __len__(self) -> int:
        return len(self.sizes)

    def nbytes(self) -> int:
        """Memory the layout keeps."""
        return self.sizes.nbytes + self.mtimes.nbytes + self._name_offsets.nbytes + self.starts.nbytes + len(self._names)

    def name(self, i: int) -> str:
        """Member ``i``'s name (its path relative to the folder)."""
        return self._names[int(self._name_offsets[i]):int(self._name_offsets[i + 1])].decode("utf-8", "surrogateescape")

    def header(self, i: int) -> bytes:
        """Member ``i``'s header blocks (pax extended header included)."""
        return _header(self.name(i), int(self.sizes[i]), int(self.mtimes[i]))

    def data_starts(self) -> np.ndarray:
        """Where each member's bytes begin (after its header blocks)."""
        return self.starts[1:] - (self.sizes + np.uint64(BLOCK - 1)) // np.uint64(BLOCK) * np.uint64(BLOCK)

    def digest(self) -> bytes:
        """A hash of the layout (names, sizes, mtimes, offsets): equal layouts, equal tars."""
        h = hashlib.sha256()
        for part in (self._name_offsets, self._names, self.sizes, self.mtimes, self.starts):
            h.update(part)
        return h.digest()

    def samples(self) -> int:
        """The number of samples: runs of members sharing a key (a name up to the first dot of its last part)."""
        if self._samples is None:
            self._samples = _count_samples(self.names())
        return self._samples

    def read(self, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of the tar from ``offset``; reads only the files under the range."""
        return b"".join(self.parts(offset, size))

    def parts(self, offset: int, size: int) -> list[bytes]:
        """:meth:`read`'s bytes in pieces, in order (headers, files, padding)."""
        end = min(offset + size, self.size)
        if offset >= end:
            return []
        starts = self.starts
        parts: list[bytes] = []
        i = max(int(np.searchsorted(starts, offset, side="right")) - 1, 0)
        at = offset
        while at < end and i < len(self):
            header_start, member_end = starts.item(i), starts.item(i + 1)
            size_i = self.sizes.item(i)
            data_start = member_end - _padded(size_i)  # the header's length, without making it
            if at < data_start:
                parts.append(self.header(i)[at - header_start:min(end, data_start) - header_start])
                at = min(end, data_start)
            if at < end and at < data_start + size_i:
                stop = min(end, data_start + size_i)
                parts.append(self._data(i, at - data_start, stop - at))
                at = stop
            if at < end and at < member_end:  # padding to the next block
                stop = min(end, member_end)
                parts.append(bytes(stop - at))
                at = stop
            i += 1
        if at < end:  # the end-of-archive blocks and the record padding: zeros
            parts.append(bytes(end - at))
        return parts

    def _data(self, i: int, offset: int, size: int) -> bytes:
        entry = self.tree.lookup(f"{self.folder}/{self.name(i)}")
        if entry.size != int(self.sizes[i]):  # the tree changed under the layout
            raise OSError(errno.EIO, f"{self.folder}/{self.name(i)}: its size changed")
        data = self.tree.read(entry, offset, size)
        if len(data) != size:
            raise OSError(errno.EIO, f"{self.folder}/{self.name(i)}: short read")
        return data if type(data) is bytes else bytes(data)

    def pieces(self, chunk: int = 1 << 20, gather: int = 0) -> Iterator[bytes]:
        """The whole tar in order, a piece at a time (a header, up to ``chunk`` bytes of a
        file, padding, the end blocks), from one pass over the members
        (:meth:`~atlasfs.tree.base.Tree.member_files`: no lookup per file, the bytes export
        writes); each member checked against the layout (EIO if the tree changed under it).
        With ``gather``, runs of pieces shorter than :data:`SMALL_PIECE` are joined into
        pieces of about ``gather`` bytes (a pass a reader takes in requests keeps a piece per
        ``gather`` bytes of small files instead of three a member)."""
        sizes, mtimes = self.sizes.tolist(), self.mtimes.tolist()
        name_of = self._names_in_order()
        tree, where = self.tree, self.folder
        located = _pass_reader(tree)
        pads, block = _PADS, BLOCK
        small = SMALL_PIECE if gather else 0
        held: list[bytes] = []  # small pieces not yet joined, ``kept`` bytes
        kept = 0
        count = 0
        members = tree.member_files(self._members_of)
        for i, (name, entry, data) in enumerate(members if located is None else located(members)):
            size = entry.size
            if i >= len(sizes) or size != sizes[i] or name != name_of(i):
                raise OSError(errno.EIO, f"{where}/{name}: changed since its tar was laid out")
            if data is not None:
                files = (data,)
            elif not size:
                files = ()
            elif size <= chunk:
                files = (tree.read(entry, 0, size),)
            else:
                files = (tree.read(entry, at, min(chunk, size - at)) for at in range(0, size, chunk))
            header = _header(name, size, mtimes[i])
            if not small:
                yield header
            else:
                held.append(header)
                kept += len(header)
            got = 0
            for piece in files:
                got += len(piece)
                if type(piece) is not bytes:
                    piece = bytes(piece)
                if len(piece) < small:
                    held.append(piece)
                    kept += len(piece)
                    continue
                if held:
                    yield held[0] if len(held) == 1 else b"".join(held)
                    held, kept = [], 0
                yield piece
            if got != size:
                raise OSError(errno.EIO, f"{where}/{name}: short read")
            if size % block:
                if not small:
                    yield pads[block - size % block]
                else:
                    held.append(pads[block - size % block])
                    kept += block - size % block
            if kept >= gather and held:
                yield b"".join(held)
                held, kept = [], 0
            count += 1
        if count != len(sizes):
            raise OSError(errno.EIO, f"{where}: changed since its tar was laid out")
        held.append(bytes(self.size - self.starts.item(len(sizes))))
        yield b"".join(held)

    def _names_in_order(self) -> Callable[[int], str]:
        """``name`` for a pass: the names decoded once (a slice each), when they are ASCII."""
        names = self._names.decode("utf-8", "surrogateescape")
        if len(names) != len(self._names):  # some name is not ASCII: offsets are not characters
            return self.name
        offsets = self._name_offsets.tolist()
        return lambda i: names[offsets[i]:offsets[i + 1]]

    def write_to(self, out: "object", chunk: int = 1 << 20) -> None:
        """Write the whole tar to the binary file ``out``: the bytes :meth:`read` gives, the
        members checked against the layout as they come (see :func:`write_tar`)."""
        write_tar(self.tree, self._members_of, out, chunk=chunk, expect=self)


def _shard_members(tree: Tree, folder: str) -> tuple[bytes, np.ndarray, np.ndarray, int] | None:
    """The members of a :class:`~atlasfs.tree.blocktree.BlockTree`'s shard folder from its file
    table's columns (what :meth:`~atlasfs.tree.blocktree.BlockTree.members` gives a file at a
    time): their paths as one blob and its offsets, their sizes (filled in first) and the
    shard's mtime. None for another tree or folder, or a shard with unreadable rows (its
    members fail as they must)."""
    if not isinstance(tree, BlockTree):
        return None
    s, rest, _ = tree.placement.split(folder.rstrip("/") or "/")
    if s is None or rest:
        return None
    table = tree.table(s)
    rows = table.example_rows()
    if (table.kind[rows] == UNREADABLE).any():
        return None
    unknown = rows[table.size[rows] == UNKNOWN_SIZE]
    if len(unknown):
        tree.tables.fill_sizes(s, table, unknown.tolist())
    sizes = table.size[rows].astype(np.uint64)
    mtime = int(tree.placement.shard_entries[s].mtime)
    names, offsets = table.names, table.offsets
    if len(rows) == len(table):  # no folders: every row, in order
        start = offsets.item(0)
        return bytes(names[start:offsets.item(-1)]), offsets - np.uint64(start), sizes, mtime
    bounds = offsets.tolist()
    paths = [names[bounds[i]:bounds[i + 1]] for i in rows.tolist()]
    own = np.zeros(len(paths) + 1, dtype=np.uint64)
    np.cumsum(np.fromiter(map(len, paths), dtype=np.uint64, count=len(paths)), out=own[1:])
    return b"".join(paths), own, sizes, mtime


#: A member of a pass: its name, entry and bytes (None: read them with the tree's ``read``).
Member = tuple[str, Entry, "bytes | None"]


def _pass_reader(tree: Tree) -> Callable[[Iterator[Member]], Iterator[Member]] | None:
    """For a pass over a :class:`~atlasfs.tree.blocktree.BlockTree`'s shard: the members with
    the bytes of the files of blocks that store their runs as they are filled in, read a
    block at a time (:meth:`~atlasfs.tree.located.LocatedReads.block_in_pass`: the block's
    stored bytes read once for its files, data.bin's identity checked once for them, after
    the reads), the others as they came (the block path); None for other trees. Served that way
    a tar of incompressible files (JPEGs) costs a few preads a block instead of three copies of each block in
    freshly mapped memory (docs/performance.md, "The tar view")."""
    if not isinstance(tree, BlockTree):
        return None
    tables, located = tree.tables.tables, tree.located
    known: dict[int, list[bool]] = {}  # per shard, located.known_as_is as a list, once made

    def batched(s: int, block: int, batch: list[Member]) -> list[Member]:
        files = located.block_in_pass(tables.get(s), s, block, [entry for _, entry, _ in batch])
        if files is None:  # the block path for each
            return batch
        return [(name, entry, data) for (name, entry, _), data in zip(batch, files)]

    def members(given: Iterator[Member]) -> Iterator[Member]:
        first = next(given, None)
        if first is None:
            return iter(())
        given = itertools.chain((first,), given)
        ref = first[1].ref
        table = tables.get(ref.shard) if first[2] is None and ref is not None else None
        if not located.enabled or table is None or table.locators is None or \
                not located.stored_as_is(ref.shard, table).any():
            return given  # no file of the shard is read through a locator (text, tiny): nothing to check per member
        return batches(given)

    def batches(given: Iterator[Member]) -> Iterator[Member]:
        batch: list[Member] = []  # consecutive files of one block, ``held`` bytes
        held, key = 0, (-1, -1)
        for member in given:
            entry = member[1]
            ref = entry.ref
            take = member[2] is None and entry.size and ref is not None
            if take:
                as_is = known.get(ref.shard)
                if as_is is None:
                    made = located.known_as_is(ref.shard)
                    if made is not None:
                        as_is = known[ref.shard] = made.tolist()
                # a compressed block's files let go of at once (tiny sets: 1 us a file)
                if as_is is not None and not (ref.block < len(as_is) and as_is[ref.block]):
                    take = False
            if batch and (not take or (ref.shard, ref.block) != key or held + entry.size > PASS_BATCH_BYTES):
                yield from batched(*key, batch)
                batch, held = [], 0
            if not take:
                yield member
                continue
            batch.append(member)
            held += entry.size
            key = (ref.shard, ref.block)
        if batch:
            yield from batched(*key, batch)
    return members


@dataclass(frozen=True)
class Written:
    """What :func:`write_tar` wrote: members, samples (runs of members sharing a key), bytes."""

    files: int
    samples: int
    size: int


def write_tar(tree: Tree, folder: str, out: "object", on_sample: Callable[[], None] | None = None,
              chunk: int = 1 << 20, expect: TarLayout | None = None) -> Written:
    """Write the tar of ``folder`` of ``tree`` to the binary file ``out`` in one pass over its
    members (:meth:`~atlasfs.tree.base.Tree.member_files`: the bytes a :class:`TarLayout` of it
    places; no lookup per file), ``chunk`` bytes at a time: small members gathered, large files
    read in pieces; ``on_sample`` is called as each sample begins. With ``expect``, each
    member's name and size must be that layout's (EIO if the tree changed under it)."""
    write = out.write  # type: ignore[attr-defined]
    where = folder.rstrip("/")
    if expect is not None:
        sizes, mtimes = expect.sizes.tolist(), expect.mtimes.tolist()
    parts: list[bytes] = []
    held = at_end = count = samples = 0
    last: tuple[str, str] | None = None
    for i, (name, entry, data) in enumerate(tree.member_files(folder)):
        size = entry.size
        mtime = int(entry.mtime)
        if expect is not None:
            if i >= len(sizes) or size != sizes[i] or name != expect.name(i):
                raise OSError(errno.EIO, f"{where}/{name}: changed since its tar was laid out")
            mtime = mtimes[i]
        header = _header(name, size, mtime)
        parts.append(header)
        held += len(header)
        pieces = [data] if data is not None else (  # the source had the bytes at hand, or read them
            tree.read(entry, at, min(chunk, size - at)) for at in range(0, size, chunk))
        got = 0
        for piece in pieces:
            parts.append(piece)
            got += len(piece)
            held += len(piece)
            if held >= chunk:  # a large file goes out a piece at a time
                write(b"".join(parts))
                parts, held = [], 0
        if got != size:
            raise OSError(errno.EIO, f"{where}/{name}: short read")
        parts.append(bytes(-size % BLOCK))
        at_end += len(header) + _padded(size)
        count += 1
        sub, _, base = name.rpartition("/")
        key = (sub, base.split(".", 1)[0])
        if key != last:
            samples, last = samples + 1, key
            if on_sample is not None:
                on_sample()
    if expect is not None and count != len(sizes):
        raise OSError(errno.EIO, f"{where}: changed since its tar was laid out")
    size = -(-(at_end + 2 * BLOCK) // RECORD) * RECORD
    parts.append(bytes(size - at_end))
    write(b"".join(parts))
    return Written(count, samples, size)


def _count_samples(names: list[str]) -> int:
    """Runs of names sharing a key (a name up to the first dot of its last part)."""
    count, last = 0, None
    for name in names:
        folder, _, base = name.rpartition("/")
        key = (folder, base.split(".", 1)[0])
        if key != last:
            count, last = count + 1, key
    return count


def shard_index(folders: Sequence[tuple[str, int]]) -> bytes:
    """The wids shard index (``wids_version`` 1) of ``(shard tar name, samples)`` pairs, urls relative."""
    shardlist = [{"url": name, "nsamples": samples} for name, samples in folders]
    return (json.dumps({"wids_version": 1, "shardlist": shardlist}, indent=1) + "\n").encode()


class TarView(Tree):
    """``base``'s shard folders (:meth:`~atlasfs.tree.base.Tree.shard_folders`) as ``<shard>.tar``
    files, each where ``atlasfs export`` writes it (a shard named ``cc/b`` is ``cc/b.tar``,
    in the folder ``cc``), with ``shards.json`` at the root; with ``folders=True`` the base's
    folders are shown too (and everything under them)."""

    def __init__(self, base: Tree, folders: bool = False, loaders: LoaderSettings | None = None,
                 store: object = None, made: Callable[[str], None] | None = None) -> None:
        self.base = base
        #: Called with a shard once its layout is made: a one-pass command (``atlasfs index``)
        #: closes the shard's files there, so that it keeps one shard's descriptors at a time.
        self._made = made
        self.show_folders = folders
        self._layouts: OrderedDict[str, TarLayout] = OrderedDict()  # least recently used first
        self._layout_bytes = 0
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        # Shards whose tars cannot be laid out, and why (bad data: it stays bad).
        self._unreadable: dict[str, str] = {}
        self._index: bytes | None = None
        self._index_lock = threading.Lock()
        self._streams = Streams()  # tars being read front to back
        root = base.lookup("/")
        self._root = root
        self._shards = base.shard_folders()
        #: Tar path ("cc/b.tar") -> (shard, inode number).
        self._tars = {f"{shard}.tar": (shard, VIEW_INO_BASE + 1 + i) for i, shard in enumerate(self._shards)}
        #: Each folder of the view ("" the root) -> its tars and sub-folders, in shard order.
        self._children: dict[str, list[tuple[str, bool]]] = {"": []}
        for path in self._tars:
            parts = path.split("/")
            for k in range(1, len(parts)):
                folder, child = "/".join(parts[:k - 1]), (parts[k - 1], True)
                if child not in self._children.setdefault(folder, []):
                    self._children[folder].append(child)
                self._children.setdefault("/".join(parts[:k]), [])
            self._children["/".join(parts[:-1])].append((parts[-1], False))
        # Folders above tars in a view without the base's folders: inode numbers after the tars'.
        self._folder_ino = {folder: VIEW_INO_BASE + 1 + len(self._tars) + i
                            for i, folder in enumerate(f for f in self._children if f)}
        #: The loaders' indexes beside the tars and in .nv-meta/ (atlasfs/tree/indexes/).
        self.loaders = LoaderFiles({tar: shard for tar, (shard, _) in self._tars.items()}, self.layout,
                                   LOADER_INO_BASE, loaders, store)

    @property
    def rows(self) -> Tree | None:
        """The tree whose files this view shows at the same paths, for the native engine to
        answer them itself (docs/native.md: shard folders and table rows by inode number):
        the base with ``folders=True`` (inside a shard folder the view is the base's, its tars
        and indexes lie beside shard folders, never in one), else None (no per-sample files)."""
        return self.base if self.show_folders else None

    def layout(self, shard: str) -> TarLayout:
        """The layout of ``shard``'s tar, made on first use and kept (at most :data:`LAYOUT_BYTES`
        of layouts, the least recently used let go); raises :class:`~atlasfs.tree.base.Unreadable`
        (every time, remembered) if it cannot be made."""
        with self._lock:
            layout = self._layouts.get(shard)
            if layout is not None:
                self._layouts.move_to_end(shard)
        if layout is None:
            with self._lock:
                lock = self._locks.setdefault(shard, threading.Lock())
            with lock:
                layout = self._layouts.get(shard)
                if layout is None:
                    cause = self._unreadable.get(shard)
                    if cause is not None:
                        raise Unreadable(cause)
                    try:
                        layout = TarLayout(self.base, f"/{shard}")
                    except Unreadable as exc:
                        self._unreadable[shard] = exc.cause
                        raise
                    finally:
                        if self._made is not None:
                            self._made(shard)
                    self._keep(shard, layout)
        return layout

    def _keep(self, shard: str, layout: TarLayout) -> None:
        with self._lock:
            self._layouts[shard] = layout
            self._layout_bytes += layout.nbytes()
            while self._layout_bytes > LAYOUT_BYTES and len(self._layouts) > 1:
                _, evicted = self._layouts.popitem(last=False)
                self._layout_bytes -= evicted.nbytes()
                self._streams.forget(evicted)

    def _index_bytes(self) -> bytes:
        """``shards.json``: every shard whose tar can be laid out (made on first use)."""
        with self._index_lock:
            if self._index is None:
                listed = []
                for s in self._shards:
                    try:
                        listed.append((f"{s}.tar", self.layout(s).samples()))
                    except Unreadable as exc:
                        log.error("%s leaves out %s.tar, which fails with EIO: %s", INDEX_NAME, s, exc.cause)
                self._index = shard_index(listed)
        return self._index

    def lookup(self, path: str) -> Entry:
        relative = "/".join(split_path(path))
        if not relative:
            return self._root
        tar = self._tars.get(relative)
        if tar is not None:
            layout = self.layout(tar[0])
            return Entry(False, layout.size, self._root.mtime, tar[1], layout)
        if relative == INDEX_NAME:
            return Entry(False, len(self._index_bytes()), self._root.mtime, VIEW_INO_BASE, INDEX_NAME)
        served = self.loaders.find(relative)
        if served is not None:
            return Entry(False, self.loaders.size(served[0]), self._root.mtime, served[1], served[0])
        if self.loaders.is_folder(relative):
            return Entry(True, 0, self._root.mtime, self.loaders.folder_ino())
        if self.show_folders:
            return self.base.lookup(path)
        if relative in self._folder_ino:
            return Entry(True, 0, self._root.mtime, self._folder_ino[relative])
        raise not_found(path)

    def listdir(self, path: str) -> list[tuple[str, Entry]]:
        prefix = path.rstrip("/")
        return [(name, self.lookup(f"{prefix}/{name}")) for name, _, _ in self.names(path)]

    def names(self, path: str) -> Sequence[tuple[str, bool, int]]:
        folder = "/".join(split_path(path))
        if self.loaders.is_folder(folder):
            return self.loaders.names(folder)
        ours = self._children.get(folder)
        if self.show_folders:
            base = self.base.names(path)
            if ours is None:  # inside a shard folder: the base's alone
                return base
            return [*base, *self._files(folder)]
        if ours is None:
            raise self._not_a_folder(path)
        prefix = f"{folder}/" if folder else ""
        return [(name, True, self._folder_ino[prefix + name]) for name, is_dir in ours if is_dir] + self._files(folder)

    def _files(self, folder: str) -> list[tuple[str, bool, int]]:
        """The tars in ``folder`` (and ``shards.json`` at the root)."""
        prefix = f"{folder}/" if folder else ""
        files = [(name, False, self._tars[prefix + name][1]) for name, is_dir in self._children[folder] if not is_dir]
        if not folder:
            files.append((INDEX_NAME, False, VIEW_INO_BASE))
        return files + self.loaders.names(folder)

    def known_entries(self, path: str, start: int = 0, stop: int | None = None) -> Sequence[Entry | None]:
        folder = "/".join(split_path(path))
        if folder not in self._children and not self.loaders.is_folder(folder):
            if self.show_folders:
                return self.base.known_entries(path, start, stop)
            raise self._not_a_folder(path)
        # a tar's size needs its layout: known only once made
        prefix = f"/{folder}" if folder else ""
        return [self._known(f"{prefix}/{name}") for name, _, _ in list(self.names(path))[start:stop]]

    def _known(self, path: str) -> Entry | None:
        tar = self._tars.get(path[1:])
        if tar is not None:
            return self.lookup(path) if tar[0] in self._layouts else None
        if path[1:] == INDEX_NAME:
            return self.lookup(path) if self._index is not None else None
        served = self.loaders.find(path[1:])
        if served is not None:  # its size: known once its bytes are made
            known = self.loaders.known(served[0])
            if known is None:
                return None
            size = known if isinstance(known, int) else len(known)
            return Entry(False, size, self._root.mtime, served[1], served[0])
        if self.loaders.is_folder(path[1:]):
            return self.lookup(path)
        return None if self.show_folders else self.lookup(path)  # a folder of the view

    def _not_a_folder(self, path: str) -> OSError:
        self.lookup(path)  # ENOENT if it is nothing at all
        return OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)

    def read(self, entry: Entry, offset: int, size: int) -> bytes:
        ref = entry.ref
        if isinstance(ref, TarLayout):
            return b"".join(self._tar_parts(ref, offset, size))
        if ref == INDEX_NAME:
            return self._index_bytes()[offset:offset + size]
        if isinstance(ref, Served):
            return self.loaders.read(ref, offset, size)
        return self.base.read(entry, offset, size)

    def read_parts(self, entry: Entry, offset: int, size: int) -> list[bytes]:
        """:meth:`read`'s bytes in pieces, in order (the native engine gathers them into its
        reply: a tar's request is hundreds of headers and files, joined here for nothing)."""
        ref = entry.ref
        if isinstance(ref, TarLayout):
            return self._tar_parts(ref, offset, size)
        data = self.read(entry, offset, size)
        return [data if type(data) is bytes else bytes(data)]

    def _tar_parts(self, layout: TarLayout, offset: int, size: int) -> list[bytes]:
        stop = min(offset + size, layout.size)
        if offset >= stop:
            return []
        # a reader going through the tar in order: one pass over its members, as export writes it
        parts = self._streams.read(layout, offset, stop, lambda: layout.pieces(gather=GATHER_BYTES))
        return parts if parts is not None else layout.parts(offset, size)

    def total_bytes(self) -> int:
        return self.base.total_bytes()

    def shard_folders(self) -> list[str]:
        return self._shards if self.show_folders else []

    def members(self, path: str) -> Iterator[tuple[str, Entry]]:
        folder = "/".join(split_path(path))
        if self.show_folders and folder not in self._children and not self.loaders.is_folder(folder):
            return self.base.members(path)  # a shard folder: the base knows its example order
        return super().members(path)
