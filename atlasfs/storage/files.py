"""A file of a :class:`~atlasfs.storage.Storage` as a Python file object, and a walk of its folders.

Libraries that read files themselves (``indexed_gzip``, pyarrow's parquet reader,
``tarfile``, ``csv``) take a file object: :class:`RangeFile` is one over
:meth:`Storage.pread`, so their reads of a file in a bucket are ranged GETs with the
store's bounds, retries, deadline and disk cache, never a whole-object download.
:meth:`Storage.open` gives it (a local file is opened by the OS, as before); every
format opens its files there rather than with ``open()``.

A library that catches the file object's exceptions and raises its own (``indexed_gzip``'s
``ZranError``) would hide that the store did not answer: :attr:`RangeFile.failure`
keeps the last one, and :func:`store_failure` finds it, so that the format re-raises it
and the read stays transient (EIO), not a property of the data.
"""

from __future__ import annotations

import errno
import io
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from atlasfs.storage import FOLDER_FLAGS

if TYPE_CHECKING:
    from atlasfs.storage import Storage


#: Bytes a ranged :class:`RangeFile` reads in a row before it reads as a sequential pass.
RANGED_RUN = 4 << 20


class RangeFile(io.RawIOBase):
    """File ``path`` of ``storage``, ``size`` bytes, read by :meth:`Storage.pread` at the
    current position (unbuffered: each read is one ``pread``; :meth:`Storage.open` wraps it
    in a buffer of the size the reader wants).

    ``ranged``: each read fetches exactly its range (:meth:`Storage.read_ranges`), never
    taken for a sequential pass. A reader that seeks to a point and reads on from there
    for a while (zran from a seek point, a zstd frame) would otherwise start a store's
    windows (``coalesce_bytes`` each, ``prefetch`` ahead: up to the whole object) for a
    read of a few hundred KiB. Once it has read :data:`RANGED_RUN` bytes in a row it is
    a pass after all (an export reading every block in order) and reads by ``pread``.
    """

    def __init__(self, storage: "Storage", path: str, size: int, ranged: bool = False) -> None:
        super().__init__()
        self.storage, self.name, self.size, self.ranged = storage, path, size, ranged
        self._pos = 0
        self._run = 0  # bytes read in a row, up to the position
        #: The storage error of the last failed read (StorageUnavailableError, StorageChangedError...).
        self.failure: OSError | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self.size}[whence]
        if base + offset < 0:
            raise OSError(errno.EINVAL, f"{self.storage.describe(self.name)}: seek before the start")
        if base + offset != self._pos:
            self._run = 0
        self._pos = base + offset
        return self._pos

    def readinto(self, buffer: Any) -> int:
        want = min(len(buffer), self.size - self._pos)
        if want <= 0:
            return 0
        try:
            if self.ranged and self._run < RANGED_RUN:
                data = self.storage.read_ranges(self.name, [(self._pos, want)])[0]
            else:
                data = self.storage.pread(self.name, self._pos, want)
        except OSError as exc:
            self.failure = exc
            raise
        buffer[:len(data)] = data
        self._pos += len(data)
        self._run += len(data)
        return len(data)

    def readall(self) -> bytes:
        return self.read(max(self.size - self._pos, 0))


def store_failure(file: Any) -> OSError | None:
    """The storage error a :class:`RangeFile` under ``file`` (a buffered reader over one,
    or one itself) last raised, or None (a local file, or no failure)."""
    raw = getattr(file, "raw", file)
    return getattr(raw, "failure", None)


def transient_failure(exc: BaseException, file: Any = None) -> OSError | None:
    """The store's error behind ``exc`` (raised by a library reading ``file``, a
    :meth:`Storage.open` file), or None: a store that did not answer, or an object that
    changed, is no damage of the data; the caller raises it as it is (transient, EIO)."""
    from atlasfs.storage import StorageChangedError, StorageUnavailableError

    for found in (exc, store_failure(file) if file is not None else None, exc.__cause__, exc.__context__):
        if isinstance(found, (StorageUnavailableError, StorageChangedError)):
            return found
    return None


