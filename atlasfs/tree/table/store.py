"""Where shard file tables are kept between mounts.

A mount never writes into the dataset it shows. It reads tables from, in
this order: the folder given with ``--index-dir``; the dataset's own
``.atlasfs-tables/`` folder, written only by ``atlasfs index`` (for datasets
shared read-only by many users); and the user's cache,
``$XDG_CACHE_HOME/atlasfs/tables/<dataset id>/`` (default ``~/.cache``), where
the dataset id is a hash of the dataset's resolved path. It saves new tables
to ``--index-dir`` if given, else to the user's cache; ``atlasfs index`` saves
beside the dataset instead (for a dataset in a bucket, through its store: the
only writes atlasfs ever makes to a bucket).

A table is used only if it was built from exactly the same shard files
(sizes and mtimes) and naming rules; a stale, foreign or corrupt one is
ignored with one log line and built again. Tables are written atomically
(a temporary file, then a rename), so two mounts of one dataset at once
each leave a whole table. The user's cache is bounded in bytes: after each
save, the tables used least recently go until it fits.

Whose local tables are used at all (issue #35; OpenSSH's StrictModes and git's
safe.directory decide alike): a table file is opened without following a symbolic link
(``O_NOFOLLOW``, and ``O_NONBLOCK`` against a FIFO put in its place), and the opened file must
be a regular file that only someone who can change the dataset anyway can change: owned by
the daemon's user, by root, or by the owner of the dataset's root (its folder, or its file for
a one-file dataset: whoever owns it can replace every shard under it), and writable by its
owner alone (no group or other write bit). Any other table is ignored with one log line
saying which file and why, and built again from the data: a table more people can write than
the data could otherwise serve any bytes as a file without touching the data. Everything
after the check (map, copy, read, ``fchmod``) goes through the descriptor checked, never the
path again. Tables in a bucket come from the store the data comes from, and are trusted as
it is.

A table is mapped from its file, not read (:mod:`atlasfs.tree.table.ondisk`), if it is a local
file of the daemon's own user, which atlasfs only ever replaces by rename; another (trusted)
user's table, or one in a bucket, is copied into the user's cache first and the copy mapped
(the copy counts in the cache's bound), so that no one can cut a mapped file short under a
mount. Such a table is read by the size its header states, after the header is checked and
found to state the file's size, at most the cache's bound: never whole before any check.

Tables stored for others (beside the dataset, or in ``--index-dir``) are
readable by every user whatever the umask: files 0644, and the folders atlasfs
creates for them 0755 (a folder that exists keeps its mode). They hold the
dataset's file names and sizes, which its readers see anyway. The user's cache
stays private (0600 files).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import stat
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

from atlasfs.sizes import parse_size
from atlasfs.storage import LOCAL, Storage, StorageUnavailableError, is_url, redact
from atlasfs.tree.table import ondisk, validated
from atlasfs.tree.table.filetable import FileTable, Limits, LimitsOf, TableError

log = logging.getLogger("atlasfs")
#: The folder ``atlasfs index`` writes inside a dataset (hidden, so never taken for a shard).
BESIDE_DATASET = ".atlasfs-tables"
#: Default bound of the user's table cache; ``ATLASFS_TABLE_CACHE_SIZE`` sets another (e.g. ``4G``).
DEFAULT_CACHE_BOUND = 1 << 30
#: Permission bits of tables stored for every user of a dataset, and of the folders made for them.
SHARED_FILE_MODE = 0o644
SHARED_FOLDER_MODE = 0o755
_SOURCE_FILE = "dataset.json"
_SUFFIX = ".table"
#: Files of the cache counted, listed and evicted with the tables: those, and energon's
#: index.sqlite of a dataset's tar view (:mod:`atlasfs.tree.indexes.sqlitefile`).
_CACHED_SUFFIXES = (_SUFFIX, ".sqlite")
#: Bytes copied at a time from another user's table into the user's cache.
_COPY_CHUNK = 1 << 20


def cache_root() -> str:
    """The user's table cache: ``$XDG_CACHE_HOME/atlasfs/tables`` (default ``~/.cache/atlasfs/tables``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "atlasfs", "tables")


def validated_root() -> str:
    """Where the user's record of table files found valid is kept (:mod:`validated`): beside the
    table cache, ``$XDG_CACHE_HOME/atlasfs``, not in it (never counted, listed or evicted as a table)."""
    return os.path.dirname(cache_root())


