"""Reading a dataset from an object store through fsspec (s3fs for ``s3://``).

The read path (docs/storage.md):

* **Listing** once: the first look under the root lists every object below it in one
  recursive listing (paginated), and sizes, mtimes and ETags come from there, so
  opening a dataset of N shards costs a few requests, not 4N HEADs.
* **Random reads** (a block somewhere) are one ranged GET of exactly that block,
  its bounds taken from the shard's index.
* **Sequential readers** (a read that starts at the start of the object or where a
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
* **Retries**: a request that times out (``attempt_timeout``), is refused,
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

Every request runs on fsspec's event loop thread under ``asyncio.wait_for``, so a
request that hangs (a network that drops packets silently) is abandoned at its
timeout, never waited on forever. s3fs's and botocore's own retries are turned
off: one loop, with one deadline, decides.

Credentials are botocore's usual chain (environment, ``~/.aws``, instance
roles); nothing here logs or formats them, and URLs carrying ``user:password@``
are shown redacted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as _dt
import errno
import logging
import os
import random
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from atlasfs.storage import (
    Storage,
    StorageChangedError,
    StorageOptions,
    StorageUnavailableError,
    redact,
    split_userinfo,
)
from atlasfs.storage.diskcache import DiskCache
from atlasfs.storage.health import StoreHealth

log = logging.getLogger(__name__)

#: Backoff between attempts: starts here, doubles, never above the cap (then jittered).
BACKOFF_FIRST = 0.05
BACKOFF_CAP = 2.0
#: A read within this many bytes after where a recent read ended continues its pass
#: (the tree reads a block's bytes; a reader skipping a small block still counts).
SEQUENTIAL_SLACK = 1 << 20
#: Passes followed at once per object (several readers of one object, each in order).
STREAMS_PER_OBJECT = 4
#: Error codes of S3 (and kin) that mean "later", not "never".
_TRANSIENT_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "TooManyRequests", "RequestLimitExceeded",
    "503", "500", "502", "504", "429",
})
_TRANSIENT_ERRNOS = frozenset({
    errno.EBUSY, errno.EAGAIN, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
    errno.ECONNABORTED, errno.EPIPE, errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN,
})


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


def _describe_error(exc: BaseException) -> str:
    """A short, credential-free account of a failed request for a log line or message."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError)):
        return "timed out"
    status, code = _http_status(exc)
    if status or code:
        return f"HTTP {status or '?'} {code or ''}".strip()
    text = str(exc).splitlines()[0] if str(exc) else ""
    return redact(f"{type(exc).__name__}: {text}"[:200])


def _http_status(exc: BaseException) -> tuple[int | None, str | None]:
    """``(HTTP status, error code)`` of a botocore ``ClientError`` anywhere in the
    exception's chain (s3fs translates them into ``OSError``s carrying the original)."""
    seen = 0
    while exc is not None and seen < 8:
        response = getattr(exc, "response", None)
        if isinstance(response, dict):
            error = response.get("Error") or {}
            meta = response.get("ResponseMetadata") or {}
            return meta.get("HTTPStatusCode"), error.get("Code")
        status = getattr(exc, "status", None)  # aiohttp's ClientResponseError (https://)
        if isinstance(status, int):
            return status, None
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return None, None


def is_transient(exc: BaseException) -> bool:
    """True if a request that failed with ``exc`` may work if tried again."""
    if isinstance(exc, (asyncio.TimeoutError, TimeoutError, ConnectionError)):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    status, code = _http_status(exc)
    if status is not None or code is not None:
        if code in ("PreconditionFailed", "NoSuchKey", "NoSuchBucket", "AccessDenied", "InvalidRange"):
            return False
        return (status is not None and (status >= 500 or status == 429)) or (code in _TRANSIENT_CODES)
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    # Connection-level failures of the HTTP stacks under fsspec, by name (so that
    # neither aiohttp nor botocore has to be imported for the check).
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {
        "ClientConnectionError", "ServerDisconnectedError", "ClientPayloadError", "ClientOSError",
        "ServerTimeoutError", "HTTPClientError", "EndpointConnectionError", "ConnectionClosedError",
        "ReadTimeoutError", "ConnectTimeoutError", "ResponseParserError", "IncompleteRead",
        "IncompleteReadError", "FSTimeoutError", "ProxyConnectionError",
    })


