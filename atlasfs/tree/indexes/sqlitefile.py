"""Where energon's ``index.sqlite`` of a dataset is kept: built once, as a file table is.

The file is named after what it was built from (``energon-<key>.sqlite``, the key a hash of
every tar's layout: names, sizes and offsets) and kept where the dataset's file tables are
(:class:`~atlasfs.tree.table.store.TableStore`): a mount looks in ``--index-dir``, beside the
dataset (``.atlasfs-tables/``, written only by ``atlasfs index``) and in the user's cache,
and builds it into ``--index-dir`` or the user's cache (counted in the cache's bound), never
into the dataset. A stored file is used only if it passes the tables' trust rule (opened
with ``O_NOFOLLOW | O_NONBLOCK``, checked by ``fstat``: a regular file owned by the user,
root or the dataset root's owner, writable by its owner alone) and is an SQLite database
holding energon's tables and indexes; any other is ignored with one log line and built
again. Without a store, or when no folder can take it, it is built into an unnamed
temporary file. It is served through the one descriptor checked (``pread``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
import tempfile
from collections.abc import Callable

from atlasfs.tree.indexes.energon import SCHEMA
from atlasfs.tree.table import ondisk
from atlasfs.tree.table.filetable import TableError
from atlasfs.tree.table.store import SHARED_FILE_MODE, TableStore, _write_source, make_shared_folder

log = logging.getLogger("atlasfs")
PREFIX = "energon-"
SUFFIX = ".sqlite"
_MAGIC = b"SQLite format 3\0"


def file_name(key: str) -> str:
    """The stored file's name for the layouts hashed as ``key``."""
    return f"{PREFIX}{key}{SUFFIX}"


def check(fd: int) -> str | None:
    """Why the file open as ``fd`` is not an energon ``index.sqlite``, or None."""
    if os.pread(fd, len(_MAGIC), 0) != _MAGIC:
        return "is not an SQLite database"
    try:
        db = sqlite3.connect(f"file:/proc/self/fd/{fd}?mode=ro&immutable=1", uri=True)
        try:
            found = tuple(db.execute("SELECT type, name FROM sqlite_master ORDER BY rowid"))
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        return f"cannot be read as SQLite ({exc})"
    if found != SCHEMA:
        return "does not hold energon's tables and indexes"
    return None


def find(store: TableStore, key: str) -> int | None:
    """A descriptor of a stored, usable ``index.sqlite`` built from ``key``, or None."""
    for folder in store.folders:
        if store._store_of(folder).remote:  # noqa: SLF001 (a bucket: built locally instead)
            continue
        path = os.path.join(folder, file_name(key))
        try:
            fd = ondisk.open_table(path)
        except TableError as exc:
            log.info("ignoring %s: it %s; building it again", path, exc)
            continue
        if fd is None:
            continue
        why = store._distrust(os.fstat(fd)) or check(fd)  # noqa: SLF001 (the tables' own rule)
        if why is None:
            return fd
        os.close(fd)
        log.info("ignoring %s: it %s; building it again", path, why)
    return None


def build(store: TableStore | None, key: str, write: Callable[[str], None]) -> tuple[int, str | None]:
    """Build the file with ``write(path)`` into the store's folder for new files (shared
    beside the dataset or in ``--index-dir``, private in the user's cache); returns its
    descriptor and where it was stored (None: an unnamed temporary file)."""
    if store is not None and not store._store_of(store.save_folder).remote:  # noqa: SLF001
        folder = store.save_folder
        shared = folder != store.cache_folder
        try:
            if shared:
                make_shared_folder(folder)
            else:
                os.makedirs(folder, exist_ok=True)
                _write_source(folder, store.dataset_root)
            fd, path = _written(folder, write, SHARED_FILE_MODE if shared else 0o600)
        except OSError as exc:
            log.warning("cannot store energon's index.sqlite in %s (%s): building it in a temporary file",
                        folder, exc.strerror or exc)
        else:
            final = os.path.join(folder, file_name(key))
            # once, before the rename (sqlite's own were turned off): a crash never leaves a torn
            # file under the name, which is found again by its header and schema alone
            with contextlib.suppress(OSError):  # a folder that cannot sync (some FUSE ones) still stores it
                os.fsync(fd)
            os.replace(path, final)
            if shared:
                _forget_others(folder, final)
            else:
                store._keep_cache_bound(final)  # noqa: SLF001
            return fd, final
    fd, path = _written(tempfile.gettempdir(), write, 0o600)
    os.unlink(path)
    return fd, None


def _written(folder: str, write: Callable[[str], None], mode: int) -> tuple[int, str]:
    """A new file in ``folder`` written by ``write``, open; (descriptor, its temporary path)."""
    path = os.path.join(folder, f".energon-{os.getpid()}-{os.urandom(6).hex()}.tmp")
    fd = -1
    try:
        write(path)  # sqlite makes the file (and its journal beside it, gone once committed)
        fd = os.open(path, ondisk.OPEN_FLAGS)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        os.fchmod(fd, mode)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        _unlink(path)
        raise
    return fd, path


def _forget_others(folder: str, keep: str) -> None:
    """Remove the stale ``index.sqlite`` files of older layouts beside the dataset."""
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        if name.startswith(PREFIX) and name.endswith(SUFFIX) and path != keep:
            _unlink(path)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
