"""A thread-safe LRU cache bounded in bytes, with one load per key at a time, which may
borrow its bytes from another cache's bound (a mount's one bound: the native engine's byte cache
lends the tree's block cache what it keeps)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import Callable, Generic, Hashable, Protocol, TypeVar

V = TypeVar("V")


class Lender(Protocol):
    """Where a :class:`BlockCache` borrows its bytes: the native engine's session
    (``Session.lend``, ``Session.repay``: atlasfs/fuse/native/cache.c cache_lend)."""

    def lend(self, nbytes: int) -> int:
        """Up to ``nbytes`` lent now (never waits): the bytes granted, maybe fewer."""

    def repay(self, nbytes: int) -> None:
        """``nbytes`` lent before given back."""


class BlockCache(Generic[V]):
    """Least-recently-used cache whose bound is the sum of its items' costs.

    ``get(key, load)`` returns the cached value or calls ``load()``, which
    returns ``(value, cost_in_bytes)``. When several threads ask for the same
    missing key at once, one of them loads it and the others wait for that
    result (or its exception), so a block is never decoded twice concurrently.
    An item costing more than the whole bound is returned but not kept.

    With a lender (:meth:`borrow_from`), every byte kept is borrowed first: an item is kept
    once the lender granted its cost, the least recently used items going first to make room
    when it grants less (the cache keeps less, never waits), and evicted items' bytes are
    given back at once. Without one, the cache works alone within ``max_bytes``.
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
        self._lender: Lender | None = None
        self._borrowed = 0  # bytes the lender granted and not given back: >= _bytes at all times

    @property
    def lender(self) -> Lender | None:
        """Where the cache borrows its bytes, or None (it works alone)."""
        return self._lender

    def borrow_from(self, lender: Lender) -> None:
        """Borrow every byte kept from ``lender`` from now on, starting with those kept now
        (the least recently used items are dropped if it grants less)."""
        with self._lock:
            if self._lender is not None and self._borrowed:
                self._lender.repay(self._borrowed)
            self._lender, self._borrowed = lender, 0
            if self._bytes:
                self._borrowed = lender.lend(self._bytes)
                while self._bytes > self._borrowed:
                    self._evict_one()

    def usage(self) -> tuple[int, int]:
        """(bytes kept, bytes borrowed) at one moment; kept <= borrowed, both 0 with no lender
        but the first."""
        with self._lock:
            return self._bytes, self._borrowed

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
        """Keep ``value`` if there is room for ``cost`` (the lock is held)."""
        if cost <= self.max_bytes and self._make_room(cost):
            self._items[key] = (value, cost)
            self._bytes += cost
        self._repay_surplus()

    def _evict_one(self) -> None:
        """Drop the least recently used item (the lock is held; its bytes stay borrowed)."""
        _, (_, old_cost) = self._items.popitem(last=False)
        self._bytes -= old_cost
        self.evicted_bytes += old_cost

    def _make_room(self, cost: int) -> bool:
        """Whether ``cost`` bytes more fit, the least recently used items dropped to make room
        within ``max_bytes`` and within what the lender grants (the lock is held). Borrowed
        before kept: the bytes kept never pass the bytes borrowed."""
        while self._items and self._bytes + cost > self.max_bytes:
            self._evict_one()
        if self._lender is not None and self._bytes + cost > self._borrowed:
            self._borrowed += self._lender.lend(self._bytes + cost - self._borrowed)
            while self._items and self._bytes + cost > self._borrowed:
                self._evict_one()  # granted less: the cache keeps less
        if self._bytes + cost > self.max_bytes:
            return False
        return self._lender is None or self._bytes + cost <= self._borrowed

    def _repay_surplus(self) -> None:
        """Give back what is borrowed beyond what is kept (the lock is held)."""
        if self._lender is not None and self._borrowed > self._bytes:
            self._lender.repay(self._borrowed - self._bytes)
            self._borrowed = self._bytes

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
                self._bytes -= old[1]  # its bytes stay borrowed for the new value, or are given back
            self._insert(key, value, cost)

    def charge(self, key: Hashable, extra: int) -> None:
        """Add ``extra`` bytes to the cost of ``key`` (a cached value that grew), evicting
        the least recently used items (``key`` too, if it alone is over the bound)."""
        with self._lock:
            item = self._items.get(key)
            if item is None:  # evicted meanwhile: its memory goes with it
                return
            self._items.move_to_end(key)
            if item[1] + extra <= self.max_bytes and self._make_room(extra) and key in self._items:
                self._items[key] = (item[0], item[1] + extra)
                self._bytes += extra
            elif key in self._items:  # no room for it grown: it goes, as one over the bound
                del self._items[key]
                self._bytes -= item[1]
                self.evicted_bytes += item[1]
            self._repay_surplus()

    def clear(self) -> None:
        """Drop every cached item (loads under way are unaffected)."""
        with self._lock:
            self._items.clear()
            self._bytes = 0
            self._repay_surplus()
