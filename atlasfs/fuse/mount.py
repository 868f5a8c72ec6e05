"""Mounting and unmounting: checks, the daemon's life cycle, readiness.

``atlasfs mount`` without ``-f`` forks a daemon and returns only when the
mount answers (exit 0) or has failed (exit 1 with the reason). With ``-f``
it serves in the foreground and tells systemd ``READY=1`` once the mount is
live and ``STOPPING=1`` on the way down. SIGTERM, SIGINT and SIGHUP make
libfuse leave its loop and unmount. Where a background daemon logs, and how the
problems found while mounting reach ``atlasfs mount``'s terminal: :mod:`atlasfs.fuse.daemonlog`.
"""

from __future__ import annotations

import ctypes.util
import errno
import gc
import logging
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from typing import Callable

from atlasfs import memory
from atlasfs.errors import AtlasFormatError
from atlasfs.formats.factory import open_source
from atlasfs.fuse.daemonlog import PROBLEM_PREFIX, StartupReport, file_handler, log_in_background
from atlasfs.fuse.engine import TREE_CACHE_SHARE, native_main, native_module
from atlasfs.fuse.sdnotify import notify
from atlasfs.options import DECODED_CACHE_BYTES, MountOptions
from atlasfs.storage import is_url, redact, set_default_options
from atlasfs.tree.base import Tree
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.indexes.served import LoaderSettings
from atlasfs.tree.table.store import TableStore, cache_folder
from atlasfs.tree.tarview import TarView

log = logging.getLogger("atlasfs")

#: The dataset never changes under a mount, so the kernel may cache
#: attributes, names, misses and pages for as long as it likes.
KERNEL_CACHE_SECONDS = 86400
#: The daemon's cycle-collector thresholds (Python's defaults: 700, 10, 10).
GC_THRESHOLDS = (100_000, 20, 20)
#: How long ``atlasfs mount`` waits for the daemon's mount to answer.
READY_TIMEOUT = 60.0
#: The read-ahead (KiB) the daemon gives its mount. libfuse 3 lets a read request
#: carry 1 MiB (256 pages), but the kernel starts a FUSE mount with 128 KiB of
#: read-ahead and reads through the page cache come in read-ahead sized requests:
#: a big file would take eight round trips per MiB instead of one.
READ_AHEAD_KB = 1024

#: The FUSE device; libfuse and fusermount3 open this very path.
FUSE_DEVICE = "/dev/fuse"


class MountError(Exception):
    """A reason not to mount, for the user (one line)."""


def mounted_filesystems() -> dict[str, str]:
    """Mount point -> file system type, from ``/proc/self/mountinfo``."""
    found = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                before, _, after = line.partition(" - ")
                point = before.split()[4]
                # mountinfo escapes space, tab, newline and backslash as octal
                point = point.encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")
                found[point] = after.split()[0]
    except OSError:
        pass
    return found


def check_mountpoint(mountpoint: str) -> None:
    """Raise :class:`MountError` unless ``mountpoint`` is an empty folder with nothing mounted on it."""
    try:
        # listdir, not just stat: the kernel may answer stat from its cache for a dead mount
        entries = os.listdir(mountpoint) if os.path.isdir(mountpoint) else None
    except FileNotFoundError:
        raise MountError(f"{mountpoint}: mount point does not exist") from None
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            raise MountError(f"{mountpoint}: a dead mount is left here; clear it with: atlasfs umount -z {mountpoint}") from None
        raise MountError(f"{mountpoint}: {exc.strerror}") from None
    fstype = mounted_filesystems().get(mountpoint)
    if fstype is not None and fstype.startswith("fuse"):
        # The native engine lets the kernel keep listings (docs/native.md): a dead mount may
        # still list from that cache, but statfs always asks the daemon.
        try:
            os.statvfs(mountpoint)
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                raise MountError(f"{mountpoint}: a dead mount is left here; clear it with: "
                                 f"atlasfs umount -z {mountpoint}") from None
    if fstype == "fuse.atlasfs":
        raise MountError(f"{mountpoint}: already an atlasfs mount (unmount it first: atlasfs umount {mountpoint})")
    if fstype is not None:
        raise MountError(f"{mountpoint}: already a mount point ({fstype})")
    if entries is None:
        if not os.path.lexists(mountpoint):
            raise MountError(f"{mountpoint}: mount point does not exist")
        raise MountError(f"{mountpoint}: mount point is not a folder")
    if entries:
        raise MountError(f"{mountpoint}: mount point is not empty")