def cache_bound() -> int:
    """The bound of the user's table cache in bytes."""
    text = os.environ.get("ATLASFS_TABLE_CACHE_SIZE")
    if not text:
        return DEFAULT_CACHE_BOUND
    try:
        return parse_size(text)
    except ValueError as exc:
        log.warning("ATLASFS_TABLE_CACHE_SIZE: %s; using %d bytes", exc, DEFAULT_CACHE_BOUND)
        return DEFAULT_CACHE_BOUND


def table_file_name(shard: str) -> str:
    """The file name of a shard's table: its name, quoted so that a shard in a sub-folder
    (a Dolma documents file ``cc/part-1``) stays one file (``cc%2Fpart-1.table``)."""
    return urllib.parse.quote(shard.encode("utf-8", "surrogateescape"), safe="") + _SUFFIX


def _dataset_id(dataset_root: str) -> str:
    """What names a dataset in the cache: its resolved path, or its URL (no credentials)."""
    return redact(dataset_root.rstrip("/")) if is_url(dataset_root) else os.path.realpath(dataset_root)


def cache_folder(dataset_root: str) -> str:
    """A dataset's folder in the user's cache (named by a hash of its resolved path or URL)."""
    path = _dataset_id(dataset_root).encode("utf-8", "surrogateescape")
    return os.path.join(cache_root(), hashlib.sha256(path).hexdigest()[:20])


