"""The FUSE adapter: libfuse 3's operations, answered from a :class:`~atlasfs.tree.base.Tree`.

It uses mfusepy's ctypes declarations of libfuse 3 (``fuse_operations``,
``c_stat``, ``fuse_conn_info``, ``fuse_config``, the library handle) but not
its ``FUSE`` class. That class sends every request through generic Python
layers (a wrapper that looks up the operation by name, a dict of attributes
copied into the stat buffer key by key) which cost more CPU than our whole
lookup; for small files the daemon's CPU per request is what bounds ``tar``.
Here each operation is one ctypes callback that calls the tree and fills
libfuse's buffers directly.

Only the operations implemented are registered: each registered but useless
operation (``flush``, ``access``...) costs a kernel round trip per file.
(``opendir`` and ``releasedir`` come anyway; they hold a folder's listing.)
Every exception becomes an errno here; nothing escapes into C.

libfuse 2 is not supported: its operations take other arguments, so it would
need a second set of callbacks.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import logging
import os
import signal
import stat
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any, Callable

from atlasfs.fuse.signals import stopped_by_signals
from atlasfs.tree.base import Entry, Tree

log = logging.getLogger("atlasfs")

FILE_MODE = stat.S_IFREG | 0o444
DIR_MODE = stat.S_IFDIR | 0o555
#: Preferred I/O size reported to readers (``st_blksize``).
BLOCK_SIZE = 128 * 1024
#: At most this many libfuse worker threads keep their Python thread state
#: between callbacks (libfuse starts a worker whenever all are busy, up to its
#: limit, and may end idle ones; each kept state is a few KiB).
KEPT_THREAD_STATES = 64
#: The operations that would change the tree. The mount is read-only, so the
#: kernel refuses them itself; these answer any that get through with EROFS.
_WRITE_OPERATIONS = ("mknod", "mkdir", "unlink", "rmdir", "symlink", "rename", "link", "chmod", "chown",
                     "truncate", "write", "setxattr", "removexattr", "create", "utimens")

# From libfuse 3's fuse.h and fuse_common.h (mfusepy does not name them).
#: readdir's flags: the kernel wants attributes with the names (READDIRPLUS).
FUSE_READDIR_PLUS = 1 << 0
#: filler's flags: this entry's stat is complete, hand it to the kernel.
FUSE_FILL_DIR_PLUS = 1 << 1
FUSE_CAP_ASYNC_READ = 1 << 0
FUSE_CAP_READDIRPLUS = 1 << 13
FUSE_CAP_READDIRPLUS_AUTO = 1 << 14

#: A listing with attributes asks the tree for this many children's entries at a time
#: (about 240 bytes each while the folder is open).
KNOWN_WINDOW = 1024
#: libfuse 2 mount options that libfuse 3 no longer takes on its command line
#: but as fields of ``fuse_conn_info`` in ``init``: :func:`fuse_main` moves them there.
CONN_OPTIONS = ("max_readahead", "max_background", "congestion_threshold", "async_read", "sync_read")

#: The libfuse 3 binding, once loaded.
_binding: ModuleType | None = None


def libfuse3() -> ModuleType:
    """mfusepy bound to libfuse 3; ``OSError`` saying what is missing otherwise.

    mfusepy binds libfuse 2 when both are installed unless told otherwise; its
    declarations follow the library it bound, and ours are written for libfuse 3.
    """
    global _binding
    if _binding is None:
        os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
        try:
            import mfusepy
        except (OSError, AttributeError) as exc:  # no library, or one it cannot use
            raise OSError(f"libfuse 3 cannot be loaded ({exc}): install it "
                          f"(Debian/Ubuntu: apt-get install fuse3 libfuse3-3)") from None
        if mfusepy.fuse_version_major != 3:
            raise OSError(f"{mfusepy._libfuse_path} is libfuse {mfusepy.fuse_version_major}, atlasfs needs "
                          f"libfuse 3 (unset FUSE_LIBRARY_PATH/FUSE_LIBRARY_NAME, or point them to libfuse3)")
        _binding = mfusepy
    return _binding


class _OpenFolder:
    """A folder between opendir and releasedir: its listing, whether its attributes are
    handed out (decided at the first READDIRPLUS), and the known entries of the window of
    children being listed (a window, not the whole folder: a folder may hold millions)."""

    __slots__ = ("children", "path", "plus", "window", "window_start")

    def __init__(self, path: str, children: Sequence[tuple[str, bool, int]]) -> None:
        self.path = path
        self.children = children
        self.plus: bool | None = None
        self.window: Sequence[Entry | None] = ()
        self.window_start = 0


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
        fuse = libfuse3()  # fails without libfuse 3: only mounting needs it
        self.tree = tree
        self._on_init = on_init
        self._fuse = fuse
        self._uid = os.getuid()
        self._gid = os.getgid()
        self._critical: BaseException | None = None
        self._local = threading.local()
        self._kept = 0  # thread states kept so far
        #: ``fuse_conn_info`` fields and switches to set in ``init`` (see :func:`fuse_main`).
        self.conn_options: dict[str, str | int | bool] = {}
        #: The signal that stopped the loop, if one did.
        self.stop_signal: int | None = None
        self._stop_lock = threading.Lock()
        self._handle: int | None = None  # libfuse's ``struct fuse``, known from init on
        self._stopped = False
        self._loop_thread: int | None = None  # the thread in fuse_main
        self._open_folders: dict[int, _OpenFolder] = {}
        self._handles = itertools.count(1)

    # -- building the operations table

    def operations(self) -> Any:
        """A ``fuse_operations`` structure whose callbacks call this adapter.

        Keep the returned object alive while libfuse runs: it holds the callbacks.
        """
        fuse = self._fuse
        ops = fuse.fuse_operations()
        prototypes = {name: prototype for name, prototype, *_ in fuse.fuse_operations._fields_}
        handlers: dict[str, Callable[..., int]] = {
            "getattr": self.getattr, "opendir": self.opendir, "readdir": self.readdir,
            "releasedir": self.releasedir, "open": self.open, "read": self.read, "statfs": self.statfs,
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

    def _init(self, conn: Any, config: Any) -> None:
        """libfuse's ``init``: settle the connection, then tell the mount code.

        Returns NULL, which libfuse keeps as the context's ``private_data`` (unused)."""
        with self._stop_lock:
            self._handle = self._fuse._libfuse.fuse_get_context().contents.fuse
            pending = self.stop_signal
        if pending is not None:  # signalled while mounting
            self.stop(pending)
            return
        try:
            self._configure(conn.contents, config.contents)
        except Exception:
            log.exception("internal error in init")
        try:
            if self._on_init is not None:
                self._on_init()
        except Exception:
            log.exception("internal error in init")

    def stop(self, signum: int) -> None:
        """Leave libfuse's loop, from any thread, as libfuse's own signal handler would,
        but so that fuse_main still returns 0. (After its own handler, libfuse 3's
        fuse_main returns 8, as when the connection is lost; libfuse 2's returned 0.)"""
        with self._stop_lock:
            if self.stop_signal is None:
                self.stop_signal = signum
            if self._handle is None or self._stopped:  # init stops it, or it is stopping
                return
            self._stopped = True
        self._fuse._libfuse.fuse_exit(ctypes.c_void_p(self._handle))
        if self._loop_thread is not None:
            # The loop notices only when its wait is interrupted: by a signal.
            signal.pthread_kill(self._loop_thread, signum)

    def _configure(self, conn: Any, config: Any) -> None:
        # Inode numbers are the tree's: stat, listings and find agree across
        # mounts. (libfuse 3 takes use_ino here only, not as a mount option.)
        config.use_ino = 1
        # READDIRPLUS_AUTO: the kernel asks for attributes with the names on a
        # folder's first listing request, and on later ones only if the files
        # listed were looked up meanwhile. Asked for with every name, attributes
        # cost the kernel an inode and libfuse a node (~200 bytes of ours) for every
        # file listed, which `find` never uses: over 1,000,000 files it took 3x as long
        # and 170 MiB more (docs/performance.md, "Listings"). `ls -l` of a big folder
        # then LOOKUPs most files one by one instead (3x as long).
        if conn.capable & FUSE_CAP_READDIRPLUS:
            conn.want |= FUSE_CAP_READDIRPLUS | FUSE_CAP_READDIRPLUS_AUTO
        options = self.conn_options
        if "max_read" in options:  # libfuse refuses the connection unless this matches the mount option
            conn.max_read = int(options["max_read"])
        for name in ("max_readahead", "max_background", "congestion_threshold"):
            if name in options:
                setattr(conn, name, int(options[name]))
        if options.get("sync_read"):
            conn.want &= ~FUSE_CAP_ASYNC_READ
        elif options.get("async_read") and conn.capable & FUSE_CAP_ASYNC_READ:
            conn.want |= FUSE_CAP_ASYNC_READ

    # -- operations the kernel sends

    def getattr(self, path: bytes, buf: Any, fip: Any) -> int:
        entry = self.tree.lookup(_path(path))
        self._fill(buf.contents, entry)  # libfuse zeroed it
        return 0

    def _fill(self, st: Any, entry: Entry) -> None:
        """Set ``st``, a ``c_stat`` libfuse zeroed or one filled before, to ``entry``.

        Field by field in place: four times faster than building a structure to copy."""
        st.st_mode = DIR_MODE if entry.is_dir else FILE_MODE
        st.st_ino = entry.ino
        st.st_nlink = 1  # tells find not to count subfolders from nlink
        size = entry.size
        st.st_size = size
        st.st_blocks = -(-size // 512)  # 0 blocks would look like a sparse hole to tar
        st.st_blksize = BLOCK_SIZE
        st.st_uid = self._uid
        st.st_gid = self._gid
        sec, nsec = divmod(int(entry.mtime * 1e9), 1_000_000_000)
        for when in (st.st_atimespec, st.st_mtimespec, st.st_ctimespec):
            when.tv_sec = sec
            when.tv_nsec = nsec

    def opendir(self, path: bytes, fip: Any) -> int:
        # The listing is taken once per open folder and kept until releasedir: the
        # kernel reads a long listing in several replies, each a readdir call, and a
        # source's names() or known_entries() may cost a pass over the whole folder.
        tree_path = _path(path)
        folder = _OpenFolder(tree_path, self.tree.names(tree_path))  # ENOTDIR for a file
        handle = next(self._handles)
        self._open_folders[handle] = folder
        fip.contents.fh = handle
        return 0

    def releasedir(self, path: bytes, fip: Any) -> int:
        self._open_folders.pop(fip.contents.fh, None)
        return 0

    def readdir(self, path: bytes, buf: Any, filler: Any, offset: int, fip: Any, flags: int) -> int:
        # Entries are given with their offsets (position + 1), and the kernel asks
        # again from where a reply filled up. (Given with offset 0, libfuse 3.14
        # keeps the whole listing and replies from it, but then drops the
        # attributes of READDIRPLUS entries: every file would be LOOKUPed.)
        # Types and inode numbers come with every entry, so find needs no stat.
        # Without READDIRPLUS the kernel takes nothing else, and tree.names spares
        # the source from working out sizes. With it, files whose entries the
        # tree knows cheaply get their attributes here, the others are looked up
        # later; attributes go out only when the kernel asks (see _configure). filler copies the
        # stat it is given (and without the PLUS flag reads only type and inode
        # number), so one structure serves every entry.
        folder = self._open_folders.get(fip.contents.fh) if fip else None
        if folder is None:  # not opened through opendir
            tree_path = _path(path)
            folder = _OpenFolder(tree_path, self.tree.names(tree_path))
        children = folder.children
        plus = False
        if flags & FUSE_READDIR_PLUS:
            if folder.plus is None:
                folder.plus = self._hand_out_attributes(folder)
            plus = folder.plus
        st = self._fuse.c_stat(st_mode=DIR_MODE)
        ref = ctypes.byref(st)
        if offset < 1 and filler(buf, b".", ref, 1, 0):
            return 0
        if offset < 2 and filler(buf, b"..", ref, 2, 0):
            return 0
        filled = None  # (is_dir, mtime) of the entry st holds in full: the next such one sets 3 fields
        for i in range(max(offset - 2, 0), len(children)):
            entry = None
            if plus:
                at = i - folder.window_start
                if not 0 <= at < len(folder.window):
                    folder.window_start, at = i, 0
                    folder.window = self.tree.known_entries(folder.path, i, i + KNOWN_WINDOW)
                entry = folder.window[at]
            if entry is None:
                name, is_dir, ino = children[i]
                st.st_mode = DIR_MODE if is_dir else FILE_MODE
                st.st_ino = ino
                fill_flags = 0
                filled = None
            else:
                name = children[i][0]
                # The files of a folder share all but inode number and size: a fifth of a big
                # folder's listing went to setting the same ctypes fields again.
                if filled is not None and filled[0] == entry.is_dir and filled[1] == entry.mtime:
                    st.st_ino = entry.ino
                    st.st_size = entry.size
                    st.st_blocks = -(-entry.size // 512)
                else:
                    self._fill(st, entry)
                    filled = (entry.is_dir, entry.mtime)
                fill_flags = FUSE_FILL_DIR_PLUS
            if filler(buf, name.encode("utf-8"), ref, i + 3, fill_flags):
                return 0
        return 0

    def _hand_out_attributes(self, folder: _OpenFolder) -> bool:
        """Whether to hand out the known entries of ``folder`` when the kernel asks for them
        (READDIRPLUS: on a folder's first reply, and on later ones when the files listed
        were looked up meanwhile, as ``ls -l`` does). A folder whose first window knows none
        is taken to know none yet (a first mount: sizes come with lookups)."""
        folder.window_start = 0
        folder.window = self.tree.known_entries(folder.path, 0, KNOWN_WINDOW)
        return any(entry is not None for entry in folder.window)

    def open(self, path: bytes, fip: Any) -> int:
        # ENOSYS tells the kernel (Linux >= 3.16 with FUSE 7.23) that this file system
        # needs no open/release at all: it stops sending them, saving two round
        # trips per file, and keeps file pages cached across opens. libfuse 3's
        # high-level layer passes the error on as it is. The mount is read-only,
        # so the kernel refuses opens for writing before they get here.
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
    """Mount and serve in the foreground until unmounted or signalled (SIGINT, SIGTERM
    or SIGHUP: the mount is detached and this returns). Call it in the main thread.

    ``options`` are libfuse 2 style mount options; those libfuse 3 takes in
    ``init`` instead (:data:`CONN_OPTIONS`, and ``max_read`` in both places) are
    handed to the adapter."""
    fuse = adapter._fuse
    command_line = {key: value for key, value in options.items() if key not in CONN_OPTIONS}
    adapter.conn_options = {key: value for key, value in options.items()
                            if (key in CONN_OPTIONS or key == "max_read") and value is not False}
    opts = ",".join(key if value is True else f"{key}={value}"
                    for key, value in command_line.items() if value is not False)
    args = ["atlasfs", "-f"] + ([] if threads else ["-s"]) + (["-d"] if debug else []) + ["-o", opts, mountpoint]
    argv = (ctypes.c_char_p * len(args))(*[a.encode("utf-8", "surrogateescape") for a in args])
    ops = adapter.operations()
    # Python's handlers, not libfuse's (atlasfs.fuse.signals), while this thread is in libfuse.
    adapter._loop_thread = threading.get_ident()
    with stopped_by_signals(adapter):
        err = fuse.fuse_main_real(len(args), argv, ctypes.pointer(ops), ctypes.sizeof(ops), None)
    if adapter._critical is not None:
        raise adapter._critical
    if err:
        raise RuntimeError(f"libfuse exited with status {err}")
