"""A local folder of raw byte ranges fetched from a store, bounded in bytes.

A remote read costs a round trip and money; the same range read again (another
mount, another day) costs neither once it is here. What is kept is the bytes as
stored (compressed blocks, whole coalesced ranges), never anything decoded, so a
cached entry is exactly what a GET would return.

Layout: ``DIR/<2 hex>/<sha256 of the object's identity>/<offset>-<size>``. The
identity is the URL with the object's size, mtime and ETag, so a changed object
never meets the old object's ranges; those age out. Entries are written to a
temporary name and renamed into place, so a reader (this process or another
mount sharing the folder) sees a whole entry or none. Least recently used go
first: a hit touches its entry's mtime, and when the folder outgrows its bound the
oldest entries are removed until it holds 90% of it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Iterator

log = logging.getLogger(__name__)

#: After an eviction the folder holds at most this share of its bound, so that
#: evictions (a walk of the folder) are rare, not one per write.
_EVICT_TO = 0.9


class DiskCache:
    """Raw ranges of remote objects in folder ``root``, at most ``max_bytes`` in all.

    Thread-safe, and safe to share between processes: entries appear by rename,
    and a missing entry (evicted by another process) is a miss. Every failure to
    write (a full disk, a read-only folder) is logged once and ignored: the cache
    only ever saves requests.
    """

    def __init__(self, root: str, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("the disk cache's bound must be positive")
        self.root = os.path.abspath(root)
        self.max_bytes = max_bytes
        #: An entry larger than this is not kept: it would push out a quarter of the rest.
        self.max_entry = max(max_bytes // 4, 1)
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        self._lock = threading.Lock()
        self._total = sum(size for _, size, _ in self._entries())
        self._warned = False
        self.hits = 0
        self.misses = 0

    @staticmethod
    def identity(url: str, size: int, mtime_ns: int, etag: str | None) -> str:
        """The folder name of one version of one object."""
        return hashlib.sha256(f"{url}\0{size}\0{mtime_ns}\0{etag or ''}".encode()).hexdigest()

    def _folder(self, identity: str) -> str:
        return os.path.join(self.root, identity[:2], identity)

    def get(self, identity: str, offset: int, size: int) -> bytes | None:
        """The ``size`` bytes at ``offset`` of the object, if an entry holds exactly them."""
        path = os.path.join(self._folder(identity), f"{offset}-{size}")
        try:
            with open(path, "rb") as f:
                data = f.read(size + 1)
        except OSError:
            self.misses += 1
            return None
        if len(data) != size:  # damaged (it cannot be half-written): drop it
            self._remove(path)
            self.misses += 1
            return None
        try:
            os.utime(path)  # least recently *used* go first
        except OSError:
            pass
        self.hits += 1
        return data

    def put(self, identity: str, offset: int, data: bytes) -> None:
        """Keep ``data``, the bytes at ``offset`` of the object (atomically)."""
        if len(data) > self.max_entry or not data:
            return
        folder = self._folder(identity)
        path = os.path.join(folder, f"{offset}-{len(data)}")
        if os.path.exists(path):
            return
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                self._remove(tmp)
                raise
        except OSError as exc:
            if not self._warned:
                self._warned = True
                log.warning("disk cache %s: cannot write (%s); reads go to the store", self.root, exc.strerror)
            return
        with self._lock:
            self._total += len(data)
            over = self._total > self.max_bytes
        if over:
            self.evict()

    def _entries(self) -> Iterator[tuple[str, int, float]]:
        """``(path, size, mtime)`` of every entry (temporary files of live writers excluded)."""
        for top in _scandir(self.root):
            for obj in _scandir(top):
                for entry in _scandir(obj):
                    if entry.name.startswith(".tmp-"):
                        # A writer that died leaves one: gone once it is an hour old.
                        try:
                            if entry.stat().st_mtime < time.time() - 3600:
                                self._remove(entry.path)
                        except OSError:
                            pass
                        continue
                    try:
                        st = entry.stat()
                    except OSError:
                        continue
                    yield entry.path, st.st_size, st.st_mtime

    def evict(self) -> None:
        """Remove the least recently used entries until the folder holds 90% of its bound.

        The folder is walked afresh: other processes sharing it add and remove entries
        that this one's running total does not see."""
        with self._lock:
            entries = sorted(self._entries(), key=lambda e: e[2])
            total = sum(size for _, size, _ in entries)
            target = int(self.max_bytes * _EVICT_TO)
            for path, size, _ in entries:
                if total <= target:
                    break
                self._remove(path)
                total -= size
            self._total = total

    @property
    def total_bytes(self) -> int:
        """Bytes this process counts in the folder (exact after an eviction)."""
        return self._total

    @staticmethod
    def _remove(path: str) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass


def _scandir(path: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if e.is_dir() or e.is_file()]
    except OSError:
        return []
