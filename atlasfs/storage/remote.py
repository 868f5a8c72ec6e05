"""Reading a dataset from an object store through fsspec (s3fs for ``s3://``).

The read path (docs/storage.md):

* **Listing** once: the first look under the root lists every object below it in one
  recursive listing (paginated), and sizes, mtimes and ETags come from there, so
  opening a dataset of N shards costs a few requests, not 4N HEADs.
* **Random reads** (a block somewhere) are one ranged GET of exactly that block,
  its bounds taken from the shard's index.
* **Sequential readers** (:mod:`.windows`; a read that starts at the start of the object or where a
  recent read of it ended) switch that object to *windows*: aligned ranges of
  ``coalesce_bytes``, so a run of small blocks costs one GET per window, not one per
  block, and the next ``prefetch`` windows are fetched in parallel while the reader
  decodes. A sequential pass over an object of S bytes costs ceil(S / window) GETs,
  plus the random reads made before the pass was recognised.
* **The buffer**: fetched windows (and windows in flight) are kept in memory up to
  ``buffer_bytes``, least recently used going first; a failed fetch is dropped
  from it at once, so the next read asks again.
* **The disk cache** (optional, :mod:`.diskcache`): every fetched range is kept
  there, and looked up before any GET.
* **Retries** (:mod:`.requests`, :mod:`.errors`): a request that times out (``attempt_timeout``), is refused,
  reset, throttled (429, SlowDown) or answered with a 5xx is retried with
  exponential backoff and jitter until ``deadline`` seconds have passed since the
  read began; then the read fails with :class:`StorageUnavailableError`
  (EIO through the mount). Missing objects and refused access are not retried.
* **Fail fast while down** (:mod:`.health`): a request that runs out its deadline
  marks the store down; then requests fail at once for a second after each one that
  found it silent, and ask it with a short deadline otherwise, so that a user's read
  (often several requests) ends within about one deadline. Any answer ends it:
  reads work again by themselves when the store answers, with no remount, and
  nothing about the data is remembered.
* **Changes**: S3 reads are conditional on the ETag seen in the listing
  (``If-Match``), so an object rewritten under a mount fails with
  :class:`StorageChangedError` instead of mixing old index and new data.

This module keeps the file system (made again after a fork), the listing and the
reads; the others do one job each. Every request runs on fsspec's event loop thread
under ``asyncio.wait_for`` (:mod:`.requests`), so a request that hangs (a network
that drops packets silently) is abandoned at its timeout, never waited on forever.
s3fs's and botocore's own retries are turned off: one loop, with one deadline, decides.

Credentials are botocore's usual chain (environment, ``~/.aws``, instance
roles); nothing here logs or formats them, and URLs carrying ``user:password@``
are shown redacted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as _dt
import errno
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from atlasfs.storage import (
    Storage,
    StorageOptions,
    redact,
    split_userinfo,
)
from atlasfs.storage.diskcache import DiskCache
from atlasfs.storage.requests import RequestRunner
from atlasfs.storage.windows import Windows


@dataclass(frozen=True)
class _Object:
    """What the listing says of one object."""

    size: int
    mtime_ns: int
    etag: str | None


#: Stands for an object listed without its size, until it is asked for.
_UNKNOWN = _Object(-1, 0, None)


def _mtime_ns(info: dict[str, Any]) -> int:
    """An object's modification time from an fsspec ``info`` dict, whatever the backend
    calls it (S3: ``LastModified``, GCS: ``updated``, local: ``mtime``); 0 if none."""
    for key in ("LastModified", "last_modified", "mtime", "updated", "modified", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, _dt.datetime):
            return int(value.timestamp() * 1e9)
        if isinstance(value, (int, float)):
            return int(value * 1e9)
        if isinstance(value, str):
            try:
                return int(_dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp() * 1e9)
            except ValueError:
                continue
    return 0


def _etag(info: dict[str, Any]) -> str | None:
    value = info.get("ETag") or info.get("etag")
    return str(value) if value else None


def _warm_up(ref: "weakref.ReferenceType[_FileSystem]") -> None:
    """In a forked child: make the file system and its client on a thread of its own."""
    filesystem = ref()
    if filesystem is None or filesystem._fs_obj is None:
        return

    def make() -> None:
        try:
            fs = filesystem.get()
            if hasattr(fs, "set_session"):
                asyncio.run_coroutine_threadsafe(fs.set_session(), fs.loop).result(filesystem.options.deadline)
        except Exception:  # noqa: BLE001 - the first read makes it again, and reports
            pass

    threading.Thread(target=make, daemon=True, name="atlasfs-storage-warm-up").start()


class _FileSystem:
    """The fsspec file system of the store under ``root`` (a URL without credentials;
    ``auth``: those taken out of it), made on first use and again after a fork: a
    mount opens the dataset, then forks into the background."""

    def __init__(self, root: str, auth: tuple[str, str | None] | None, options: StorageOptions) -> None:
        self.root = root
        self.protocol = root.split("://", 1)[0].lower()
        self.options = options
        self._auth = auth
        self._fs_obj: Any = None
        self._fs_pid = -1
        self._fs_lock = threading.Lock()
        self._fs_root = ""
        if hasattr(os, "register_at_fork"):
            try:  # first: fsspec's own after-fork reset of its loop must run before this one
                import fsspec.asyn  # noqa: F401
            except ImportError:
                pass
            # The child makes its own client at once, not on the first read (it costs a
            # few hundred ms).
            me = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _warm_up(me))

    def get(self) -> Any:
        """The file system, made on first use and again in a forked child."""
        with self._fs_lock:
            if self._fs_obj is None or self._fs_pid != os.getpid():
                self._fs_obj = self._make()
                self._fs_pid = os.getpid()
                self._fs_root = self._fs_obj._strip_protocol(self.root).rstrip("/")
            return self._fs_obj

    def _make(self) -> Any:
        try:
            import fsspec
        except ImportError:
            raise OSError(errno.ENOTSUP, f"{self.root}: reading from object storage needs fsspec: "
                                          f"pip install 'atlasfs[s3]'") from None
        opts: dict[str, Any] = dict(self.options.fs_options)
        timeout = self.options.attempt_timeout
        if self.protocol in ("s3", "s3a"):
            try:
                import s3fs  # noqa: F401
            except ImportError:
                raise OSError(errno.ENOTSUP, f"{self.root}: reading s3:// needs s3fs: "
                                              f"pip install 'atlasfs[s3]'") from None
            endpoint = self.options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
            if endpoint:
                opts.setdefault("endpoint_url", endpoint)
            # One retry loop, ours, with one deadline: s3fs's (5 tries) and botocore's
            # (its own backoff) would each multiply the time a dead store takes to fail.
            config = dict(opts.pop("config_kwargs", {}) or {})
            config.setdefault("retries", {"total_max_attempts": 1, "mode": "standard"})
            config.setdefault("connect_timeout", min(timeout, 5.0))
            config.setdefault("read_timeout", timeout)
            opts["config_kwargs"] = config
        elif self.protocol in ("http", "https") and self._auth:
            import aiohttp

            opts.setdefault("client_kwargs", {})["auth"] = aiohttp.BasicAuth(self._auth[0], self._auth[1] or "")
        opts["skip_instance_cache"] = True  # never share one with other code, nor across a fork
        try:
            fs = fsspec.filesystem(self.protocol, **opts)
        except (ImportError, ValueError) as exc:
            raise OSError(errno.ENOTSUP, f"{self.root}: cannot open this kind of URL ({exc})") from None
        if hasattr(fs, "retries"):  # s3fs: a class attribute, not a constructor argument
            fs.retries = 1
        if not getattr(fs, "async_impl", False):
            from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

            fs = AsyncFileSystemWrapper(fs, asynchronous=False)
        return fs

    def path(self, rel: str) -> str:
        """The file system's path of ``rel`` (relative to the root; "" for the root)."""
        self.get()
        return f"{self._fs_root}/{rel}" if rel else self._fs_root