def check_fuse(allow_other: bool) -> None:
    """Raise :class:`MountError` if FUSE cannot be used here, saying what to install or change."""
    # The native engine links libfuse 3: name the library before the extension that needs it.
    if ctypes.util.find_library("fuse3") is None:
        raise MountError("libfuse 3 not found: install it (Debian/Ubuntu: apt-get install fuse3 libfuse3-3)")
    try:
        native_module()
    except OSError as exc:
        raise MountError(str(exc)) from None
    try:
        os.close(os.open(FUSE_DEVICE, os.O_RDWR))
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EPERM):
            raise MountError(f"{FUSE_DEVICE}: permission denied "
                             "(make it 0666, or add the user to the group owning it)") from None
        raise MountError(
            f"{FUSE_DEVICE}: {exc.strerror} (load the fuse kernel module; in a container, pass the device in)") from None
    if os.geteuid() != 0:
        if shutil.which("fusermount3") is None:
            raise MountError("fusermount3 not found: install it (Debian/Ubuntu: apt-get install fuse3)")
        if allow_other and not _user_allow_other():
            raise MountError("allow_other needs 'user_allow_other' in /etc/fuse.conf when not mounting as root")


def _user_allow_other() -> bool:
    try:
        with open("/etc/fuse.conf") as f:
            return any(line.split("#")[0].strip() == "user_allow_other" for line in f)
    except OSError:
        return False


def set_read_ahead(mountpoint: str, kib: int) -> bool:
    """Set the mount's read-ahead (its sysfs ``read_ahead_kb``); False if not allowed
    (only root may, and /sys may be read-only in a container), the kernel's 128 KiB then."""
    dev = os.stat(mountpoint).st_dev
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(kib))
    except OSError as exc:
        log.debug("%s: read-ahead left as it is: %s", path, exc.strerror)
        return False
    return True


def _wait_until_live(mountpoint: str, timeout: float) -> bool:
    """True once ``mountpoint`` is a different file system from its parent (a
    ``stat`` answered by the new mount), False after ``timeout`` seconds."""
    parent_dev = os.stat(os.path.dirname(mountpoint.rstrip("/")) or "/").st_dev
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.stat(mountpoint).st_dev != parent_dev:
                return True
        except OSError:
            pass
        time.sleep(0.005)
    return False