def _precondition_failed(exc: BaseException) -> bool:
    status, code = _http_status(exc)
    return status == 412 or code == "PreconditionFailed"


def _warm_up(ref: "weakref.ReferenceType[RemoteStorage]") -> None:
    """In a forked child: make the file system and its client on a thread of its own."""
    storage = ref()
    if storage is None or storage._fs_obj is None:
        return

    def make() -> None:
        try:
            fs = storage._fs()
            if hasattr(fs, "set_session"):
                asyncio.run_coroutine_threadsafe(fs.set_session(), fs.loop).result(storage.options.deadline)
        except Exception:  # noqa: BLE001 - the first read makes it again, and reports
            pass

    threading.Thread(target=make, daemon=True, name="atlasfs-storage-warm-up").start()


class _Pass:
    """Where one sequential reader of an object is: the end of its last read."""

    __slots__ = ("end", "used")

    def __init__(self, end: int) -> None:
        self.end = end
        self.used = time.monotonic()


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
        self._auth = (user, password) if user else None
        self.protocol = clean.split("://", 1)[0].lower()
        self._fs_obj: Any = None
        self._fs_pid = -1
        self._fs_lock = threading.Lock()
        self._fs_root = ""
        # The listing: relative path -> object, and the set of folders (relative, "" = root).
        self._objects: dict[str, _Object] = {}
        self._folders: set[str] = set()
        self._listed = False
        self._list_lock = threading.Lock()
        # Windows fetched or in flight: (rel, window index) -> Future[bytes], least recently used first.
        self._buffer: OrderedDict[tuple[str, int], tuple[concurrent.futures.Future[bytes], int]] = OrderedDict()
        self._buffer_bytes = 0
        self._buffer_lock = threading.RLock()  # re-entered: a future failing at once runs its callback in place
        self._passes: dict[str, list[_Pass]] = {}
        self.disk = DiskCache(options.disk_cache, options.disk_cache_bytes) if options.disk_cache else None
        self.requests = 0
        self.retries = 0
        self.bytes_fetched = 0
        self.health = StoreHealth(self.root, options.deadline)
        if hasattr(os, "register_at_fork"):
            try:  # first: fsspec's own after-fork reset of its loop must run before this one
                import fsspec.asyn  # noqa: F401
            except ImportError:
                pass
            # A mount opens the dataset, then forks into the background: the child makes
            # its own client at once, not on the first read (it costs a few hundred ms).
            me = weakref.ref(self)
            os.register_at_fork(after_in_child=lambda: _warm_up(me))

    # -- the file system, made after a fork too (a mount forks into the background)

    def _fs(self) -> Any:
        with self._fs_lock:
            if self._fs_obj is None or self._fs_pid != os.getpid():
                self._fs_obj = self._make_fs()
                self._fs_pid = os.getpid()
                self._fs_root = self._fs_obj._strip_protocol(self.root).rstrip("/")
            return self._fs_obj

    def _make_fs(self) -> Any:
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

    # -- running requests with retries and a deadline

    def _run(self, make: Callable[[], Awaitable[Any]], what: str,
             local: Callable[[], Awaitable[Any]] | None = None) -> Any:
        """Run request ``make()`` on fsspec's loop, retrying transient failures until
        its deadline (``self.health``); raise :class:`StorageUnavailableError` then.
        ``local()``, if given, is asked first: a result other than None is the answer."""
        future, until = self._start(make, what, local)
        return self._wait(future, what, until)

    def _start(self, make: Callable[[], Awaitable[Any]], what: str,
               local: Callable[[], Awaitable[Any]] | None = None) -> tuple[concurrent.futures.Future[Any], float]:
        """Request ``make()`` (after ``local()``, see :meth:`_run`) started on fsspec's loop
        with its deadline; the future and when it is due, for :meth:`_wait`."""
        budget = self.health.budget()
        until = time.monotonic() + budget

        async def request() -> Any:
            if local is not None:  # a hit is no answer from the store: it stays down, or up
                found = await local()
                if found is not None:
                    return found
            refused = self.health.refuse_now(what)
            if refused is not None:
                raise refused
            return await self._retrying(make, what, until, budget)

        return asyncio.run_coroutine_threadsafe(request(), self._fs().loop), until

    def _wait(self, future: concurrent.futures.Future[Any], what: str, until: float) -> Any:
        """The result of a request future, waiting until ``until`` (monotonic) at most.
        The retry loop keeps its own deadline; the margin here only guards against a
        loop that stopped answering."""
        try:
            return future.result(timeout=max(until - time.monotonic(), 0) + 1.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise StorageUnavailableError(
                f"{what}: the store did not answer within {self.options.deadline:g} s") from None

    async def _retrying(self, make: Callable[[], Awaitable[Any]], what: str, until: float,
                        budget: float) -> Any:
        attempt = 0
        last = ""
        while True:
            left = until - time.monotonic()
            if left <= 0:
                raise self.health.failed(what, budget, attempt, last or "timed out")
            step = min(self.options.attempt_timeout, left)
            try:
                result = await asyncio.wait_for(make(), step)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if _precondition_failed(exc):
                    self.health.answered()
                    raise StorageChangedError(
                        f"{what}: changed in the store since it was listed (ETag differs); remount") from None
                if not is_transient(exc):
                    self.health.answered()
                    raise self._permanent(exc, what) from None
                # An attempt cut short by the deadline says less than the answer before it.
                if not (last and step < self.options.attempt_timeout
                        and isinstance(exc, (asyncio.TimeoutError, TimeoutError))):
                    last = _describe_error(exc)
            else:
                self.health.answered()
                return result
            attempt += 1
            self.retries += 1
            left = until - time.monotonic()
            if left <= 0.01:
                raise self.health.failed(what, budget, attempt, last)
            # The last pause is cut short so that one more attempt fits before the deadline.
            pause = min(BACKOFF_CAP, BACKOFF_FIRST * 2 ** (attempt - 1), left / 2) * random.uniform(0.5, 1.0)
            log.debug("%s: %s; retrying in %.2f s", what, last, pause)
            await asyncio.sleep(pause)

    @staticmethod
    def _permanent(exc: BaseException, what: str) -> OSError:
        """A failure not worth retrying, as the ``OSError`` the format layer expects."""
        if isinstance(exc, FileNotFoundError):
            return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT))
        if isinstance(exc, PermissionError):
            return PermissionError(errno.EACCES, "access denied by the store")
        if isinstance(exc, OSError) and exc.errno and not _http_status(exc)[0]:
            return OSError(exc.errno, redact(exc.strerror or os.strerror(exc.errno)))
        return OSError(errno.EIO, _describe_error(exc))

    # -- paths

    def _rel(self, path: str) -> str:
        """``path`` relative to the root ("" for the root itself)."""
        path = path.rstrip("/")
        if path == self.root:
            return ""
        if not path.startswith(self.root + "/"):
            raise FileNotFoundError(errno.ENOENT, f"{redact(path)} is not under {self.root}")
        return path[len(self.root) + 1:]

    def _fs_path(self, rel: str) -> str:
        self._fs()
        return f"{self._fs_root}/{rel}" if rel else self._fs_root

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
            fs = self._fs()
            base = self._fs_path("")

            async def find() -> dict[str, Any]:
                return await fs._find(base, withdirs=True, detail=True)

            found = self._run(find, self.root)
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
            fs = self._fs()
            fs_path = self._fs_path(rel)

            async def info() -> dict[str, Any]:
                return await fs._info(fs_path)

            found = self._run(info, self._display(rel))
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
        return self._wait(future, self._display(rel), until)

    def _start_fetch(self, rel: str, obj: _Object, start: int,
                     end: int) -> tuple[concurrent.futures.Future[bytes], float]:
        """:meth:`_fetch` started: the future of its bytes and when it is due."""
        return self._start(self._fetch_coro(rel, obj, start, end), self._display(rel),
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
        fs = self._fs()
        fs_path = self._fs_path(rel)
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
        if self._continues_pass(rel, offset, end):
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
        fetched = [(s, self._wait(f, self._display(rel), until)) for (s, _), (f, until) in zip(groups, started)]
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

    # -- sequential readers: windows, prefetched

    def _continues_pass(self, rel: str, offset: int, end: int) -> bool:
        """Note a read of ``[offset, end)``; True if it continues a pass over the object
        (or starts one at its start), so that windows serve it."""
        with self._buffer_lock:
            passes = self._passes.setdefault(rel, [])
            for p in passes:
                if p.end - SEQUENTIAL_SLACK <= offset <= p.end + SEQUENTIAL_SLACK:
                    p.end = max(p.end, end)
                    p.used = time.monotonic()
                    return True
            passes.append(_Pass(end))
            if len(passes) > STREAMS_PER_OBJECT:
                passes.remove(min(passes, key=lambda p: p.used))
            return offset == 0

    def _window(self, rel: str, obj: _Object, index: int,
                start_missing: bool = True) -> concurrent.futures.Future[bytes] | None:
        """The future of window ``index`` of the object; if it is not in the buffer, started
        (or None without ``start_missing``). Called with the buffer lock held."""
        key = (rel, index)
        entry = self._buffer.get(key)
        if entry is not None:
            self._buffer.move_to_end(key)
            return entry[0]
        if not start_missing:
            return None
        size = self.options.coalesce_bytes
        start = index * size
        end = min(start + size, obj.size)
        future, _ = self._start_fetch(rel, obj, start, end)
        self._buffer[key] = (future, end - start)
        self._buffer_bytes += end - start

        def forget_failure(done: concurrent.futures.Future[bytes]) -> None:
            # A failed window must not stay: the next read asks the store again.
            if done.cancelled() or done.exception() is not None:
                with self._buffer_lock:
                    entry = self._buffer.get(key)
                    if entry is not None and entry[0] is done:
                        del self._buffer[key]
                        self._buffer_bytes -= entry[1]

        future.add_done_callback(forget_failure)
        while self._buffer_bytes > self.options.buffer_bytes and len(self._buffer) > 1:
            _, (_, nbytes) = self._buffer.popitem(last=False)  # a reader waiting on it keeps its future
            self._buffer_bytes -= nbytes
        return future

    def _read_windows(self, rel: str, obj: _Object, offset: int, end: int,
                      start_missing: bool) -> bytes | None:
        """``[offset, end)`` from the windows covering it, waiting for those in flight.
        With ``start_missing``, missing windows are fetched and the next ``prefetch``
        ones started; without, None unless every covering window is already there."""
        size = self.options.coalesce_bytes
        first, last = offset // size, (end - 1) // size
        with self._buffer_lock:
            if start_missing:
                # Prefetched windows first in the buffer's order, so that the ones needed
                # now are the most recently used, never evicted by their own prefetch.
                for index in range(last + 1, min(last + self.options.prefetch, (obj.size - 1) // size) + 1):
                    self._window(rel, obj, index)
            needed = [self._window(rel, obj, index, start_missing) for index in range(first, last + 1)]
        if any(future is None for future in needed):
            return None
        until = time.monotonic() + self.options.deadline
        parts = []
        for index, future in zip(range(first, last + 1), needed):
            assert future is not None
            data = self._wait(future, self._display(rel), until)
            base = index * size
            parts.append(data[max(offset, base) - base:min(end, base + size) - base])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def write(self, path: str, data: bytes, mode: int | None = None) -> None:
        """One PUT (an object store replaces an object whole); the listing is taken again
        on the next look, so that it shows the new object."""
        rel = self._rel(path)
        fs = self._fs()
        fs_path = self._fs_path(rel)

        async def put() -> None:
            await fs._pipe_file(fs_path, data)

        self._run(put, self._display(rel))
        with self._list_lock:
            self._listed = False

    def close_file(self, path: str) -> None:
        try:
            rel = self._rel(path)
        except FileNotFoundError:
            return
        with self._buffer_lock:
            self._passes.pop(rel, None)
            for key in [k for k in self._buffer if k[0] == rel]:
                future, nbytes = self._buffer.pop(key)
                future.cancel()
                self._buffer_bytes -= nbytes

    def close(self) -> None:
        with self._buffer_lock:
            for future, _ in self._buffer.values():
                future.cancel()
            self._buffer.clear()
            self._buffer_bytes = 0
            self._passes.clear()

    def __repr__(self) -> str:
        return f"RemoteStorage({self.root!r})"
