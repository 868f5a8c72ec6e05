"""The fusepy adapter: translates FUSE calls into :class:`~atlasfs.tree.Tree` calls.

It registers only the operations it implements (fusepy registers whatever
attribute the operations object has, and each registered but useless
operation costs a kernel round trip per file). Every exception is turned
into an errno here: fusepy would turn unknown ones into EINVAL.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from typing import Any, Callable

from .tree import Entry, Tree

log = logging.getLogger("atlasfs")

FILE_MODE = stat.S_IFREG | 0o444
DIR_MODE = stat.S_IFDIR | 0o555


class FuseOSError(OSError):
    """An errno for fusepy (the same shape as ``fuse.FuseOSError``, without importing libfuse)."""

    def __init__(self, code: int) -> None:
        super().__init__(code, os.strerror(code))


def _read_only(*_: Any) -> None:
    raise FuseOSError(errno.EROFS)


class FuseAdapter:
    """The operations object handed to ``fuse.FUSE``.

    ``on_init`` runs when the kernel has connected (the mount exists); the
    mount code uses it to find out when the mount is live.
    """

    use_ns = True  # fusepy: times in integer nanoseconds

    def __init__(self, tree: Tree, on_init: Callable[[], None] | None = None) -> None:
        self.tree = tree
        self._on_init = on_init
        self._uid = os.getuid()
        self._gid = os.getgid()

    def __call__(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self, op)(*args)
        except OSError as exc:
            code = exc.errno if exc.errno and exc.errno > 0 else errno.EIO
            if code == errno.EIO:
                log.debug("%s%r: %s", op, args[:1], exc)
            raise FuseOSError(code) from None
        except Exception:
            log.exception("internal error in %s%r", op, args[:1])
            raise FuseOSError(errno.EIO) from None

    def _stat(self, entry: Entry) -> dict[str, int]:
        mtime = int(entry.mtime * 1e9)
        return {
            "st_mode": DIR_MODE if entry.is_dir else FILE_MODE,
            "st_ino": entry.ino,
            "st_nlink": 1,  # tells find not to count subfolders from nlink
            "st_size": entry.size,
            "st_blocks": -(-entry.size // 512),  # 0 blocks would look like a sparse hole to tar
            "st_blksize": 128 * 1024,
            "st_uid": self._uid,
            "st_gid": self._gid,
            "st_mtime": mtime,
            "st_ctime": mtime,
            "st_atime": mtime,
        }

    # -- operations the kernel sends

    def init(self, path: str) -> None:
        if self._on_init is not None:
            self._on_init()

    def getattr(self, path: str, fh: int | None = None) -> dict[str, int]:
        return self._stat(self.tree.lookup(path))

    def readdir(self, path: str, fh: int) -> list[Any]:
        # With each entry's type and offset 0, the kernel gets the whole
        # listing in one call and find/ls need no stat per entry.
        entries: list[Any] = [(".", {"st_mode": DIR_MODE}, 0), ("..", {"st_mode": DIR_MODE}, 0)]
        for name, entry in self.tree.listdir(path):
            entries.append((name, {"st_mode": DIR_MODE if entry.is_dir else FILE_MODE, "st_ino": entry.ino}, 0))
        return entries

    def open(self, path: str, flags: int) -> int:
        # ENOSYS tells the kernel (Linux >= 3.16 with FUSE 7.23) that this file system
        # needs no open/release at all: it stops sending them, saving two round
        # trips per file, and keeps file pages cached across opens. The mount is
        # read-only, so the kernel refuses opens for writing before they get here.
        raise FuseOSError(errno.ENOSYS)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return self.tree.read(self.tree.lookup(path), offset, size)

    def statfs(self, path: str) -> dict[str, int]:
        total = self.tree.total_bytes()
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": -(-total // 4096), "f_bfree": 0,
                "f_bavail": 0, "f_files": 0, "f_ffree": 0, "f_namemax": 255}

    # Everything that would change the tree. The mount is read-only, so the
    # kernel refuses most of these itself; these answer any that get through.
    write = create = mkdir = mknod = unlink = rmdir = symlink = link = rename = _read_only
    chmod = chown = truncate = utimens = setxattr = removexattr = _read_only