class TableStore:
    """Loads and saves the file tables of one dataset's shards.

    ``index_dir`` (if given) is read first and written to; otherwise tables are
    written to the user's cache, or beside the dataset when ``beside`` is true
    (``atlasfs index``).
    """

    def __init__(self, dataset_root: str, index_dir: str | None = None, beside: bool = False,
                 storage: Storage = LOCAL) -> None:
        self.dataset_root = _dataset_id(dataset_root)
        self.cache_folder = cache_folder(dataset_root)
        if storage.remote:
            # A bucket: tables beside the dataset are read and written through its store
            # (written only by `atlasfs index`); the cache and --index-dir are local.
            beside_folder = f"{dataset_root.rstrip('/')}/{BESIDE_DATASET}"
        else:
            # A dataset that is one file (a .pbin) keeps its tables in the folder holding it.
            holder = self.dataset_root if os.path.isdir(self.dataset_root) else os.path.dirname(self.dataset_root)
            beside_folder = os.path.join(holder, BESIDE_DATASET)
        self._beside = beside_folder
        self._storage = storage
        if index_dir is not None:
            self.save_folder = os.path.abspath(index_dir)
        else:
            self.save_folder = beside_folder if beside else self.cache_folder
        self.folders = list(dict.fromkeys(
            [f for f in (index_dir and self.save_folder, beside_folder, self.cache_folder) if f]))
        if beside:  # `atlasfs index`: a table found elsewhere (the cache) would not be stored where asked
            self.folders = [self.save_folder]
        self._beside_only = beside
        #: Who may own a local table that is used (module docstring): this user, root, and the
        #: owner of the dataset's root, who can change the dataset anyway.
        self.trusted_owners = {os.geteuid(), 0}
        if not storage.remote:
            try:
                self.trusted_owners.add(os.stat(self.dataset_root).st_uid)
            except OSError:  # the dataset's own opening says why
                pass
        self._cache_bytes: int | None = None  # the cache's size as last counted, kept up to date by saves
        # Tables found valid by an earlier mount or `atlasfs index` are mapped without a pass.
        validated.load(validated_root(), validated_root)
        #: Tables that could not be stored (each logged).
        self.failures = 0

    def _store_of(self, folder: str) -> Storage:
        """Local folders are read with the OS; the folder beside a dataset in a bucket, through its store."""
        return self._storage if folder == self._beside else LOCAL

    def _path(self, folder: str, shard: str) -> str:
        name = table_file_name(shard)
        return f"{folder}/{name}" if self._store_of(folder).remote else os.path.join(folder, name)

    def load(self, shard: str, key: dict[str, Any], limits: Limits | LimitsOf) -> FileTable | None:
        """The stored table of ``shard`` built from ``key``, from the first place holding a valid one
        that may be used (module docstring; ``limits``: see :meth:`FileTable.from_bytes`)."""
        unavailable: StorageUnavailableError | None = None
        for folder in self.folders:
            path = self._path(folder, shard)
            store = self._store_of(folder)
            try:
                table = self._remote(path, key, limits) if store.remote else self._local(folder, path, key, limits)
            except StorageUnavailableError as exc:  # transient, and building it would wait for the same store
                unavailable = exc
                continue
            except (TableError, OSError) as exc:
                why = str(exc) if isinstance(exc, TableError) else f"cannot be read ({exc.strerror or exc})"
                log.info("ignoring the stored file table %s: it %s; building it again", store.describe(path), why)
                continue
            if table is not None:
                return table
        if unavailable is not None:  # not "no table": it is there, and read on a later look
            raise unavailable
        return None

    def _distrust(self, st: os.stat_result, mapped: bool = False) -> str | None:
        """Why the opened table file ``st`` must not be used (see the module docstring), or None;
        ``mapped``: it is to be mapped in place, so it must be the daemon's user's own."""
        if not stat.S_ISREG(st.st_mode):
            return "is not a regular file"
        owners = {os.geteuid()} if mapped else self.trusted_owners
        if st.st_uid not in owners:
            return f"is owned by uid {st.st_uid}, who cannot change the dataset"
        if st.st_mode & 0o022:
            return f"can be changed by users other than its owner (mode {stat.S_IMODE(st.st_mode):04o})"
        return None

    def _local(self, folder: str, path: str, key: dict[str, Any], limits: Limits | LimitsOf) -> FileTable | None:
        """The table in the local file ``path`` if there is one and it may be used; every use of
        it through the one descriptor checked."""
        fd = ondisk.open_table(path)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            why = self._distrust(st)
            if why is not None:
                raise TableError(why)
            # Touched before it is mapped: a file is mapped again without a pass only while
            # its size and mtime are those it had when checked (ondisk.map_descriptor).
            if folder == self.cache_folder and st.st_uid == os.geteuid():
                _touch(fd)  # eviction goes by last use
                touched, st = st, os.fstat(fd)
                ondisk.touched(touched, st)  # found valid before: still so (validated.py)
            checks = ondisk.CHECKS["full"]
            table = self._open(folder, fd, path, st, key, limits)
            log.debug("file table %s: %s", path, "checked" if ondisk.CHECKS["full"] != checks else "found valid before")
            if self._beside_only:
                _share(fd, path, st)  # `atlasfs index` keeps it: stored 0600 by an older atlasfs, it becomes 0644
            return table
        finally:
            os.close(fd)  # a map keeps its file

    def _open(self, folder: str, fd: int, path: str, st: os.stat_result, key: dict[str, Any],
              limits: Limits | LimitsOf) -> FileTable:
        """The table open as ``fd`` (at ``path``, ``st`` its fstat), mapped if it is a local file of
        ours (atlasfs replaces those by rename, never in place, so a mapped one is never
        truncated under its map); else (another trusted user's file, which its owner may change
        in place) copied into the user's cache by the size its header states, and the copy mapped
        (read into memory instead if the copy cannot be written)."""
        if st.st_uid == os.geteuid():
            return ondisk.map_descriptor(fd, path, key, limits)
        bound = cache_bound()
        if folder == self.cache_folder:  # not ours, in our cache: read, not mapped
            return FileTable.from_bytes(_read_stated(fd, st, bound), key, limits)
        size = _stated(fd, st, bound, key)
        try:
            os.makedirs(self.cache_folder, exist_ok=True)
            _write_source(self.cache_folder, self.dataset_root)
            copy_fd, copy = _copy_into(fd, size, self.cache_folder, path.rsplit("/", 1)[-1])
        except OSError:
            return FileTable.from_bytes(_read_stated(fd, st, bound), key, limits)
        try:
            table = ondisk.map_descriptor(copy_fd, copy, key, limits)
        except TableError:
            _unlink(copy)
            raise
        finally:
            os.close(copy_fd)
        self._keep_cache_bound(copy)
        return table

    def _remote(self, path: str, key: dict[str, Any], limits: Limits | LimitsOf) -> FileTable | None:
        """The table at ``path`` in the dataset's bucket (trusted as the data is), read by the size
        its header states, copied into the user's cache and the copy mapped."""
        store = self._storage
        found = store.stat(path)
        if found is None:
            return None
        data = ondisk.read_stated(lambda offset, count: store.pread(path, offset, count), found[0], cache_bound())
        copy = os.path.join(self.cache_folder, path.rsplit("/", 1)[-1])
        try:
            os.makedirs(self.cache_folder, exist_ok=True)
            _write_source(self.cache_folder, self.dataset_root)
            LOCAL.write(copy, data)
        except OSError:
            return FileTable.from_bytes(data, key, limits)
        del data
        try:
            table = FileTable.load(copy, key, limits)
        except TableError:
            _unlink(copy)
            raise
        if table is None:
            raise TableError("is gone")
        self._keep_cache_bound(copy)
        return table

    def saved_path(self, shard: str) -> str | None:
        """The local file :meth:`save` stores ``shard``'s table in (None: a bucket)."""
        return None if self._store_of(self.save_folder).remote else self._path(self.save_folder, shard)

    def reopen(self, path: str, key: dict[str, Any], limits: Limits) -> FileTable | None:
        """The table mapped from ``path`` again (a table unmapped to bound memory), or None
        if it is gone (evicted from the cache) or no longer valid or ours (logged): the file
        there now is checked as at first (a symbolic link, or a file of another user put in its
        place, is never mapped)."""
        try:
            fd = ondisk.open_table(path)
            if fd is None:
                return None
            try:
                why = self._distrust(os.fstat(fd), mapped=True)
                if why is not None:
                    raise TableError(why)
                return ondisk.map_descriptor(fd, path, key, limits)
            finally:
                os.close(fd)
        except (TableError, OSError) as exc:
            why = str(exc) if isinstance(exc, TableError) else f"cannot be read ({exc.strerror or exc})"
            log.info("ignoring the stored file table %s: it %s; building it again", path, why)
            return None

    def save(self, shard: str, key: dict[str, Any], table: FileTable) -> str | None:
        """Store ``table``; returns where, or None if it could not be written (logged)."""
        folder = self.save_folder
        path = self._path(folder, shard)
        store = self._store_of(folder)
        try:
            if folder == self.cache_folder:
                os.makedirs(folder, exist_ok=True)
                _write_source(folder, self.dataset_root)
                store.write(path, table.to_bytes(key))
            else:  # for every user of the dataset: readable by all (module docstring)
                if not store.remote:
                    make_shared_folder(folder)
                store.write(path, table.to_bytes(key), mode=SHARED_FILE_MODE)
        except OSError as exc:
            log.warning("cannot store the file table of shard %s in %s: %s", shard, store.describe(folder),
                        exc.strerror or exc)
            self.failures += 1
            return None
        if folder == self.cache_folder:
            self._keep_cache_bound(path)
        return store.describe(path)

    def _keep_cache_bound(self, just_saved: str) -> None:
        size = os.path.getsize(just_saved)
        if self._cache_bytes is None:
            self._cache_bytes = sum(entry.bytes for entry in cached_tables())
        else:
            self._cache_bytes += size
        bound = cache_bound()
        if self._cache_bytes > bound:
            self._cache_bytes = evict(bound, keep=just_saved)


