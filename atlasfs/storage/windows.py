"""Sequential readers of an object: aligned windows, prefetched into a bounded buffer.

A read that starts at the start of an object, or near where a recent read of it
ended, belongs to a *pass*. A pass is served by windows: aligned ranges of
``coalesce_bytes``, one GET each however small the reads, with the next ``prefetch``
windows started while the reader decodes. Windows fetched and in flight are kept
in memory up to ``buffer_bytes``, least recently used going first; a window whose
fetch fails leaves the buffer at once, so that the next read asks the store again.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import OrderedDict
from typing import Callable

from atlasfs.storage import StorageOptions

#: A read within this many bytes after where a recent read ended continues its pass
#: (the tree reads a block's bytes; a reader skipping a small block still counts).
SEQUENTIAL_SLACK = 1 << 20
#: Passes followed at once per object (several readers of one object, each in order).
STREAMS_PER_OBJECT = 4

#: Starts the fetch of ``[start, end)`` of one object: its future and when it is due.
Fetch = Callable[[int, int], tuple[concurrent.futures.Future[bytes], float]]
#: Waits for a fetch's future until the monotonic time given; ``what`` names it in errors.
Wait = Callable[[concurrent.futures.Future[bytes], str, float], bytes]


class _Pass:
    """Where one sequential reader of an object is: the end of its last read."""

    __slots__ = ("end", "used")

    def __init__(self, end: int) -> None:
        self.end = end
        self.used = time.monotonic()


class Windows:
    """The passes over one store's objects and the buffer of their windows (thread-safe).

    Objects are named by ``rel`` (any string unique per object). ``wait`` is how a
    read waits for a window's fetch (the store's retry loop bounds it).
    """

    def __init__(self, options: StorageOptions, wait: Wait) -> None:
        self.options = options
        self._wait = wait
        # Windows fetched or in flight: (rel, window index) -> Future[bytes], least recently used first.
        self._buffer: OrderedDict[tuple[str, int], tuple[concurrent.futures.Future[bytes], int]] = OrderedDict()
        #: Bytes of the windows in the buffer (fetched or in flight).
        self.buffered_bytes = 0
        self._lock = threading.RLock()  # re-entered: a future failing at once runs its callback in place
        self._passes: dict[str, list[_Pass]] = {}

    def continues_pass(self, rel: str, offset: int, end: int) -> bool:
        """Note a read of ``[offset, end)``; True if it continues a pass over the object
        (or starts one at its start), so that windows serve it."""
        with self._lock:
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

    def _window(self, rel: str, size: int, fetch: Fetch, index: int,
                start_missing: bool = True) -> concurrent.futures.Future[bytes] | None:
        """The future of window ``index`` of an object of ``size`` bytes; if it is not in
        the buffer, started with ``fetch`` (or None without ``start_missing``). Called
        with the lock held."""
        key = (rel, index)
        entry = self._buffer.get(key)
        if entry is not None:
            self._buffer.move_to_end(key)
            return entry[0]
        if not start_missing:
            return None
        window = self.options.coalesce_bytes
        start = index * window
        end = min(start + window, size)
        future, _ = fetch(start, end)
        self._buffer[key] = (future, end - start)
        self.buffered_bytes += end - start

        def forget_failure(done: concurrent.futures.Future[bytes]) -> None:
            # A failed window must not stay: the next read asks the store again.
            if done.cancelled() or done.exception() is not None:
                with self._lock:
                    entry = self._buffer.get(key)
                    if entry is not None and entry[0] is done:
                        del self._buffer[key]
                        self.buffered_bytes -= entry[1]

        future.add_done_callback(forget_failure)
        while self.buffered_bytes > self.options.buffer_bytes and len(self._buffer) > 1:
            _, (_, nbytes) = self._buffer.popitem(last=False)  # a reader waiting on it keeps its future
            self.buffered_bytes -= nbytes
        return future

    def read(self, rel: str, size: int, offset: int, end: int, fetch: Fetch, what: str,
             start_missing: bool) -> bytes | None:
        """``[offset, end)`` of an object of ``size`` bytes from the windows covering it,
        waiting for those in flight. With ``start_missing``, missing windows are fetched
        (by ``fetch``) and the next ``prefetch`` ones started; without, None unless every
        covering window is already there. ``what`` names the object in errors."""
        window = self.options.coalesce_bytes
        first, last = offset // window, (end - 1) // window
        with self._lock:
            if start_missing:
                # Prefetched windows first in the buffer's order, so that the ones needed
                # now are the most recently used, never evicted by their own prefetch.
                for index in range(last + 1, min(last + self.options.prefetch, (size - 1) // window) + 1):
                    self._window(rel, size, fetch, index)
            needed = [self._window(rel, size, fetch, index, start_missing) for index in range(first, last + 1)]
        if any(future is None for future in needed):
            return None
        until = time.monotonic() + self.options.deadline
        parts = []
        for index, future in zip(range(first, last + 1), needed):
            assert future is not None
            data = self._wait(future, what, until)
            base = index * window
            parts.append(data[max(offset, base) - base:min(end, base + window) - base])
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def forget(self, rel: str) -> None:
        """Drop an object's passes and windows (fetches in flight are cancelled)."""
        with self._lock:
            self._passes.pop(rel, None)
            for key in [k for k in self._buffer if k[0] == rel]:
                future, nbytes = self._buffer.pop(key)
                future.cancel()
                self.buffered_bytes -= nbytes

    def close(self) -> None:
        """Drop every pass and window (fetches in flight are cancelled)."""
        with self._lock:
            for future, _ in self._buffer.values():
                future.cancel()
            self._buffer.clear()
            self.buffered_bytes = 0
            self._passes.clear()
