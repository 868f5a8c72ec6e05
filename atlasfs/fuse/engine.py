"""The control plane of the native engine (``atlasfs.fuse._native``, docs/native.md).

The C extension runs libfuse 3's low-level session on a multi-threaded loop and calls the
:class:`NativeBridge` here, holding the GIL only for that call, for what it does not answer
itself: every request of any :class:`~atlasfs.tree.base.Tree` (the generic path), but the
rows of flat shard folders whose tables are attached and their cached blocks' reads, which C
answers alone (docs/native.md).

The low-level API names files by node id, not path: the bridge keeps, for each node the
kernel holds, its path and how many times it was looked up, and drops it when the kernel
forgets it (FORGET); the root is node 1 for good. Every method answers a value or a negative
errno and never raises: an error becomes the errno the tree said (EIO is logged at debug
level), anything unexpected EIO with a log line.

It is atlasfs's one FUSE engine: :func:`atlasfs.fuse.mount.serve` always mounts through it.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import signal
import stat
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Callable

from atlasfs.blockcache import BlockCache
from atlasfs.fuse.attachments import Attachments
from atlasfs.fuse.signals import stopped_by_signals
from atlasfs.tree.base import Entry, Tree
from atlasfs.tree.table.layout import ROOT, TABLE_NODES, row_ino, shard_ino, split_ino

log = logging.getLogger("atlasfs")

#: What to install when the extension is missing (one line, for ``atlasfs mount``).
INSTALL_HINT = ("the native engine (atlasfs.fuse._native) is not built: install the headers of libfuse 3, zstd and "
                "zlib, pkg-config, gcc and python3-dev (Debian/Ubuntu: apt-get install libfuse3-dev libzstd-dev "
                "zlib1g-dev pkg-config gcc python3-dev), then "
                "reinstall atlasfs (make install, or pip install -e .)")
#: The most of a mount's ``--cache-size`` the tree's block cache (decoded blocks, what fills the
#: byte cache and serves the rest) keeps. The engine's byte cache (what C reads from) holds the
#: whole bound and lends the block cache what it keeps (``Session.lend``, cache.c cache_lend):
#: together they stay within the one bound, C has what Python does not hold, and Python never
#: has less than this share would leave it when C holds the rest (C cannot take back a loan).
TREE_CACHE_SHARE = 0.5
#: A reader whose reads came through this many blocks of a shard in order, this one the last
#: (the tree's ``Blocks.last_block``), is answered the files of its block, to be read in C. A
#: random reader lands on the block after its last one now and then (1 in 16 on a shard of 16
#: blocks), twice running seldom: at 2, 1 random read in 16 of a tiny set paid a whole block.
IN_ORDER_BLOCKS = 3
#: Options libfuse's low-level session takes on its command line; the others libfuse's
#: high-level layer took are answered here (timeouts, uid, gid, umask, threads) or in ``init``.
SESSION_OPTIONS = frozenset({"fsname", "subtype", "ro", "allow_other", "allow_root", "default_permissions", "nosuid",
                             "suid", "nodev", "dev", "noexec", "exec", "max_read", "auto_unmount"})
CONN_OPTIONS = ("max_read", "max_readahead", "max_background", "congestion_threshold")
#: High-level options that mean nothing here: the kernel keeps pages across opens already
#: (OPEN answers ENOSYS), node ids live as long as the kernel holds them.
IGNORED_OPTIONS = frozenset({"kernel_cache", "auto_cache", "noforget", "remember", "use_ino"})
#: Listings under way kept between their requests, the least recently used dropped first
#: (one that is dropped is made again from its next request: the tree's names are cheap).
LISTINGS_KEPT = 256
#: A listing with attributes asks the tree for this many children's entries at a time
#: (about 240 bytes each while the folder is being listed).
KNOWN_WINDOW = 1024
#: Listings that keep their window of entries, the most recently used; the others let it go
#: and ask again if they go on (the windows of all LISTINGS_KEPT would be ~60 MiB).
WINDOWS_KEPT = 8


def native_module() -> Any:
    """``atlasfs.fuse._native``; OSError saying what to install when it is not built."""
    try:
        from atlasfs.fuse import _native
    except ImportError as exc:
        raise OSError(f"{INSTALL_HINT} ({exc})") from None
    return _native


def _engine_gathers() -> bool:
    """Whether the built engine takes a read's reply as a list of pieces."""
    try:
        return bool(getattr(native_module(), "READ_PARTS", False))
    except OSError:
        return False