def make_shared_folder(folder: str) -> None:
    """Create ``folder`` and any missing parents as :data:`SHARED_FOLDER_MODE` (whatever the
    umask); folders that exist keep their mode."""
    missing = []
    path = os.path.abspath(folder)
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        try:
            os.mkdir(path, SHARED_FOLDER_MODE)
        except FileExistsError:  # made meanwhile (another index run), or a file: the write says which
            continue
        # mkdir's mode is cut by the umask; set on the folder made, never through a link put in its place
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
        try:
            os.fchmod(fd, SHARED_FOLDER_MODE)
        finally:
            os.close(fd)


@dataclass(frozen=True)
class CachedTable:
    """One table file in the user's cache."""

    path: str
    dataset: str  # the dataset's path, as recorded when the folder was made ("?" if unknown)
    bytes: int
    used: float  # last use, seconds since the epoch


def cached_tables(dataset_root: str | None = None) -> list[CachedTable]:
    """Every table in the user's cache (only ``dataset_root``'s if given), least recently used first."""
    found = []
    root = cache_root()
    only = cache_folder(dataset_root) if dataset_root is not None else None
    try:
        folders = list(os.scandir(root))
    except OSError:
        return []
    for folder in folders:
        if not folder.is_dir(follow_symlinks=False) or only not in (None, folder.path):
            continue
        source = _read_source(folder.path)
        try:
            entries = list(os.scandir(folder.path))
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(_CACHED_SUFFIXES):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                found.append(CachedTable(entry.path, source, st.st_size, st.st_mtime))
    found.sort(key=lambda t: t.used)
    return found


def evict(bound: int, keep: str | None = None) -> int:
    """Delete the least recently used tables of the user's cache until it holds at most
    ``bound`` bytes (never ``keep``); returns the bytes left."""
    tables = cached_tables()
    total = sum(t.bytes for t in tables)
    for table in tables:
        if total <= bound:
            break
        if table.path == keep:
            continue
        try:
            os.unlink(table.path)
        except OSError:
            continue
        total -= table.bytes
        _remove_if_empty(os.path.dirname(table.path))
    return total


