"""The loader indexes a tar view shows beside its tars, and what each holds.

Beside each ``<shard>.tar``: ``<shard>.tar.idx`` (energon) and ``<shard>.idx`` (DALI); at
the root, ``.nv-meta/`` with ``.info.json``, ``split.yaml``, ``dataset.yaml``,
``index.sqlite`` and ``index.uuid`` (energon). A tar's indexes are made from its layout
when first looked up and kept (at most :data:`INDEX_BYTES` of them, the least recently
used made again); ``.nv-meta``'s from every tar's, once. ``index.sqlite`` is built once per
dataset and stored (:mod:`atlasfs.tree.indexes.sqlitefile`). Nothing is written into the
dataset.

A tar that cannot be laid out fails its indexes as it fails itself (EIO), and is left out
of ``.nv-meta`` (the log says so once), as ``shards.json`` leaves it out; so is a tar in
which energon finds no sample (``energon prepare`` stops at one). A dataset whose samples
share a key across tars gets no ``index.sqlite`` (EIO, and one log line): energon's cannot
hold it either, and needs it only for ``energon mount`` and lookups by key.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from atlasfs.tree.base import Unreadable
from atlasfs.tree.indexes import dali, energon, sqlitefile
from atlasfs.tree.table import store

log = logging.getLogger("atlasfs")
#: Bytes of per-tar indexes kept (the most recently used; at least one).
INDEX_BYTES = 8 << 20
#: The largest ``split.yaml`` or ``dataset.yaml`` a user may name.
USER_FILE_BYTES = 1 << 20
_RATIO = re.compile(r"\d+(\.\d*)?:\d+(\.\d*)?:\d+(\.\d*)?")
META_FILES = (energon.INFO_NAME, energon.SPLIT_NAME, energon.DATASET_NAME, energon.SQLITE_NAME,
              energon.UUID_NAME)


@dataclass(frozen=True)
class LoaderSettings:
    """What the user chose of energon's files: the split (None: every tar in ``train``; a
    train:val:test ratio; or a file's bytes) and ``dataset.yaml`` (None: CrudeWebdataset)."""

    split_ratio: tuple[float, float, float] | None = None
    split_file: bytes | None = None
    dataset_file: bytes | None = None

    @classmethod
    def from_options(cls, split: str | None, dataset: str | None) -> "LoaderSettings":
        """From ``-o energon_split=`` (``8:1:1`` or a file) and ``-o energon_dataset=FILE``;
        ValueError in one line if a file cannot be read."""
        ratio = None
        split_file = None
        if split is not None and _RATIO.fullmatch(split):
            ratio = tuple(float(x) for x in split.split(":"))
            if sum(ratio) <= 0:
                raise ValueError(f"energon_split={split}: the ratio adds up to 0")
        elif split is not None:
            split_file = _user_file("energon_split", split)
        dataset_file = _user_file("energon_dataset", dataset) if dataset is not None else None
        return cls(ratio, split_file, dataset_file)  # type: ignore[arg-type]


