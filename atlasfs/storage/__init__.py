"""Where a dataset's bytes come from: a local folder or an object store, behind one interface.

The format layer (:mod:`atlasfs.formats.atlas`) reads every file through a
:class:`Storage`, so it never knows whether its bytes are on a local disk or in a
bucket. Paths are strings: OS paths for :class:`LocalStorage`, URLs
(``s3://bucket/prefix/00/data.bin``) for :class:`~atlasfs.storage.remote.RemoteStorage`;
both are joined with ``os.path.join``, which is ``/``-joining on POSIX.

Errors keep the shape the format layer already handles: ``FileNotFoundError``,
``NotADirectoryError`` and other ``OSError`` with a ``strerror``. A local file that is no
regular file (a FIFO, a device: opened without blocking, then refused) or is past the bound
its reader states raises :class:`UnfitFileError`, whose message names it and what it is.
A store that does not answer in time (a cut network, a throttling storm that
outlasts the deadline) raises :class:`StorageUnavailableError`, an ``OSError``
with errno ``EIO`` that callers must treat as *transient*: the same read may work
a second later, so it must not be remembered as a property of the data.

:func:`open_storage` picks the implementation from what the user typed.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import stat
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from atlasfs.sizes import format_size
from atlasfs.storage.links import Approvals, approved

__all__ = [
    "Storage", "LocalStorage", "StorageOptions", "StorageUnavailableError", "StorageChangedError",
    "UnfitFileError", "open_regular", "open_folder", "is_url", "redact", "open_storage", "set_default_options",
    "default_options", "LOCAL",
]

#: ``scheme://`` at the start of a location: what tells a URL from a local path
#: (a local folder may well contain ``:``, but not start with ``letters://``).
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
#: ``user:password@`` (or ``token@``) inside a URL, anywhere in a message.
_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


class StorageUnavailableError(OSError):
    """The store did not answer within the deadline (or answered only with errors
    worth retrying: throttling, 5xx, timeouts). Transient: reads work again once
    the store answers; nothing about the data may be concluded from it."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.EIO, message)

    def __str__(self) -> str:  # the message alone, as the format layer's one-line errors are
        return str(self.strerror)


class StorageChangedError(OSError):
    """An object changed in the store since it was listed (its ETag no longer
    matches): bytes read now could disagree with the index read before."""

    def __init__(self, message: str) -> None:
        super().__init__(errno.ESTALE, message)

    def __str__(self) -> str:
        return str(self.strerror)


class UnfitFileError(OSError):
    """A file atlasfs will not read as it is: not a regular file (a FIFO, a socket, a device,
    a folder), or larger than the bound its reader states. Its message names the file and
    what it is, ``X: not a regular file (a FIFO)``, so that every error path turns it into
    that one line (a shard's, or a block's, EIO in a mount), never a hang or a huge read."""

    def __init__(self, path: str, problem: str, code: int = errno.EINVAL) -> None:
        super().__init__(code, problem, path)

    def __str__(self) -> str:
        return f"{self.filename}: {self.strerror}"


#: What a file is, by its type bits, for :class:`UnfitFileError`'s message.
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a folder", stat.S_IFLNK: "a symbolic link"}

#: How every file of a dataset is opened. O_NONBLOCK: a FIFO standing for a file would hang
#: open() until some writer came (every first look into a shard, in a mount), and with it
#: opens at once so that fstat can refuse it (on a regular file the flag changes nothing).
#: O_NOCTTY: a terminal standing for a file must not become the controlling one. O_CLOEXEC:
#: not inherited by the programs a mount runs. Links are followed (no O_NOFOLLOW): a dataset
#: may be assembled from links (Hugging Face's cache is), and what a link leads to is checked
#: like any file, after the links on the way (:mod:`atlasfs.storage.links`).
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)


def _refuse_unless_regular(path: str, mode: int) -> None:
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a file")
        raise UnfitFileError(path, f"not a regular file ({kind})",
                             errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL)


def refuse_over(path: str, size: int, max_bytes: int, what: str) -> None:
    """:class:`UnfitFileError` if ``size`` (of file ``path``, read as ``what``) passes ``max_bytes``."""
    if size > max_bytes:
        raise UnfitFileError(path, f"{size} bytes, past the bound of {what} ({format_size(max_bytes)}, "
                                   f"{max_bytes} bytes)", errno.EFBIG)