class _Listing:
    """A folder being listed: its children, whether its attributes are handed out, and the
    known entries of the window of children being listed (a folder may hold millions)."""

    __slots__ = ("children", "path", "plus", "window", "window_start")

    def __init__(self, path: str, children: Sequence[tuple[str, bool, int]]) -> None:
        self.path = path
        self.children = children
        self.plus = False
        self.window: Sequence[Entry | None] = ()
        self.window_start = 0

    def known(self, tree: Tree, i: int) -> Entry | None:
        """Child ``i``'s entry if the tree knows it cheaply (a window of them asked at once)."""
        at = i - self.window_start
        if not 0 <= at < len(self.window):
            self.window_start, at = i, 0
            self.window = tree.known_entries(self.path, i, i + KNOWN_WINDOW)
        return self.window[at] if at < len(self.window) else None

    def forget_window(self) -> None:
        """Let go of the window of entries (asked again by :meth:`known` if needed)."""
        self.window, self.window_start = (), 0


class NativeBridge:
    """The engine's calls, answered from ``tree``. ``on_init`` runs once the kernel connected."""

    def __init__(self, tree: Tree, on_init: Callable[[], None] | None = None) -> None:
        self.tree = tree
        self._on_init = on_init
        self._lock = threading.Lock()
        #: node id -> [path, lookups]; path -> node id. The root is node 1 for good.
        self._nodes: dict[int, list[Any]] = {ROOT: ["/", 1]}
        self._ids: dict[str, int] = {"/": ROOT}
        self._next_id = ROOT + 1
        self._listings: OrderedDict[int, _Listing] = OrderedDict()
        #: The tree whose inode numbers from TABLE_NODES on name shard folders and table rows
        #: (a BlockTree: ``tree`` itself, or the base a view shows at the same paths, its
        #: ``rows``) resolves them; the engine answers those rows from attached tables.
        rows = getattr(tree, "rows", tree)
        self._rows: Any = rows
        self._path_of_ino: Callable[[int], str | None] | None = getattr(rows, "path_of_ino", None)
        self._tables = getattr(rows, "tables", None) if self._path_of_ino is not None else None
        #: Node ids in [TABLE_NODES, _rows_end) are the rows tree's inode numbers (nothing kept
        #: for them); any other inode number (a view's own files) gets a counted node below.
        self._rows_end = shard_ino(len(self._tables.shards)) if self._tables is not None else TABLE_NODES
        self.attachments = Attachments()
        #: A tree's reads in pieces, where the engine gathers them (module.c's READ_PARTS).
        self._read_parts: Callable[[Entry, int, int], list[bytes]] | None = \
            getattr(tree, "read_parts", None) if _engine_gathers() else None
        self.session: Any = None
        #: Set when a callback met SystemExit or KeyboardInterrupt: the loop is asked to end.
        self.critical: BaseException | None = None
        self.on_critical: Callable[[], None] = lambda: None

    @property
    def shard_count(self) -> int:
        """Shards whose tables the engine may be given (0: the tree has no tables)."""
        return len(self._tables.shards) if self._tables is not None else 0

    def connect(self, session: Any) -> None:
        """Serve ``session``: tables are attached to it and released from it, and a callback
        that meets SystemExit or KeyboardInterrupt ends its loop."""
        self.session = session
        if self._tables is not None:
            self._tables.on_release = self.release
        self.on_critical = session.exit

    # -- nodes

    def _path(self, node: int) -> str:
        found = self._nodes.get(node)
        if found is not None:
            return found[0]
        path = self._path_of_ino(node) if TABLE_NODES <= node < self._rows_end and self._path_of_ino else None
        if path is None:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), node)
        return path

    def _node(self, path: str, entry: Entry) -> int:
        """The node id of ``path``: its inode number where that names it (a shard folder or a
        table row of a tree that says so: nothing kept), else a counted node of our own."""
        if TABLE_NODES <= entry.ino < self._rows_end:
            return entry.ino
        return self._register(path)

    def _register(self, path: str) -> int:
        """Count one more lookup of ``path``'s node (made if new); its id."""
        with self._lock:
            node = self._ids.get(path)
            if node is None:
                node = self._next_id
                self._next_id += 1
                self._ids[path] = node
                self._nodes[node] = [path, 1]
            else:
                self._nodes[node][1] += 1
            return node

    def nodes(self) -> int:
        """How many nodes the kernel holds (the root included)."""
        return len(self._nodes)

    # -- the engine's calls: a value, or a negative errno

    def _failed(self, what: str, args: tuple[Any, ...], exc: BaseException) -> int:
        if isinstance(exc, OSError):
            code = exc.errno if exc.errno and exc.errno > 0 else errno.EIO
            if code == errno.EIO:
                log.debug("%s %r: %s", what, args, exc)
            return -code
        if isinstance(exc, Exception):
            log.error("internal error in %s %r", what, args, exc_info=exc)
            return -errno.EIO
        self.critical = exc  # SystemExit, KeyboardInterrupt: stop serving
        self.on_critical()
        return -errno.EIO

    def lookup(self, parent: int, name: bytes) -> tuple[int, bool, int, float, int] | int:
        """``name`` in the folder ``parent``: (node id, is_dir, size, mtime, st_ino)."""
        try:
            folder = self._path(parent)
            path = f"{folder.rstrip('/')}/{name.decode('utf-8')}"
            entry = self.tree.lookup(path)
            if parent >= TABLE_NODES:
                self._attach(parent)
            return self._node(path, entry), entry.is_dir, entry.size, entry.mtime, entry.ino
        except UnicodeDecodeError:  # tree names are UTF-8: such a name cannot be in it
            return -errno.ENOENT
        except BaseException as exc:
            return self._failed("lookup", (parent, name), exc)

    def getattr(self, node: int) -> tuple[bool, int, float, int] | int:
        """(is_dir, size, mtime, st_ino) of ``node``."""
        try:
            entry = self.tree.lookup(self._path(node))
            return entry.is_dir, entry.size, entry.mtime, entry.ino
        except BaseException as exc:
            return self._failed("getattr", (node,), exc)

    def readdir(self, node: int, offset: int, count: int, plus: bool) -> list[tuple[Any, ...]] | int:
        """At most ``count`` entries of the folder ``node`` from ``offset``, each
        (name, is_dir, st_ino, node id or 0, size, mtime, next offset). Offsets: 0 ".",
        1 "..", then child i at i + 2; the kernel asks again from where a reply filled up.
        With ``plus``, the children the tree knows cheaply carry their attributes (and a
        node id: looked up); the engine forgets those it could not fit."""
        try:
            path = self._path(node)
            listing = self._listing(node, path, offset, plus)
            children = listing.children
            out: list[tuple[Any, ...]] = []
            for dot in range(offset, min(2, offset + count)):
                out.append((b"." if dot == 0 else b"..", True, 0, 0, 0, 0.0, dot + 1))
            start = max(offset - 2, 0)
            stop = min(len(children), start + count - len(out))
            prefix = path.rstrip("/")
            for i in range(start, stop):
                name, is_dir, ino = children[i]
                # only READDIRPLUS hands attributes out (and counts a lookup: the engine forgets
                # only those of READDIRPLUS replies it could not fit)
                entry = listing.known(self.tree, i) if plus and listing.plus else None
                if entry is None:
                    out.append((name.encode("utf-8"), is_dir, ino, 0, 0, 0.0, i + 3))
                else:
                    out.append((name.encode("utf-8"), entry.is_dir, entry.ino, self._node(f"{prefix}/{name}", entry),
                                entry.size, entry.mtime, i + 3))
            if node >= TABLE_NODES and self._attach(node):
                with self._lock:  # the engine answers the rest of this listing from the table
                    self._listings.pop(node, None)
            return out
        except BaseException as exc:
            return self._failed("readdir", (node, offset), exc)

    def _listing(self, node: int, path: str, offset: int, plus: bool) -> _Listing:
        """The listing of ``path`` under way: a new one at offset 0 (OPENDIR answers ENOSYS,
        so a listing's first request is what starts it), kept for the requests that follow."""
        with self._lock:
            listing = self._listings.get(node) if offset > 0 else None
            if listing is not None:
                self._listings.move_to_end(node)
                self._forget_old_window()
                return listing
        listing = _Listing(path, self.tree.names(path))  # ENOTDIR for a file
        if plus:
            listing.plus = self._hand_out_attributes(listing)
        with self._lock:
            self._listings[node] = listing
            while len(self._listings) > LISTINGS_KEPT:
                self._listings.popitem(last=False)
            self._forget_old_window()
        return listing

    def _forget_old_window(self) -> None:
        """The listing that just fell out of the :data:`WINDOWS_KEPT` most recently used lets
        its window go. Lock held."""
        if len(self._listings) > WINDOWS_KEPT:
            next(itertools.islice(reversed(self._listings.values()), WINDOWS_KEPT, None)).forget_window()

    def _hand_out_attributes(self, listing: _Listing) -> bool:
        """Whether to hand out the known entries of a folder when the kernel asks for them
        (READDIRPLUS_AUTO: a folder's first reply, and later ones after lookups). A folder
        whose first window knows none is taken to know none yet (a first mount: sizes come
        with lookups)."""
        listing.known(self.tree, 0)  # its first window
        return any(entry is not None for entry in listing.window)

    def read(self, node: int, offset: int, size: int) -> bytes | list[bytes] | int:
        """Up to ``size`` bytes of the file ``node`` from ``offset``: bytes, or a list of bytes
        the engine gathers in order (a tree's ``read_parts``: the tar view's pieces)."""
        try:
            entry = self.tree.lookup(self._path(node))
            if self._read_parts is not None:
                return self._read_parts(entry, offset, size)
            data = self.tree.read(entry, offset, size)
            return data if type(data) is bytes else bytes(data)
        except BaseException as exc:
            return self._failed("read", (node, offset, size), exc)

    def _attach(self, folder: int) -> bool:
        """Attach the table of the shard folder ``folder`` to the engine, if the tree holds it
        and it is flat (:class:`~atlasfs.fuse.attachments.Attachments`): whether the engine
        answers the folder's rows now."""
        s, row = split_ino(folder)
        if self.session is None or self._tables is None or row != -1:
            return False
        table = self._tables.tables.get(s)
        if table is None or not table.flat:
            return False
        if not self.attachments.attached(s, table):
            self.attachments.attach(self.session, s, table, self._rows.lookup(self._path(folder)).mtime,
                                    getattr(self._rows, "native_spans", lambda _: None)(s))
        return self.attachments.attached(s, table)

    def release(self, s: int) -> None:
        """The tree let go of shard position ``s``'s table (:meth:`Attachments.release`)."""
        if self.session is not None:
            self.attachments.release(self.session, s)

    def fill(self, shard: int, row: int, offset: int, size: int) -> tuple[int, Any, bytes] | bytes | int:
        """A read of row ``row`` of an attached table that C did not answer where its bytes lie
        (no locator, a shard in a bucket, a check that failed): the tree serves it its own way
        (its located read, or its block, decoded). A reader going through the shard in order
        is answered the files of the block (:meth:`BlockTree.block_files`), which C keeps for
        the rows that follow; any other reader, only this read's bytes: encoding every file of
        the block for one costs far more than the read (4.4 ms for a block of 128 tiny
        examples, against 0.6 ms to decode it and one example's encoding)."""
        try:
            tree: Any = self._rows  # the rows' own tree: a view shows its files at the same paths
            entry = tree.lookup(self._path(row_ino(shard, row)))
            ref = entry.ref
            if ref is None:
                return -errno.EISDIR
            data = tree.read(entry, offset, size)
            if tree.in_order_run(ref.shard, ref.block) >= IN_ORDER_BLOCKS:
                files = tree.block_files(ref.shard, ref.block)
                if files is not None:
                    return files
            return data if type(data) is bytes else bytes(data)
        except BaseException as exc:
            return self._failed("fill", (shard, row, offset, size), exc)

    def forget(self, pairs: list[tuple[int, int]]) -> None:
        """The kernel dropped ``lookups`` of each node: nodes at 0 are forgotten (not the root)."""
        with self._lock:
            for node, lookups in pairs:
                found = self._nodes.get(node)
                if found is None or node == ROOT:
                    continue
                found[1] -= lookups
                if found[1] <= 0:
                    del self._nodes[node]
                    if self._ids.get(found[0]) == node:
                        del self._ids[found[0]]

    def statfs(self) -> int:
        """Bytes the tree's data occupies (0 if unknown)."""
        try:
            return max(int(self.tree.total_bytes()), 0)
        except Exception:
            log.exception("internal error in statfs")
            return 0

    def init(self) -> None:
        """The kernel connected: the mount exists."""
        try:
            if self._on_init is not None:
                self._on_init()
        except Exception:
            log.exception("internal error in init")