def _user_file(option: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            if not os.path.isfile(path):
                raise ValueError(f"{option}={path}: not a regular file")
            data = f.read(USER_FILE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{option}={path}: {exc.strerror or exc}") from None
    if len(data) > USER_FILE_BYTES:
        raise ValueError(f"{option}={path}: more than {USER_FILE_BYTES} bytes")
    return data


@dataclass(frozen=True)
class Served:
    """The ref of a served index: its kind (``tar.idx``, ``idx`` or a ``.nv-meta`` file name)
    and its tar's shard (None for ``.nv-meta``'s)."""

    kind: str
    shard: str | None = None


ENERGON_TAR, DALI_TAR = "tar.idx", "idx"


class LoaderFiles:
    """The indexes beside the tars ``tars`` (tar path -> shard, in the view's order),
    each tar laid out by ``layout(shard)``; ``.nv-meta/index.sqlite`` kept in ``store``
    (a TableStore, or None), ``settings`` the user's choices."""

    def __init__(self, tars: dict[str, str], layout: Callable[[str], energon.Layout], ino_base: int,
                 settings: LoaderSettings | None = None, store: object = None) -> None:
        self._layout = layout
        self.settings = settings or LoaderSettings()
        self._store = store
        #: path ("cc/b.tar.idx") -> (ref, inode number), and each folder's names in order
        self._files: dict[str, tuple[Served, int]] = {}
        self._names: dict[str, list[tuple[str, bool, int]]] = {}
        taken = set(tars)
        for i, (tar, shard) in enumerate(tars.items()):
            stem = tar[:-len(".tar")]
            for j, (name, kind) in enumerate(((f"{tar}{energon.TAR_INDEX_SUFFIX}", ENERGON_TAR),
                                              (f"{stem}{dali.SUFFIX}", DALI_TAR))):
                if name in taken:  # shard "a.tar"'s DALI index would be shard "a"'s energon index
                    continue
                taken.add(name)
                self._add(name, Served(kind, shard), ino_base + 16 + 2 * i + j)
        self._meta_ino = ino_base
        self._names.setdefault("", []).append((energon.META_FOLDER, True, ino_base))
        self._names[energon.META_FOLDER] = []
        for k, name in enumerate(META_FILES):
            self._add(f"{energon.META_FOLDER}/{name}", Served(name), ino_base + 1 + k)
        self._tar_order = energon.tar_order(list(tars))
        self._shard_of = dict(tars)
        self._lock = threading.Lock()
        self._kept: OrderedDict[Served, bytes] = OrderedDict()
        self._kept_bytes = 0
        self._meta: dict[str, bytes] = {}
        self._meta_lock = threading.Lock()
        self._sqlite_lock = threading.Lock()
        self._sqlite: tuple[int, int] | None = None  # (descriptor, size)
        self._sqlite_error: str | None = None
        self._left_out: set[str] = set()

    def _add(self, path: str, ref: Served, ino: int) -> None:
        self._files[path] = (ref, ino)
        folder, _, name = path.rpartition("/")
        self._names.setdefault(folder, []).append((name, False, ino))

    # ---------------------------------------------------------------- the tree's questions

    def is_folder(self, relative: str) -> bool:
        return relative == energon.META_FOLDER

    def folder_ino(self) -> int:
        return self._meta_ino

    def names(self, folder: str) -> list[tuple[str, bool, int]]:
        """The names this adds to ``folder`` ("" the root)."""
        return self._names.get(folder, [])

    def find(self, relative: str) -> tuple[Served, int] | None:
        """(ref, inode number) of the served file ``relative``, or None if it is not one."""
        return self._files.get(relative)

    def known(self, ref: Served) -> bytes | int | None:
        """The file's bytes (or size) if known without work, else None."""
        if ref.shard is not None:
            with self._lock:
                return self._kept.get(ref)
        if ref.kind == energon.SQLITE_NAME:
            return None if self._sqlite is None else self._sqlite[1]
        return self._meta.get(ref.kind)

    def size(self, ref: Served) -> int:
        """The file's size (its bytes made, or for ``index.sqlite`` found or built, first)."""
        if ref.kind == energon.SQLITE_NAME:
            return self._sqlite_file()[1]
        return len(self.data(ref))

    def read(self, ref: Served, offset: int, size: int) -> bytes:
        if ref.kind == energon.SQLITE_NAME:
            fd, length = self._sqlite_file()
            return os.pread(fd, max(0, min(size, length - offset)), offset) if offset < length else b""
        return self.data(ref)[offset:offset + size]

    # ---------------------------------------------------------------- per tar

    def data(self, ref: Served) -> bytes:
        """The bytes of every served file but ``index.sqlite``."""
        if ref.shard is None:
            return self._meta_bytes(ref.kind)
        with self._lock:
            data = self._kept.get(ref)
            if data is not None:
                self._kept.move_to_end(ref)
                return data
        layout = self._layout(ref.shard)  # Unreadable: this index fails as its tar does
        data = energon.tar_index(layout) if ref.kind == ENERGON_TAR else dali.dali_index(layout)
        with self._lock:
            if ref not in self._kept:
                self._kept[ref] = data
                self._kept_bytes += len(data)
            while self._kept_bytes > INDEX_BYTES and len(self._kept) > 1:
                _, evicted = self._kept.popitem(last=False)
                self._kept_bytes -= len(evicted)
        return data

    def _tar_index(self, tar: str) -> bytes | None:
        """A tar's ``.tar.idx``, or None if it is left out of ``.nv-meta`` (logged once)."""
        shard = self._shard_of[tar]
        try:
            data = self.data(Served(ENERGON_TAR, shard))
        except Unreadable as exc:
            self._leave_out(tar, f"it fails with EIO: {exc.cause}")
            return None
        if energon.samples_of(data) == 0:
            self._leave_out(tar, "energon finds no sample in it (no member named key.part)")
            return None
        return data

    def _leave_out(self, tar: str, why: str) -> None:
        if tar not in self._left_out:
            self._left_out.add(tar)
            log.error("%s/ leaves out %s: %s", energon.META_FOLDER, tar, why)

    # ---------------------------------------------------------------- .nv-meta

    def _counts(self) -> list[tuple[str, int]]:
        counts = []
        for tar in self._tar_order:
            data = self._tar_index(tar)
            if data is not None:
                counts.append((tar, energon.samples_of(data)))
        return counts

    def _meta_bytes(self, name: str) -> bytes:
        with self._meta_lock:
            data = self._meta.get(name)
            if data is None:
                data = self._make_meta(name)
                self._meta[name] = data
            return data

    def _make_meta(self, name: str) -> bytes:
        settings = self.settings
        if name == energon.DATASET_NAME:
            return settings.dataset_file if settings.dataset_file is not None else energon.CRUDE_DATASET
        if name == energon.SPLIT_NAME and settings.split_file is not None:
            return settings.split_file
        counts = self._counts()
        tars = [tar for tar, _ in counts]
        if name == energon.INFO_NAME:
            return energon.info_json(counts)
        if name == energon.SPLIT_NAME:
            if settings.split_ratio is not None:
                return energon.split_yaml(energon.split_by_ratio(tars, settings.split_ratio))
            return energon.split_yaml({"train": tars})
        if name == energon.UUID_NAME:
            return energon.dataset_uuid(energon.info_json(counts),
                                        (self.data(Served(ENERGON_TAR, self._shard_of[t])) for t in tars))
        raise KeyError(name)

    def layouts_key(self) -> tuple[list[str], str]:
        """The tars of ``.nv-meta`` and a hash of their layouts (what ``index.sqlite`` is built from)."""
        import hashlib
        tars = [tar for tar, _ in self._counts()]
        digest = hashlib.sha256(b"atlasfs energon index.sqlite 1\0" + energon.ENERGON_VERSION.encode())
        for tar in tars:
            digest.update(tar.encode("utf-8", "surrogateescape") + b"\0")
            digest.update(self._layout(self._shard_of[tar]).digest())
        return tars, digest.hexdigest()[:32]

    def _sqlite_file(self) -> tuple[int, int]:
        with self._sqlite_lock:
            if self._sqlite is not None:
                return self._sqlite
            if self._sqlite_error is not None:
                raise Unreadable(self._sqlite_error)
            tars, key = self.layouts_key()
            fd = sqlitefile.find(self._store, key) if self._store is not None else None  # type: ignore[arg-type]
            if fd is None:
                fd, _ = self._build_sqlite(tars, key)
            self._sqlite = (fd, os.fstat(fd).st_size)
            return self._sqlite

    def _build_sqlite(self, tars: Sequence[str], key: str) -> tuple[int, str | None]:
        def write(path: str) -> None:
            energon.write_sqlite(path, (energon.sample_rows(i, self._layout(self._shard_of[tar]))
                                        for i, tar in enumerate(tars)))
        try:
            fd, where = sqlitefile.build(self._store, key, write)  # type: ignore[arg-type]
        except (energon.DuplicateKey, UnicodeError, ValueError) as exc:
            what = (f"the sample key {exc} is in more than one sample" if isinstance(exc, energon.DuplicateKey)
                    else f"a sample key cannot be stored ({exc})")
            self._sqlite_error = f"{energon.META_FOLDER}/{energon.SQLITE_NAME} cannot be made: {what}"
            log.error("%s", self._sqlite_error)
            raise Unreadable(self._sqlite_error) from None
        log.info("%s/%s built%s", energon.META_FOLDER, energon.SQLITE_NAME, f" and stored in {where}" if where else "")
        return fd, where

    def store_sqlite(self) -> str | None:
        """Make sure ``index.sqlite`` is stored (``atlasfs index``); returns where, or None if it
        could only be made in a temporary file. Raises :class:`Unreadable` if it cannot be made."""
        with self._sqlite_lock:
            tars, key = self.layouts_key()
            found = sqlitefile.find(self._store, key) if self._store is not None else None  # type: ignore[arg-type]
            if found is not None:  # up to date: readable by every user, as `atlasfs index` leaves tables
                path = os.path.join(self._store.save_folder, sqlitefile.file_name(key))  # type: ignore[attr-defined]
                store._share(found, path, os.fstat(found))  # noqa: SLF001
                os.close(found)
                return path
            fd, where = self._build_sqlite(tars, key)
            os.close(fd)
        return where

    def close(self) -> None:
        if self._sqlite is not None:
            os.close(self._sqlite[0])
            self._sqlite = None