def open_regular(path: str) -> tuple[int, os.stat_result]:
    """A descriptor of the local regular file ``path`` (links followed, by the rule of
    :mod:`.links`) and its ``fstat``, never blocking: anything else raises
    :class:`UnfitFileError` naming it and what it is.

    The file is looked at (``lstat`` of each step, :func:`.links.approved`) before it is
    opened, so that a FIFO, socket or device is never opened at all (opening some devices does
    something: a tape rewinds, a watchdog arms), nor a link followed that its owner could not
    follow; its descriptor is checked again (``fstat``) after: a file swapped in between (for
    another kind, or by a link to another file) is refused all the same.
    ``FileNotFoundError`` and other ``OSError`` as ``os.open`` raises them."""
    looked = approved(path)
    _refuse_unless_regular(path, looked.st_mode)
    return _open_looked(path, looked, OPEN_FLAGS, "read", lambda st: _refuse_unless_regular(path, st.st_mode))


def _open_looked(path: str, looked: os.stat_result, flags: int, doing: str,
                 check: Callable[[os.stat_result], None] = lambda st: None) -> tuple[int, os.stat_result]:
    """``path`` opened with ``flags`` and its ``fstat``, once ``check`` passes on it and it is the
    file ``looked`` (:func:`.links.approved`'s) by device and inode: a link on its way swapped
    in between is refused (``not <doing>``), and the descriptor closed on any failure."""
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        check(st)
        if (st.st_dev, st.st_ino) != (looked.st_dev, looked.st_ino):
            raise UnfitFileError(path, f"replaced while it was opened (a symbolic link on its way changed?); "
                                       f"not {doing}", errno.ESTALE)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


#: How a dataset's folder is opened to be listed: as a file (O_NONBLOCK, O_NOCTTY: never
#: blocking nor acting), and only if it is a folder (O_DIRECTORY).
FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0)


def open_folder(path: str) -> int:
    """A descriptor of the local folder ``path`` (links followed, by the rule of :mod:`.links`),
    to be listed (``os.scandir(fd)``) rather than ``path`` itself: ``path`` is looked at first
    (:func:`.links.approved`), and its descriptor checked to be that same folder (device and
    inode), so that a link swapped in between (to another user's folder) is refused, never
    listed. :class:`UnfitFileError` naming it, ``NotADirectoryError`` for a file, other
    ``OSError`` as ``os.open`` raises them."""
    looked = approved(path)
    if not stat.S_ISDIR(looked.st_mode):
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path)
    return _open_looked(path, looked, FOLDER_FLAGS, "listed")[0]


def is_url(location: str | os.PathLike[str]) -> bool:
    """True if ``location`` names an object store (``s3://...``, ``gs://...``,
    ``https://...``) rather than a local path. ``file://`` counts as a URL too: it
    goes through fsspec's local file system, like any other URL."""
    return isinstance(location, str) and bool(_URL.match(location))


def redact(text: str) -> str:
    """``text`` with the credentials of any URL in it (``https://user:secret@host``)
    replaced by ``***``: what may go into a message, a log line or a path shown."""
    return _USERINFO.sub(r"\g<scheme>***@", text)


@dataclass
class StorageOptions:
    """How a remote store is read (docs/storage.md). Ignored for local folders.

    Attributes:
        endpoint_url: the S3 API's address (MinIO, moto, Ceph...); default from
            ``AWS_ENDPOINT_URL``, else AWS itself.
        disk_cache: a folder to keep raw ranges in between reads and mounts; None: none.
        disk_cache_bytes: the bound of that folder (least recently used go first).
        coalesce_bytes: a sequential reader's GETs cover this many bytes (aligned),
            however small its blocks.
        prefetch: how many such ranges ahead a sequential reader has in flight.
        buffer_bytes: the bound of the in-memory buffer of fetched ranges.
        deadline: seconds a read may wait for the store, retries included, before it
            fails with :class:`StorageUnavailableError` (and the store is taken for down:
            later reads fail sooner until it answers, :mod:`.health`).
        attempt_timeout: seconds one request may take before it is abandoned and retried.
        fs_options: more keyword arguments for the fsspec file system (``anon``,
            ``requester_pays``, ``profile``...). Credentials belong in the
            environment or the AWS config files, never here, so never in ``ps``.
    """

    endpoint_url: str | None = None
    disk_cache: str | None = None
    disk_cache_bytes: int = 4 << 30
    coalesce_bytes: int = 8 << 20
    prefetch: int = 4
    buffer_bytes: int = 64 << 20
    deadline: float = 30.0
    attempt_timeout: float = 10.0
    fs_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.coalesce_bytes < 4096:
            raise ValueError("coalesce_bytes must be at least 4096")
        if self.prefetch < 0:
            raise ValueError("prefetch must be >= 0")
        if self.deadline <= 0 or self.attempt_timeout <= 0:
            raise ValueError("deadline and attempt_timeout must be positive")
        # Every range in flight is held until read: the buffer must hold a window of them.
        self.buffer_bytes = max(self.buffer_bytes, (self.prefetch + 2) * self.coalesce_bytes)