def decoded_cache(dataset_path: str, options: MountOptions) -> tuple[str, int, str] | None:
    """``--decoded-cache``'s folder (made 0700 if missing), its bound and the dataset's identity
    (the name of its folder in the table cache: a hash of its resolved path), for the engine;
    None when off. :class:`MountError` (one line) for a folder that is not the user's own:
    a symbolic link, not a folder, another user's, or writable by others."""
    folder = options.decoded_cache
    if folder is None:
        if options.decoded_cache_bytes is not None:
            raise MountError("decoded_cache_size= bounds decoded_cache=DIR: give the folder too (--decoded-cache DIR)")
        return None
    folder = os.path.abspath(folder)
    what = f"{folder}: the decoded cache folder"
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except FileExistsError:  # a link to nothing, or a file: said below
        pass
    except OSError as exc:
        raise MountError(f"{what} cannot be made ({exc.strerror})") from None
    try:
        st = os.lstat(folder)
    except OSError as exc:
        raise MountError(f"{what}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise MountError(f"{what} is a symbolic link (never followed); give the folder it points to")
    if not stat.S_ISDIR(st.st_mode):
        raise MountError(f"{what} is not a folder")
    if st.st_uid != os.geteuid():
        raise MountError(f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})")
    if st.st_mode & 0o022:
        raise MountError(f"{what} can be written by other users (mode {stat.S_IMODE(st.st_mode):04o}); "
                         f"chmod go-w it, or give another")
    bound = options.decoded_cache_bytes
    if bound is None:
        free = os.statvfs(folder)
        bound = max(1, min(DECODED_CACHE_BYTES, free.f_bavail * free.f_frsize // 4))
    return folder, bound, os.path.basename(cache_folder(dataset_path))


def serve(tree: Tree, mountpoint: str, options: MountOptions, fsname: str,
          on_ready: Callable[[], None], decoded: tuple[str, int, str] | None = None) -> None:
    """Mount ``tree`` at ``mountpoint`` and serve until unmounted or signalled.

    ``on_ready`` runs (in another thread) once the mount answers requests; ``decoded``: the
    decoded cache's folder, bound and dataset identity (:func:`decoded_cache`), or None.
    """
    # A decoded block is thousands of new containers, and the cache keeps many
    # alive: with the default thresholds the cycle collector takes half of a
    # block's decode time. Collecting less often keeps that garbage bounded.
    gc.set_threshold(*GC_THRESHOLDS)
    # glibc gives each libfuse worker its own arena and keeps what a block freed there:
    # two arenas, big buffers mapped and unmapped (docs/performance.md, "Memory").
    memory.configure_allocator()

    def on_init() -> None:
        def watch() -> None:
            if _wait_until_live(mountpoint, READY_TIMEOUT):
                # After the kernel took libfuse's INIT reply, which may only lower it;
                # before anyone opens a file, which keeps the read-ahead of its open.
                wanted = int(options.fuse_options.get("max_readahead", READ_AHEAD_KB * 1024))
                if wanted > 128 * 1024:
                    set_read_ahead(mountpoint, wanted // 1024)
                on_ready()
            else:
                log.error("%s: the mount did not answer within %.0f s", mountpoint, READY_TIMEOUT)
        threading.Thread(target=watch, name="atlasfs-ready", daemon=True).start()

    native_main(tree, mountpoint, fuse_options(options, fsname), on_init, threads=options.threads,
                debug=options.debug, cache_bytes=native_cache_bytes(options), decoded_cache=decoded,
                one_bound=True)


def fuse_options(options: MountOptions, fsname: str) -> dict[str, str | bool | int]:
    """The libfuse options of a mount: atlasfs's own, then those the user passed."""
    fuse_kwargs: dict[str, str | bool | int] = {
        "fsname": fsname.replace(",", "_"),
        "subtype": "atlasfs",
        "ro": True,
        "kernel_cache": True,
        "attr_timeout": KERNEL_CACHE_SECONDS,
        "entry_timeout": KERNEL_CACHE_SECONDS,
        "negative_timeout": KERNEL_CACHE_SECONDS,
        "allow_other": options.allow_other,
        # The loop's idle workers kept: as many as it runs (max_threads, 10 by default).
        "max_idle_threads": 10,
    }
    fuse_kwargs.update(options.fuse_options)
    return fuse_kwargs


def native_cache_bytes(options: MountOptions) -> int:
    """The native engine's byte cache's bound: the whole ``--cache-size``, of which it lends
    the tree's block cache what that keeps (:func:`tree_cache_bytes` at most)."""
    return options.cache_bytes


def tree_cache_bytes(options: MountOptions) -> int:
    """The most of ``--cache-size`` the tree's block cache keeps, borrowed from the byte cache."""
    return int(options.cache_bytes * TREE_CACHE_SHARE)


def open_tree(dataset_path: str, options: MountOptions) -> Tree:
    """Open the dataset for mounting; :class:`MountError` if it is invalid."""
    try:
        source = open_source(dataset_path, options.format, options.source_options())
    except AtlasFormatError as exc:
        raise MountError(str(exc)) from None
    store = TableStore(source.root, index_dir=options.index_dir, storage=source.storage)
    tree = BlockTree(source, cache_bytes=tree_cache_bytes(options), store=store)
    if options.view == "files":
        if options.energon_split is not None or options.energon_dataset is not None:
            raise MountError("energon_split= and energon_dataset= are files of the tar view: add --view tars (or both)")
        return tree
    try:
        loaders = LoaderSettings.from_options(options.energon_split, options.energon_dataset)
    except ValueError as exc:
        raise MountError(str(exc)) from None
    return TarView(tree, folders=options.view == "both", loaders=loaders, store=store)


def mount(dataset_path: str, mountpoint: str, options: MountOptions) -> int:
    """``atlasfs mount``: returns the exit code; :class:`MountError` for a refused mount."""
    if not is_url(dataset_path):  # a bucket's URL stays as it is
        dataset_path = os.path.abspath(dataset_path)
    set_default_options(options.storage)
    mountpoint = os.path.abspath(mountpoint)
    if options.log_file is not None:
        _log_to_file(options.log_file)
    check_mountpoint(mountpoint)
    check_fuse(options.allow_other)
    decoded = decoded_cache(dataset_path, options)
    if options.foreground:
        tree = open_tree(dataset_path, options)
        return _serve_foreground(tree, mountpoint, options, redact(dataset_path), decoded)
    # The daemon's log is routed before the dataset opens: what the opening finds is in it too.
    report = log_in_background(mountpoint, options.log_file)
    mounted = False
    try:
        tree = open_tree(dataset_path, options)
        _serve_background(tree, mountpoint, options, redact(dataset_path), report, decoded)
        mounted = True
    finally:
        report.finish(mounted)
    return 0


def _serve_foreground(tree: Tree, mountpoint: str, options: MountOptions, dataset_path: str,
                      decoded: tuple[str, int, str] | None) -> int:
    def ready() -> None:
        log.info("mounted %s at %s (%s)", dataset_path, mountpoint, options.describe())
        notify("READY=1")

    try:
        serve(tree, mountpoint, options, dataset_path, ready, decoded)
    except RuntimeError:
        raise MountError(f"{mountpoint}: libfuse could not mount (see its message above)") from None
    finally:
        notify("STOPPING=1")
    log.info("unmounted %s", mountpoint)
    return 0


def _serve_background(tree: Tree, mountpoint: str, options: MountOptions, dataset_path: str,
                      report: StartupReport, decoded: tuple[str, int, str] | None) -> int:
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        os.close(write_end)
        message = ""
        with os.fdopen(read_end) as pipe:
            for line in pipe:  # the daemon's problems while it starts, then "ready" or why not
                if not line.startswith(PROBLEM_PREFIX):
                    message = line.strip()
                    break
                report.show(line[len(PROBLEM_PREFIX):].rstrip("\n"))
        if message == "ready":
            return 0
        raise MountError(message or f"{mountpoint}: the mount daemon exited before the mount was ready")
    # The daemon: its own session, no terminal; stderr stays open until ready
    # so that libfuse's own complaints still reach the user.
    os.close(read_end)
    os.setsid()
    os.chdir("/")
    _redirect(0, os.O_RDONLY)
    code = 1
    with os.fdopen(write_end, "w") as pipe:
        report.send_to(pipe)

        def ready() -> None:
            log.info("mounted %s at %s (%s)", dataset_path, mountpoint, options.describe())
            report.stop("ready")
            _redirect(1, os.O_WRONLY)
            _redirect(2, os.O_WRONLY)
        try:
            serve(tree, mountpoint, options, dataset_path, ready, decoded)
            code = 0
        except RuntimeError:
            report.stop(f"{mountpoint}: libfuse could not mount (see its message above)")
        except BaseException as exc:  # the parent must hear about any failure
            report.stop(f"{mountpoint}: {exc}")
    os._exit(code)


def _redirect(fd: int, flags: int) -> None:
    null = os.open(os.devnull, flags)
    os.dup2(null, fd)
    os.close(null)


def _log_to_file(path: str) -> None:
    try:
        handler = file_handler(path)
    except OSError as exc:
        raise MountError(f"{path}: cannot open log file ({exc.strerror})") from None
    logging.getLogger("atlasfs").addHandler(handler)


def unmount(mountpoint: str, lazy: bool = False) -> None:
    """Unmount the atlasfs mount at ``mountpoint``; :class:`MountError` says why not (busy, not
    mounted, not an atlasfs mount: atlasfs never unmounts another file system)."""
    mountpoint = os.path.abspath(mountpoint)
    # The type from the mount table, never a stat: a dead mount answers ENOTCONN and must go too.
    fstype = mounted_filesystems().get(mountpoint)
    if fstype is None:
        if not os.path.lexists(mountpoint):
            raise MountError(f"{mountpoint}: does not exist")
        raise MountError(f"{mountpoint}: not mounted")
    if fstype != "fuse.atlasfs":
        raise MountError(f"{mountpoint}: not an atlasfs mount ({fstype}); atlasfs only unmounts its own")
    if shutil.which("fusermount3"):
        command = ["fusermount3", "-u"] + (["-z"] if lazy else []) + [mountpoint]
    else:
        command = ["umount"] + (["-l"] if lazy else []) + [mountpoint]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        detail = result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "failed"
        if "busy" in detail.lower():
            raise MountError(
                f"{mountpoint}: busy (a program has a file open or its working folder inside); "
                f"close it, or detach now and clean up when it lets go: atlasfs umount -z {mountpoint}")
        raise MountError(f"{mountpoint}: {detail}")