class RemoteStorage(Storage):
    """A dataset under ``url`` in an object store, read through fsspec.

    ``root`` is the URL as messages show it (credentials removed, no trailing
    ``/``); paths given to the methods are under it. Statistics for tests and the
    bench: :attr:`requests` counts GETs sent (each attempt), :attr:`retries` the
    attempts that failed and were retried.
    """

    remote = True

    def __init__(self, url: str, options: StorageOptions) -> None:
        self.options = options
        clean, user, password = split_userinfo(url.rstrip("/"))
        self.root = clean
        self._fs = _FileSystem(clean, (user, password) if user else None, options)
        self.protocol = self._fs.protocol
        # The listing: relative path -> object, and the set of folders (relative, "" = root).
        self._objects: dict[str, _Object] = {}
        self._folders: set[str] = set()
        self._listed = False
        self._list_lock = threading.Lock()
        self.disk = DiskCache(options.disk_cache, options.disk_cache_bytes) if options.disk_cache else None
        self.requests = 0
        self.bytes_fetched = 0
        fs = self._fs  # not self: the storage goes with its last reference
        self._runner = RequestRunner(self.root, options, lambda: fs.get().loop)
        self.health = self._runner.health
        self.windows = Windows(options, self._runner.wait)

    @property
    def retries(self) -> int:
        """Attempts that failed and were retried (for tests and the bench)."""
        return self._runner.retries

    # -- paths

    def _rel(self, path: str) -> str:
        """``path`` relative to the root ("" for the root itself)."""
        path = path.rstrip("/")
        if path == self.root:
            return ""
        if not path.startswith(self.root + "/"):
            raise FileNotFoundError(errno.ENOENT, f"{redact(path)} is not under {self.root}")
        return path[len(self.root) + 1:]

    def describe(self, path: str) -> str:
        return redact(path)

    # -- the listing

    def _list(self) -> None:
        """List everything under the root once (one paginated request on S3)."""
        if self._listed:
            return
        with self._list_lock:
            if self._listed:
                return
            fs = self._fs.get()
            base = self._fs.path("")

            async def find() -> dict[str, Any]:
                return await fs._find(base, withdirs=True, detail=True)

            found = self._runner.run(find, self.root)
            objects: dict[str, _Object] = {}
            folders: set[str] = {""}
            for name, info in found.items():
                name = name.rstrip("/")
                if name == base or not name.startswith(base + "/"):
                    continue
                rel = name[len(base) + 1:]
                if info.get("type") == "directory":
                    folders.add(rel)
                elif info.get("size") is None:  # an HTTP index page gives names, not sizes
                    objects[rel] = _UNKNOWN
                else:
                    objects[rel] = _Object(int(info["size"]), _mtime_ns(info), _etag(info))
                parts = rel.split("/")
                folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
            if not objects and not found:
                raise FileNotFoundError(errno.ENOENT, f"{self.root}: no such dataset folder")
            self._objects, self._folders, self._listed = objects, folders, True

    def listdir(self, path: str) -> list[tuple[str, bool]]:
        rel = self._rel(path)
        self._list()
        if rel in self._objects:
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        if rel not in self._folders:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
        prefix = rel + "/" if rel else ""
        entries: dict[str, bool] = {}
        for name in self._objects:
            if name.startswith(prefix) and "/" not in name[len(prefix):]:
                entries[name[len(prefix):]] = False
        for name in self._folders:
            if name and name.startswith(prefix) and "/" not in name[len(prefix):]:
                entries[name[len(prefix):]] = True
        return list(entries.items())

    def _object(self, path: str) -> _Object | None:
        rel = self._rel(path)
        self._list()
        obj = self._objects.get(rel)
        if obj is _UNKNOWN:  # listed without a size: ask for it (a HEAD), once
            fs = self._fs.get()
            fs_path = self._fs.path(rel)

            async def info() -> dict[str, Any]:
                return await fs._info(fs_path)

            found = self._runner.run(info, self._display(rel))
            if found.get("size") is None:
                raise OSError(errno.EIO, "the store tells no size for this object")
            obj = self._objects[rel] = _Object(int(found["size"]), _mtime_ns(found), _etag(found))
        return obj

    def stat(self, path: str) -> tuple[int, int] | None:
        obj = self._object(path)
        return None if obj is None else (obj.size, obj.mtime_ns)

    def isdir(self, path: str) -> bool:
        try:
            rel = self._rel(path)
            self._list()
        except FileNotFoundError:
            return False
        return rel in self._folders

    def etag(self, path: str) -> str | None:
        """The object's ETag as listed (what stored file tables may key on)."""
        obj = self._object(path)
        return obj.etag if obj else None

    # -- reading

    def _identity(self, rel: str, obj: _Object) -> str:
        return DiskCache.identity(f"{self.root}/{rel}", obj.size, obj.mtime_ns, obj.etag)

    def _fetch(self, rel: str, obj: _Object, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of an object: from the disk cache, else one ranged GET."""
        future, until = self._start_fetch(rel, obj, start, end)
        return self._runner.wait(future, self._display(rel), until)

    def _start_fetch(self, rel: str, obj: _Object, start: int,
                     end: int) -> tuple[concurrent.futures.Future[bytes], float]:
        """:meth:`_fetch` started: the future of its bytes and when it is due."""
        return self._runner.start(self._fetch_coro(rel, obj, start, end), self._display(rel),
                                  self._disk_lookup(rel, obj, start, end))

    def _disk_lookup(self, rel: str, obj: _Object, start: int,
                     end: int) -> Callable[[], Awaitable[bytes | None]] | None:
        """``[start, end)`` from the disk cache (None if not there); None without one."""
        disk = self.disk
        if disk is None:
            return None
        identity = self._identity(rel, obj)

        async def lookup() -> bytes | None:  # file I/O off the loop: other requests go on meanwhile
            return await asyncio.to_thread(disk.get, identity, start, end - start)

        return lookup

    def _fetch_coro(self, rel: str, obj: _Object, start: int, end: int) -> Callable[[], Awaitable[bytes]]:
        """A factory of one attempt at fetching ``[start, end)`` from the store (kept in
        the disk cache, if any)."""
        fs = self._fs.get()
        fs_path = self._fs.path(rel)
        identity = self._identity(rel, obj) if self.disk else ""
        s3 = self.protocol in ("s3", "s3a")

        async def attempt() -> bytes:
            self.requests += 1
            if s3:
                bucket, key, _ = fs.split_path(fs_path)
                kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key, "Range": f"bytes={start}-{end - 1}"}
                if obj.etag:
                    kwargs["IfMatch"] = obj.etag
                resp = await fs._call_s3("get_object", **kwargs)
                try:
                    data = await resp["Body"].read()
                finally:
                    resp["Body"].close()
            else:
                data = await fs._cat_file(fs_path, start=start, end=end)
            if len(data) == obj.size != end - start:  # a server that ignores Range sent it all
                data = data[start:end]
            if len(data) != end - start:
                raise OSError(errno.EIO, f"short read: {len(data)} of {end - start} bytes at {start}")
            self.bytes_fetched += len(data)
            if self.disk is not None:
                await asyncio.to_thread(self.disk.put, identity, start, data)
            return data

        return attempt

    def _display(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def read(self, path: str, limit: int | None = None) -> bytes:
        obj = self._object(path)
        if obj is None:
            if self._rel(path) in self._folders:
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR))
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
        end = obj.size if limit is None else min(obj.size, limit)
        if end == 0:
            return b""
        return self._fetch(self._rel(path), obj, 0, end)

    def pread(self, path: str, offset: int, size: int) -> bytes:
        obj = self._object(path)
        if obj is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
        rel = self._rel(path)
        end = min(offset + size, obj.size)
        if offset >= end:
            return b""
        if self.windows.continues_pass(rel, offset, end):
            return self._read_windows(rel, obj, offset, end, start_missing=True)
        # A read into windows a pass fetched or has in flight (the tree's read-ahead,
        # a second reader behind the first) waits for them rather than asking again.
        buffered = self._read_windows(rel, obj, offset, end, start_missing=False)
        if buffered is not None:
            return buffered
        return self._fetch(rel, obj, offset, end)

    def read_ranges(self, path: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """Neighbouring ranges (no gap, or one smaller than a tenth of a window) are
        fetched by one GET up to a window's size; the groups in parallel."""
        obj = self._object(path)
        if obj is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
        rel = self._rel(path)
        wanted = sorted({(max(o, 0), min(o + n, obj.size)) for o, n in ranges if n > 0 and o < obj.size})
        groups: list[list[int]] = []
        gap = self.options.coalesce_bytes // 10
        for start, end in wanted:
            if groups and start - groups[-1][1] <= gap and end - groups[-1][0] <= self.options.coalesce_bytes:
                groups[-1][1] = max(groups[-1][1], end)
            else:
                groups.append([start, end])
        started = [self._start_fetch(rel, obj, s, e) for s, e in groups]
        what = self._display(rel)
        fetched = [(s, self._runner.wait(f, what, until)) for (s, _), (f, until) in zip(groups, started)]
        out = []
        for offset, size in ranges:
            end = min(offset + size, obj.size)
            if size <= 0 or offset >= end:
                out.append(b"")
                continue
            for s, data in fetched:
                if s <= offset and end <= s + len(data):
                    out.append(data[offset - s:end - s])
                    break
        return out

    def _read_windows(self, rel: str, obj: _Object, offset: int, end: int,
                      start_missing: bool) -> bytes | None:
        """``[offset, end)`` from the object's windows (:meth:`Windows.read`)."""
        return self.windows.read(rel, obj.size, offset, end, lambda s, e: self._start_fetch(rel, obj, s, e),
                                 self._display(rel), start_missing)

    def write(self, path: str, data: bytes, mode: int | None = None) -> None:
        """One PUT (an object store replaces an object whole); the listing is taken again
        on the next look, so that it shows the new object."""
        rel = self._rel(path)
        fs = self._fs.get()
        fs_path = self._fs.path(rel)

        async def put() -> None:
            await fs._pipe_file(fs_path, data)

        self._runner.run(put, self._display(rel))
        with self._list_lock:
            self._listed = False

    def close_file(self, path: str) -> None:
        try:
            rel = self._rel(path)
        except FileNotFoundError:
            return
        self.windows.forget(rel)

    def close(self) -> None:
        self.windows.close()

    def __repr__(self) -> str:
        return f"RemoteStorage({self.root!r})"