class Storage(ABC):
    """Read-only access to files under some root, local or remote.

    Thread-safe: a mount reads through one storage from many threads.
    """

    #: True for object stores: callers then keep what they derive from the data
    #: (file tables) in the local cache, never beside the data.
    remote: bool = False

    @abstractmethod
    def listdir(self, path: str) -> list[tuple[str, bool]]:
        """``(name, is a folder)`` of each entry of folder ``path``, in no order.
        Raises ``FileNotFoundError`` or ``NotADirectoryError``."""

    @abstractmethod
    def stat(self, path: str) -> tuple[int, int] | None:
        """``(size, mtime_ns)`` of file ``path``, or None if there is no such file."""

    @abstractmethod
    def isdir(self, path: str) -> bool:
        """True if ``path`` is a folder (for a store: a prefix with objects under it)."""

    def isfile(self, path: str) -> bool:
        """True if ``path`` is a file (an object)."""
        return self.stat(path) is not None

    @abstractmethod
    def read(self, path: str, limit: int | None = None) -> bytes:
        """The bytes of file ``path``, or its first ``limit`` bytes."""

    def read_bounded(self, path: str, max_bytes: int, what: str) -> bytes:
        """The whole of file ``path``, which a reader of ``what`` (``"a zstd dictionary"``)
        never takes past ``max_bytes``: a larger one raises :class:`UnfitFileError` naming
        the file and the bound before anything is read (a store's object by its listed size,
        and the bytes read are bounded all the same)."""
        found = self.stat(path)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.describe(path)}: no such file", path)
        refuse_over(self.describe(path), found[0], max_bytes, what)
        data = self.read(path, max_bytes + 1)
        refuse_over(self.describe(path), len(data), max_bytes, what)  # it grew since it was listed
        return data

    def check_file(self, path: str, max_bytes: int | None = None, what: str = "") -> None:
        """Raise as :meth:`read_bounded` would for file ``path``, without reading it:
        ``FileNotFoundError``, or :class:`UnfitFileError` for anything but a regular file
        or one past ``max_bytes`` (a reader opening a dataset checks the files it reads
        later, so that the problem is said at once)."""
        found = self.stat(path)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.describe(path)}: no such file", path)
        if max_bytes is not None:
            refuse_over(self.describe(path), found[0], max_bytes, what)

    @abstractmethod
    def pread(self, path: str, offset: int, size: int) -> bytes:
        """``size`` bytes of file ``path`` from ``offset`` (fewer only at its end)."""

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """The bytes of each ``(offset, size)`` range of file ``path``. A store
        coalesces neighbouring ranges into fewer requests."""
        return [self.pread(path, offset, size) for offset, size in ranges]

    def open(self, path: str, buffer_bytes: int = 64 << 10, ranged: bool = False) -> Any:
        """File ``path`` as a binary file object (read, seek, tell) for libraries that read
        files themselves (``indexed_gzip``, pyarrow, ``tarfile``): reads are ``pread`` of
        ``buffer_bytes`` at least (:class:`~atlasfs.storage.files.RangeFile`), so a reader
        seeking about fetches what it reads, never the whole object. ``ranged``: for a
        random reader, each read one range of its own (no sequential windows).
        ``FileNotFoundError`` if there is no such file."""
        from atlasfs.storage.files import RangeFile

        found = self.stat(path)
        if found is None:
            raise FileNotFoundError(errno.ENOENT, f"{self.describe(path)}: no such file", path)
        return io.BufferedReader(RangeFile(self, path, found[0], ranged), max(buffer_bytes, 1))

    def write(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Store ``data`` as the file ``path``, whole or not at all; ``mode``: its permission
        bits, where files have them (a store's objects do not). Only ``atlasfs index``
        writes, and only file tables beside a dataset; mounts never do."""
        raise PermissionError(errno.EROFS, f"{self.describe(path)}: the store is read-only")

    def close_file(self, path: str) -> None:
        """Forget what is kept open or buffered for ``path`` (reopened on the next read)."""

    def close(self) -> None:
        """Release everything the storage holds."""

    def describe(self, path: str) -> str:
        """How messages name ``path`` (never with credentials)."""
        return redact(path)


class LocalStorage(Storage):
    """The local file system, as the format layer has always read it: ``pread`` on
    a descriptor kept per file, so one read costs one system call. A descriptor let go of
    (``close_file``, ``close``) is closed once no read is using it: its number could
    otherwise be given to another file under a read (a tree's read-ahead thread may still
    be reading a shard that ``export`` is done with).

    Every file is opened by :func:`open_regular` (``open``, ``read``, ``pread``): never
    blocking, links followed by the rule of :mod:`.links`, and only a regular file read; a
    FIFO, socket, device or folder standing for one raises :class:`UnfitFileError`
    (``X: not a regular file (a FIFO)``)."""

    remote = False

    def __init__(self) -> None:
        import threading

        #: path -> [descriptor, reads using it]
        self._fds: dict[str, list[int]] = {}
        self._approvals = Approvals()
        self._lock = threading.Lock()

    def listdir(self, path: str) -> list[tuple[str, bool]]:
        """As :meth:`Storage.listdir`; a folder reached through a link its owner could not
        follow (:mod:`.links`) is not listed (its names are another user's)."""
        fd = open_folder(path)
        try:
            with os.scandir(fd) as entries:
                return [(entry.name, entry.is_dir()) for entry in entries]
        finally:
            os.close(fd)

    def _stat(self, path: str) -> os.stat_result:
        """``os.stat(path)``, if the links on its way may be followed (:mod:`.links`), else
        :class:`UnfitFileError`: a file's size and mtime are not told through another user's
        link either. The rule's walk (an ``lstat`` a component) is done once a file: the path's
        approval is remembered with the file it led to (:class:`.links.Approvals`), so that the
        ``stat`` of every read (a shard's change check) stays one system call."""
        st = os.stat(path)
        self._approvals.check(path, st)
        return st

    def stat(self, path: str) -> tuple[int, int] | None:
        """As :meth:`Storage.stat`, links followed by the rule of :mod:`.links`. A path the
        rule refuses is told as an empty file of mtime 0 (what it leads to is another user's,
        size and time alike): it exists, and whatever reads or checks it
        (:meth:`check_file`, :func:`open_regular`) fails with the refusal, only what needs it."""
        try:
            st = self._stat(path)
        except FileNotFoundError:
            return None
        except UnfitFileError:
            return (0, 0)
        return (st.st_size, st.st_mtime_ns)

    def isdir(self, path: str) -> bool:
        """As :meth:`Storage.isdir`, links followed by the rule of :mod:`.links` (a path it
        refuses is no folder: it is not listed either)."""
        try:
            return stat.S_ISDIR(self._stat(path).st_mode)
        except (OSError, ValueError):
            return False

    def isfile(self, path: str) -> bool:
        """As :meth:`Storage.isfile`: a regular file, links followed by the rule of
        :mod:`.links`; a path it refuses counts as a file, as :meth:`stat` tells it."""
        try:
            return stat.S_ISREG(self._stat(path).st_mode)
        except UnfitFileError:
            return True
        except (OSError, ValueError):
            return False

    def held_stat(self, path: str) -> os.stat_result | None:
        """``fstat`` of the descriptor this storage reads ``path`` through (``pread``), or None
        if it holds none: what is known of the file its reads see, whatever the path names now."""
        with self._lock:  # held: close_file cannot close it meanwhile
            entry = self._fds.get(path)
            return os.fstat(entry[0]) if entry is not None else None

    def open(self, path: str, buffer_bytes: int = 64 << 10, ranged: bool = False) -> Any:
        """The file, opened by the OS (its own buffering; its ``name`` the path, as libraries
        reading it say), if it is a regular file (:func:`open_regular`)."""
        return open(path, "rb", opener=lambda name, _flags: open_regular(name)[0])

    def read(self, path: str, limit: int | None = None) -> bytes:
        fd, _ = open_regular(path)
        with open(fd, "rb") as f:
            return f.read() if limit is None else f.read(limit)

    def read_bounded(self, path: str, max_bytes: int, what: str) -> bytes:
        """As :meth:`Storage.read_bounded`: the size checked on the descriptor read (fstat),
        so the file checked is the file read."""
        fd, st = open_regular(path)
        with open(fd, "rb") as f:
            refuse_over(path, st.st_size, max_bytes, what)
            data = f.read(max_bytes + 1)
        refuse_over(path, len(data), max_bytes, what)  # it grew since the fstat
        return data

    def check_file(self, path: str, max_bytes: int | None = None, what: str = "") -> None:
        """As :meth:`Storage.check_file`, by ``stat`` (links followed by the rule of
        :mod:`.links`); nothing is opened."""
        st = self._stat(path)
        _refuse_unless_regular(path, st.st_mode)
        if max_bytes is not None:
            refuse_over(path, st.st_size, max_bytes, what)

    def _take(self, path: str) -> list[int]:
        """``path``'s descriptor entry, counted as used by one more read."""
        with self._lock:
            entry = self._fds.get(path)
            if entry is None:
                entry = self._fds[path] = [open_regular(path)[0], 0]
            entry[1] += 1
            return entry

    def _give(self, path: str, entry: list[int]) -> None:
        """A read is done with ``entry``: closed if it was let go of meanwhile and no read uses it."""
        with self._lock:
            entry[1] -= 1
            if entry[1] == 0 and self._fds.get(path) is not entry:
                os.close(entry[0])

    def pread(self, path: str, offset: int, size: int) -> bytes:
        entry = self._take(path)
        try:
            return os.pread(entry[0], size, offset)
        finally:
            self._give(path, entry)

    def write(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Written into a temporary file, then renamed into place: whole or nothing. The folder
        is opened without following a link and both steps are done relative to it: a
        ``.atlasfs-tables`` made a link to another folder (by whoever owns the dataset)
        would have ``atlasfs index``, run by root, write there."""
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        try:
            dir_fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(folder):
                raise OSError(errno.ELOOP, "is a symbolic link (never followed)", folder) from None
            raise
        try:
            self._write_in(dir_fd, os.path.basename(path), data, mode)
        finally:
            os.close(dir_fd)

    @staticmethod
    def _write_in(dir_fd: int, name: str, data: bytes, mode: int | None) -> None:
        tmp = f".write-{os.getpid()}-{os.urandom(6).hex()}"
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
        try:
            if mode is not None:  # made 0600; set before the rename, so never seen otherwise
                os.fchmod(fd, mode)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise

    def close_file(self, path: str) -> None:
        with self._lock:
            entry = self._fds.pop(path, None)
            if entry is not None and entry[1] == 0:
                os.close(entry[0])  # else by the last read using it (_give)

    def close(self) -> None:
        with self._lock:
            entries, self._fds = list(self._fds.values()), {}
            for fd, users in entries:
                if users == 0:
                    os.close(fd)


#: The local storage for whole-file reads, shared by the process. A reader that keeps
#: descriptors (``pread``) owns a ``LocalStorage()`` of its own, so that its ``close_file``
#: cannot close a descriptor another reader of the same file is using.
LOCAL = LocalStorage()


def split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    """``(url without credentials, user, password)``: fsspec's HTTP file system takes
    them as an auth object, and the URL shown everywhere must not carry them."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url, None, None
    userinfo, _, host = parts.netloc.rpartition("@")
    user, _, password = userinfo.partition(":")
    clean = urllib.parse.urlunsplit(parts._replace(netloc=host))
    return clean, urllib.parse.unquote(user) or None, urllib.parse.unquote(password) or None


#: What :func:`open_storage` uses when given no options: the command line sets it once
#: (``--endpoint-url``, ``--disk-cache``, ``-o coalesce=``...), so that every command
#: opening a dataset (mount, info, verify, export, index, show) reads a bucket alike.
_defaults = StorageOptions()


def set_default_options(options: StorageOptions) -> None:
    """Make ``options`` those of every store opened without options of its own."""
    global _defaults
    _defaults = options


def default_options() -> StorageOptions:
    return _defaults


def open_storage(location: str | os.PathLike[str],
                 options: StorageOptions | None = None) -> tuple[Storage, str]:
    """The storage for ``location`` and the root path to read through it.

    A local path gives :data:`LOCAL` and the path itself. A URL gives a
    :class:`~atlasfs.storage.remote.RemoteStorage` (fsspec; needs ``atlasfs[s3]``
    for ``s3://``) and the URL without credentials and without a trailing slash.
    """
    if not is_url(location):
        return LOCAL, os.fspath(location)
    from atlasfs.storage.remote import RemoteStorage  # fsspec is optional: imported only for URLs

    storage = RemoteStorage(str(location), options or _defaults)
    return storage, storage.root
