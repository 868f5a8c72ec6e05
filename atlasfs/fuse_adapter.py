"""The FUSE adapter: libfuse's operations, answered from a :class:`~atlasfs.tree.Tree`.

It uses fusepy's ctypes declarations of libfuse 2 (``fuse_operations``,
``c_stat``, the library handle) but not fusepy's ``FUSE`` class. That class
sends every request through generic Python layers (a partial, a wrapper that
looks up the operation by name, a dict of attributes copied into the stat
buffer key by key) which cost more CPU than our whole lookup; for small files
the daemon's CPU per request is what bounds ``tar``. Here each operation is one
ctypes callback that calls the tree and fills libfuse's buffers directly.

Only the operations implemented are registered: each registered but useless
operation (``flush``, ``opendir``, ``access``...) costs a kernel round trip
per file. Every exception becomes an errno here; nothing escapes into C.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import signal
import stat
import threading
from typing import Any, Callable

from .tree import Entry, Tree

log = logging.getLogger("atlasfs")

FILE_MODE = stat.S_IFREG | 0o444
DIR_MODE = stat.S_IFDIR | 0o555
#: Preferred I/O size reported to readers (``st_blksize``).
BLOCK_SIZE = 128 * 1024
#: At most this many libfuse worker threads keep their Python thread state
#: between callbacks (libfuse starts a worker whenever all are busy and ends
#: one when more than ten are idle; each kept state is a few KiB).
KEPT_THREAD_STATES = 64
#: The operations that would change the tree. The mount is read-only, so the
#: kernel refuses them itself; these answer any that get through with EROFS.
_WRITE_OPERATIONS = ("mknod", "mkdir", "unlink", "rmdir", "symlink", "rename", "link", "chmod", "chown",
                     "truncate", "write", "setxattr", "removexattr", "create", "ftruncate", "utimens")


def _path(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:  # tree names are UTF-8: such a path cannot be in it
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT)) from None


class FuseAdapter:
    """libfuse callbacks over ``tree``.

    ``on_init`` runs when the kernel has connected (the mount exists); the
    mount code uses it to find out when the mount is live.
    """

    def __init__(self, tree: Tree, on_init: Callable[[], None] | None = None) -> None:
        import fuse  # fails without libfuse: only mounting needs it

        self.tree = tree
        self._on_init = on_init
        self._fuse = fuse
        self._uid = os.getuid()
        self._gid = os.getgid()
        self._stat_size = ctypes.sizeof(fuse.c_stat)
        self._critical: BaseException | None = None
        self._local = threading.local()
        self._kept = 0  # thread states kept so far

    # -- building the operations table

    def operations(self) -> Any:
        """A ``fuse_operations`` structure whose callbacks call this adapter.

        Keep the returned object alive while libfuse runs: it holds the callbacks.
        """
        fuse = self._fuse
        ops = fuse.fuse_operations()
        prototypes = {name: prototype for name, prototype, *_ in fuse.fuse_operations._fields_}
        handlers: dict[str, Callable[..., int]] = {
            "getattr": self.getattr, "readdir": self.readdir, "open": self.open, "read": self.read,
            "statfs": self.statfs,
        }
        for name in _WRITE_OPERATIONS:
            handlers[name] = _read_only
        for name, handler in handlers.items():
            setattr(ops, name, prototypes[name](self._guard(name, handler)))
        ops.init = prototypes["init"](self._init)
        return ops

    def _guard(self, name: str, handler: Callable[..., int]) -> Callable[..., int]:
        """``handler`` with every exception turned into a negative errno."""
        local = self._local

        def guarded(*args: Any) -> int:
            if not hasattr(local, "kept") and self._kept < KEPT_THREAD_STATES:
                # libfuse's worker threads are not Python threads: ctypes creates a
                # Python thread state for every callback and destroys it after.
                # Taking one more reference once keeps this thread's state for
                # good (about a fifth of the CPU of a small-file tar). A worker
                # that exits leaves its state behind, so only so many are kept.
                local.kept = ctypes.pythonapi.PyGILState_Ensure()
                self._kept += 1
            try:
                return handler(*args)
            except OSError as exc:
                code = exc.errno if exc.errno and exc.errno > 0 else errno.EIO
                if code == errno.EIO:
                    log.debug("%s %r: %s", name, args[:1], exc)
                return -code
            except Exception:
                log.exception("internal error in %s %r", name, args[:1])
                return -errno.EIO
            except BaseException as exc:  # SystemExit, KeyboardInterrupt: stop serving
                self._critical = exc
                self._fuse.fuse_exit()
                return -errno.EIO
        return guarded

    def _init(self, conn: Any) -> None:
        try:
            if self._on_init is not None:
                self._on_init()
        except Exception:
            log.exception("internal error in init")

    # -- operations the kernel sends

    def getattr(self, path: bytes, buf: Any) -> int:
        self._fill_stat(buf, self.tree.lookup(_path(path)))
        return 0

    def _fill_stat(self, buf: Any, entry: Entry) -> None:
        sec, nsec = divmod(int(entry.mtime * 1e9), 1_000_000_000)
        when = self._fuse.c_timespec(sec, nsec)
        st = self._fuse.c_stat(
            st_mode=DIR_MODE if entry.is_dir else FILE_MODE, st_ino=entry.ino,
            st_nlink=1,  # tells find not to count subfolders from nlink
            st_size=entry.size,
            st_blocks=-(-entry.size // 512),  # 0 blocks would look like a sparse hole to tar
            st_blksize=BLOCK_SIZE, st_uid=self._uid, st_gid=self._gid,
            st_atimespec=when, st_mtimespec=when, st_ctimespec=when)
        ctypes.memmove(buf, ctypes.byref(st), self._stat_size)

    def readdir(self, path: bytes, buf: Any, filler: Any, offset: int, fip: Any) -> int:
        # With each entry's type and offset 0, the kernel gets the whole listing
        # in one call and find/ls need no stat per entry. filler copies the
        # stat it is given, so one structure serves every entry.
        # The kernel takes only names, types and inode numbers from a listing:
        # tree.names spares the source from working out sizes.
        children = self.tree.names(_path(path))
        st = self._fuse.c_stat(st_mode=DIR_MODE)
        ref = ctypes.byref(st)
        filler(buf, b".", ref, 0)
        filler(buf, b"..", ref, 0)
        for name, is_dir, ino in children:
            st.st_mode = DIR_MODE if is_dir else FILE_MODE
            st.st_ino = ino
            if filler(buf, name.encode("utf-8"), ref, 0):
                break
        return 0

    def open(self, path: bytes, fip: Any) -> int:
        # ENOSYS tells the kernel (Linux >= 3.16 with FUSE 7.23) that this file system
        # needs no open/release at all: it stops sending them, saving two round
        # trips per file, and keeps file pages cached across opens. The mount is
        # read-only, so the kernel refuses opens for writing before they get here.
        return -errno.ENOSYS

    def read(self, path: bytes, buf: Any, size: int, offset: int, fip: Any) -> int:
        data = self.tree.read(self.tree.lookup(_path(path)), offset, size)
        ctypes.memmove(buf, data, len(data))
        return len(data)

    def statfs(self, path: bytes, buf: Any) -> int:
        total = self.tree.total_bytes()
        st = self._fuse.c_statvfs(f_bsize=4096, f_frsize=4096, f_blocks=-(-total // 4096), f_namemax=255)
        ctypes.memmove(buf, ctypes.byref(st), ctypes.sizeof(st))
        return 0


def _read_only(*_: Any) -> int:
    return -errno.EROFS


def fuse_main(adapter: FuseAdapter, mountpoint: str, options: dict[str, str | bool | int],
              threads: bool = True, debug: bool = False) -> None:
    """Mount and serve in the foreground until unmounted or signalled (libfuse's
    ``fuse_main``: it handles SIGINT, SIGTERM and SIGHUP by leaving its loop)."""
    fuse = adapter._fuse
    opts = ",".join(key if value is True else f"{key}={value}" for key, value in options.items() if value is not False)
    args = ["atlasfs", "-f"] + ([] if threads else ["-s"]) + (["-d"] if debug else []) + ["-o", opts, mountpoint]
    argv = (ctypes.c_char_p * len(args))(*[a.encode("utf-8", "surrogateescape") for a in args])
    ops = adapter.operations()
    # libfuse installs its handlers only over default ones
    old_handler = signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        err = fuse._libfuse.fuse_main_real(len(args), argv, ctypes.pointer(ops), ctypes.sizeof(ops), None)
    finally:
        signal.signal(signal.SIGINT, old_handler)
    if adapter._critical is not None:
        raise adapter._critical
    if err:
        raise RuntimeError(f"libfuse exited with status {err}")
