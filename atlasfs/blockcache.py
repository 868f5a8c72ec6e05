"""A thread-safe LRU cache bounded in bytes, with one load per key at a time."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, Generic, Hashable, TypeVar

V = TypeVar("V")


class BlockCache(Generic[V]):
    """Least-recently-used cache whose bound is the sum of its items' costs.

    ``get(key, load)`` returns the cached value or calls ``load()``, which
    returns ``(value, cost_in_bytes)``. When several threads ask for the same
    missing key at once, one of them loads it and the others wait for that
    result (or its exception), so a block is never decoded twice concurrently.
    An item costing more than the whole bound is returned but not kept.
    """

    def __init__(self, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError("cache size must be >= 0")
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._loading: dict[Hashable, Future[V]] = {}
        self._lock = threading.Lock()
        self._bytes = 0
        self.hits = 0
        self.misses = 0
        #: Costs of the items evicted so far, in all (the tree gives memory back to the system after many).
        self.evicted_bytes = 0

    @property
    def current_bytes(self) -> int:
        """Sum of the costs of the items held now (always <= ``max_bytes``)."""
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: Hashable) -> bool:
        """Whether ``key`` is cached now (a peek: its place in the LRU order is left as is)."""
        return key in self._items

    def get(self, key: Hashable, load: Callable[[], tuple[V, int]]) -> V:
        """Return the value for ``key``, loading it at most once concurrently."""
        with self._lock:
            item = self._items.get(key)
            if item is not None:
                self._items.move_to_end(key)
                self.hits += 1
                return item[0]
            pending = self._loading.get(key)
            if pending is None:
                self.misses += 1
                future: Future[V] = Future()
                self._loading[key] = future
        if pending is not None:
            return pending.result()
        try:
            value, cost = load()
        except BaseException as exc:
            with self._lock:
                del self._loading[key]
            future.set_exception(exc)
            raise
        with self._lock:
            del self._loading[key]
            self._insert(key, value, cost)
        future.set_result(value)
        return value

    def _insert(self, key: Hashable, value: V, cost: int) -> None:
        if cost > self.max_bytes:
            return
        self._items[key] = (value, cost)
        self._bytes += cost
        self._evict()

    def _evict(self) -> None:
        """Drop least recently used items until the bound holds (the lock is held)."""
        while self._bytes > self.max_bytes:
            _, (_, old_cost) = self._items.popitem(last=False)
            self._bytes -= old_cost
            self.evicted_bytes += old_cost

    def peek(self, key: Hashable) -> V | None:
        """The value cached for ``key`` (made the most recently used), or None; loads nothing."""
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, value: V, cost: int) -> None:
        """Cache ``value`` for ``key`` at ``cost``, in place of what was there."""
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._insert(key, value, cost)

    def charge(self, key: Hashable, extra: int) -> None:
        """Add ``extra`` bytes to the cost of ``key`` (a cached value that grew), evicting
        the least recently used items (``key`` too, if it alone is over the bound)."""
        with self._lock:
            item = self._items.get(key)
            if item is None:  # evicted meanwhile: its memory goes with it
                return
            self._items[key] = (item[0], item[1] + extra)
            self._items.move_to_end(key)
            self._bytes += extra
            self._evict()

    def clear(self) -> None:
        """Drop every cached item (loads under way are unaffected)."""
        with self._lock:
            self._items.clear()
            self._bytes = 0