def clear(dataset_root: str | None = None) -> int:
    """Delete the user's cached tables (only those of ``dataset_root`` if given; else every table
    and the record of tables found valid); returns bytes freed."""
    tables = cached_tables(dataset_root)
    freed = 0
    for table in tables:
        try:
            os.unlink(table.path)
            freed += table.bytes
        except OSError:
            pass
    for folder in {os.path.dirname(t.path) for t in tables}:
        _remove_if_empty(folder)
    if dataset_root is None:  # every table gone: so is the record of those found valid
        with contextlib.suppress(OSError):
            record = os.path.join(validated_root(), validated.RECORD_NAME)
            freed += os.lstat(record).st_size
            os.unlink(record)
    return freed


def _remove_if_empty(folder: str) -> None:
    """Remove a dataset's cache folder once it holds no table (rmdir fails if a mount saved one meanwhile)."""
    try:
        if not any(name.endswith(_CACHED_SUFFIXES) for name in os.listdir(folder)):
            os.unlink(os.path.join(folder, _SOURCE_FILE))
            os.rmdir(folder)
    except OSError:
        pass


def _share(fd: int, path: str, st: os.stat_result) -> None:
    """Give the table open as ``fd`` (checked, and found valid) :data:`SHARED_FILE_MODE` if it
    has other bits (logged if not allowed): through the descriptor, so never the mode of a file
    a link points at, and only of a file with no other name (a hard link to a private file)."""
    if stat.S_IMODE(st.st_mode) == SHARED_FILE_MODE:
        return
    if st.st_nlink != 1:
        log.warning("%s: not made readable by every user: it has %d names (hard links)", path, st.st_nlink)
        return
    try:
        os.fchmod(fd, SHARED_FILE_MODE)
    except OSError as exc:
        log.warning("%s: cannot make it readable by every user (%s)", path, exc.strerror or exc)


def _stated(fd: int, st: os.stat_result, bound: int, key: dict[str, Any]) -> int:
    """The size of the table open as ``fd`` (``st``: its fstat), once its header is found to
    state exactly that size, at most ``bound``, and to be a table of ``key`` whose sections lie
    within it (:class:`TableError` if not): only the header is read (a sparse file of 2 GiB
    costs 16 bytes). The key and layout are checked here, before the copy: a stale or foreign
    sparse 1 GiB table in a dataset's .atlasfs-tables, its owner's, was copied whole into the
    user's cache (1 GiB written on every mount, other tables evicted) before its key was read."""
    head = os.pread(fd, 16, 0)
    wanted, end = ondisk.stated_size(head)
    if end < 0:
        head += os.pread(fd, wanted - 16, 16)
        wanted, end = ondisk.stated_size(head)
        if end < 0:
            raise TableError("is corrupt (cut short in its header)")
    if end != st.st_size:
        raise TableError(f"is corrupt ({st.st_size} bytes where its header means {end})")
    if end > bound:
        raise TableError(f"is {end} bytes, more than the table cache's bound of {bound} (ATLASFS_TABLE_CACHE_SIZE)")
    ondisk.check_header(head, end, key)
    return end


def _read_stated(fd: int, st: os.stat_result, bound: int) -> bytes:
    """The bytes of the table open as ``fd``, read by the size its header states (:func:`ondisk.read_stated`)."""
    return ondisk.read_stated(lambda offset, count: os.pread(fd, count, offset), st.st_size, bound)


def _copy_into(fd: int, size: int, folder: str, name: str) -> tuple[int, str]:
    """Copy ``size`` bytes of the file open as ``fd`` to ``folder/name``, a megabyte at a time
    (never the whole in memory), replacing it atomically; returns a descriptor of the copy
    (what is mapped: not the path again) and its path."""
    copy = os.path.join(folder, name)
    out, tmp = tempfile.mkstemp(prefix=".copy-", dir=folder)
    try:
        at = 0
        while at < size:
            chunk = os.pread(fd, min(_COPY_CHUNK, size - at), at)
            if not chunk:  # cut short meanwhile: the copy fails its checks
                break
            view = memoryview(chunk)
            while view:
                view = view[os.write(out, view):]
            at += len(chunk)
        os.replace(tmp, copy)
    except BaseException:
        os.close(out)
        _unlink(tmp)
        raise
    return out, copy


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _touch(fd: int) -> None:
    try:
        os.utime(fd)
    except OSError:  # a read-only cache still serves
        pass


def _write_source(folder: str, dataset_root: str) -> None:
    """Record which dataset a cache folder belongs to (for ``atlasfs cache``)."""
    path = os.path.join(folder, _SOURCE_FILE)
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{time.monotonic_ns()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"dataset": dataset_root}, f)
        os.replace(tmp, path)


def _read_source(folder: str) -> str:
    try:
        with open(os.path.join(folder, _SOURCE_FILE)) as f:
            return str(json.load(f)["dataset"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?"