def session_settings(options: dict[str, str | bool | int]) -> tuple[list[str], dict[str, Any]]:
    """The libfuse ``-o`` options of a session and the engine's settings, from libfuse 2 style
    mount options (those :func:`atlasfs.fuse.mount.fuse_options` makes)."""
    passed: list[str] = []
    settings: dict[str, Any] = {"uid": os.getuid(), "gid": os.getgid(),
                                "file_mode": stat.S_IFREG | 0o444, "dir_mode": stat.S_IFDIR | 0o555}
    for key, value in options.items():
        if value is False:
            continue
        if key in ("attr_timeout", "entry_timeout", "negative_timeout"):
            settings[key] = float(value)
        elif key in ("uid", "gid"):
            settings[key] = int(value)
        elif key == "umask":  # as libfuse's: the permissions are 0777 without the mask
            bits = 0o777 & ~int(str(value), 8)
            settings["file_mode"], settings["dir_mode"] = stat.S_IFREG | bits, stat.S_IFDIR | bits
        elif key in ("max_threads", "max_idle_threads"):
            settings[key] = int(value)
        elif key in CONN_OPTIONS:
            settings[key] = int(value)
            if key == "max_read":  # libfuse refuses the connection unless both agree
                passed.append(f"max_read={int(value)}")
        elif key in ("async_read", "sync_read"):
            settings["async_read"] = 1 if key == "async_read" else -1
        elif key in IGNORED_OPTIONS:
            continue
        else:  # the session's own (SESSION_OPTIONS); libfuse refuses others, saying which
            passed.append(key if value is True else f"{key}={value}")
    return passed, settings