def walk(storage: "Storage", folder: str,
         onerror: Callable[[OSError], None] | None = None) -> Iterator[tuple[str, list[str], list[str]]]:
    """``os.walk`` through ``storage``: ``(folder, sub-folders, files)`` top-down, names
    sorted; the caller may prune the sub-folders in place. A folder that cannot be listed
    goes to ``onerror`` (its ``filename`` set) and is skipped. Local folders are walked as
    ``os.walk`` does (a symbolic link to a folder is listed, not followed: no loop), but on
    descriptors: the top folder opened by :func:`~atlasfs.storage.open_folder` (reached through
    another user's link, or swapped for one after it was looked at: refused), each sub-folder
    opened relative to its parent's descriptor, never following a link."""
    if not storage.remote:
        from atlasfs.storage import open_folder
        try:
            fd = open_folder(folder)
        except OSError as exc:
            if onerror is not None:
                onerror(exc)
            return
        try:
            yield from _walk_descriptor(fd, folder, onerror)
        finally:
            os.close(fd)
        return
    try:
        entries = storage.listdir(folder)
    except OSError as exc:
        if exc.filename is None:
            exc.filename = storage.describe(folder)
        if onerror is not None:
            onerror(exc)
        return
    dirs = sorted(name for name, is_dir in entries if is_dir)
    files = sorted(name for name, is_dir in entries if not is_dir)
    yield folder, dirs, files
    for name in dirs:
        yield from walk(storage, os.path.join(folder, name), onerror)


#: A sub-folder of a local walk: opened as the top folder is (:data:`~atlasfs.storage.FOLDER_FLAGS`),
#: but never through a link (one swapped in since the listing is skipped, as os.walk skips links).
_SUB_FOLDER = FOLDER_FLAGS | os.O_NOFOLLOW


def _walk_descriptor(fd: int, here: str, onerror: Callable[[OSError], None] | None
                     ) -> Iterator[tuple[str, list[str], list[str]]]:
    """:func:`walk` of the local folder open as ``fd``, named ``here``."""
    try:
        with os.scandir(fd) as entries:
            found = [(entry.name, entry.is_dir(), entry.is_symlink()) for entry in entries]
    except OSError as exc:
        exc.filename = here  # os.scandir names the descriptor's number
        if onerror is not None:
            onerror(exc)
        return
    dirs = sorted(name for name, is_dir, _ in found if is_dir)
    files = sorted(name for name, is_dir, _ in found if not is_dir)
    links = {name for name, is_dir, is_link in found if is_dir and is_link}
    yield here, dirs, files
    for name in dirs:  # as the caller left them
        if name in links:
            continue
        try:
            sub = os.open(name, _SUB_FOLDER, dir_fd=fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                continue  # a link or a file now, or gone: as os.walk, nothing to walk
            exc.filename = os.path.join(here, name)
            if onerror is not None:
                onerror(exc)
            continue
        try:
            yield from _walk_descriptor(sub, os.path.join(here, name), onerror)
        finally:
            os.close(sub)


def relative(path: str, base: str) -> str:
    """``path`` relative to the folder ``base`` (``/``-separated), for a local path or a
    URL alike (``os.path.relpath`` would fold a URL's ``//``)."""
    base = base.rstrip("/")
    if path.startswith(base + "/"):
        return path[len(base) + 1:]
    return os.path.relpath(path, base).replace(os.sep, "/")


def listdir_or_empty(storage: "Storage", path: str) -> list[tuple[str, bool]]:
    """``storage.listdir(path)``, or nothing if ``path`` is no folder that can be listed: what a
    format's look at a layout wants. A store that does not answer still raises (transient)."""
    from atlasfs.storage import StorageUnavailableError

    try:
        return storage.listdir(path)
    except StorageUnavailableError:
        raise
    except OSError:
        return []