class NativeSession:
    """A mount served by the native engine until unmounted or signalled."""

    def __init__(self, bridge: NativeBridge, mountpoint: str, options: dict[str, str | bool | int],
                 threads: bool = True, debug: bool = False, cache_bytes: int = 0,
                 decoded_cache: tuple[str, int, str] | None = None, one_bound: bool = False) -> None:
        native = native_module()
        self.bridge = bridge
        self.mountpoint = mountpoint
        passed, settings = session_settings(options)
        self.args = ["atlasfs"] + (["-d"] if debug else []) + (["-o", ",".join(passed)] if passed else [])
        self.session = native.Session(bridge, threads=threads, shards=bridge.shard_count, cache_bytes=cache_bytes,
                                      **settings)
        if decoded_cache is not None:  # (folder, bound, dataset identity): diskblocks.c
            self.session.decoded_cache(*decoded_cache)
        if one_bound:  # the tree's block cache keeps what the byte cache lends it (cache_bytes is both's)
            for cache in tree_block_caches(bridge.tree):
                cache.borrow_from(self.session)
        bridge.connect(self.session)
        self.stop_signal: int | None = None
        self._stop_lock = threading.Lock()
        self._loop_thread: int | None = None

    def stop(self, signum: int) -> None:
        """Leave the loop, from any thread: the session's exit flag, then the signal again to
        the loop's thread, whose wait only a signal interrupts."""
        with self._stop_lock:
            first = self.stop_signal is None
            if first:
                self.stop_signal = signum
        self.session.exit()
        if first and self._loop_thread is not None:
            signal.pthread_kill(self._loop_thread, signum)

    def run(self) -> None:
        """Mount and serve in the foreground (call it in the main thread); RuntimeError if
        libfuse could not mount (it says why on stderr)."""
        self.session.mount(self.args, self.mountpoint)
        self._loop_thread = threading.get_ident()
        try:
            with stopped_by_signals(self):
                err = self.session.loop()
        finally:
            self.session.unmount()
        stats = self.session.stats()
        frames = self.session.frames()
        log.info("%s: native engine answered %s; zstd dictionaries held: %d; frames decompressed: %d whole, "
                 "%d in part, %d waited for (kept %d bytes of %d stored)", self.mountpoint,
                 ", ".join(f"{kind} {n['c']} in C, {n['python']} in Python" for kind, n in stats.items()),
                 native_module().dictionaries(), frames["whole"], frames["partial"], frames["waited"],
                 frames["kept"], frames["of"])
        cache = self.session.cache()
        log.info("%s: caches: at most %d bytes held of the bound of %d (byte cache and block cache together)",
                 self.mountpoint, cache["peak"], cache["bound"])
        decoded = self.session.decoded()
        if decoded is not None:
            log.info("%s: decoded cache: %d hits, %d misses, %d written, %d failed to write, %d bad, %d evicted, "
                     "%d found at start, %d ignored; %d bytes of %d", self.mountpoint, decoded["hits"],
                     decoded["misses"], decoded["written"], decoded["write_failed"], decoded["bad"],
                     decoded["evicted"], decoded["found"], decoded["ignored"], decoded["bytes"], decoded["bound"])
        if self.bridge.critical is not None:
            raise self.bridge.critical
        if err and self.stop_signal is None:
            log.warning("%s: libfuse's loop ended with status %d", self.mountpoint, err)


def tree_block_caches(tree: Tree) -> list[BlockCache[Any]]:
    """The block caches of ``tree`` and of the tree a view shows (a tar view's ``base``):
    those that borrow from the engine's byte cache."""
    caches: list[BlockCache[Any]] = []
    for candidate in (tree, getattr(tree, "base", None)):
        cache = getattr(candidate, "cache", None)
        if isinstance(cache, BlockCache) and all(cache is not c for c in caches):
            caches.append(cache)
    return caches


def native_main(tree: Tree, mountpoint: str, options: dict[str, str | bool | int], on_init: Callable[[], None],
                threads: bool = True, debug: bool = False, cache_bytes: int = 0,
                decoded_cache: tuple[str, int, str] | None = None, one_bound: bool = False) -> None:
    """Serve ``tree`` at ``mountpoint`` through the native engine until unmounted or
    signalled, its byte cache bounded at ``cache_bytes``; ``decoded_cache``: the decoded-block
    cache's (folder, bound, dataset identity), or None; ``one_bound``: ``cache_bytes`` bounds
    the tree's block caches too, which borrow what they keep from the byte cache."""
    NativeSession(NativeBridge(tree, on_init), mountpoint, options, threads, debug, cache_bytes,
                  decoded_cache, one_bound).run()
