"""Tests for atlasfs.blockcache.BlockCache: a byte-bounded LRU with single-flight loads."""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import pytest

from atlasfs.blockcache import BlockCache
from threadwait import wait_until_parked


class Loader:
    """A load function factory that records which keys were loaded."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, key: Any, cost: int) -> Callable[[], tuple[str, int]]:
        def load() -> tuple[str, int]:
            self.calls.append(key)
            return f"value-{key}", cost
        return load


def must_hit(key: Any) -> tuple[str, int]:
    """A loader for keys that the test expects to be cached."""
    raise AssertionError(f"{key!r} should have been a cache hit")


def test_negative_bound_rejected() -> None:
    with pytest.raises(ValueError):
        BlockCache(-1)


def test_hit_and_miss_counters() -> None:
    cache: BlockCache[str] = BlockCache(100)
    load = Loader()
    assert cache.get("a", load("a", 10)) == "value-a"
    assert cache.get("a", lambda: must_hit("a")) == "value-a"
    assert cache.get("a", lambda: must_hit("a")) == "value-a"
    assert cache.get("b", load("b", 10)) == "value-b"
    assert (cache.hits, cache.misses) == (2, 2)
    assert load.calls == ["a", "b"]
    assert len(cache) == 2 and cache.current_bytes == 20


def test_bound_is_in_bytes_not_items() -> None:
    """Ten 10-byte items fit in 100 bytes; one more evicts, whatever the item count."""
    cache: BlockCache[str] = BlockCache(100)
    load = Loader()
    for k in range(10):
        cache.get(k, load(k, 10))
    assert len(cache) == 10 and cache.current_bytes == 100
    cache.get("big", load("big", 35))  # needs 35 bytes: the 4 oldest (0..3) must go
    assert cache.current_bytes == 95
    assert len(cache) == 7
    for k in range(4, 10):
        cache.get(k, lambda k=k: must_hit(k))
    cache.get(0, load(0, 10))  # was evicted: loaded again
    assert load.calls.count(0) == 2


def test_lru_order_of_eviction() -> None:
    """A hit refreshes an item, so the least recently *used* one is evicted first."""
    cache: BlockCache[str] = BlockCache(30)
    load = Loader()
    for k in "abc":
        cache.get(k, load(k, 10))
    cache.get("a", lambda: must_hit("a"))  # order now b, c, a
    cache.get("d", load("d", 10))  # evicts b
    for k in "acd":
        cache.get(k, lambda k=k: must_hit(k))  # order now a, c, d
    cache.get("b", load("b", 10))  # evicts a
    assert load.calls == ["a", "b", "c", "d", "b"]
    for k in "cdb":
        cache.get(k, lambda k=k: must_hit(k))
    cache.get("a", load("a", 10))
    assert load.calls[-1] == "a"
    assert cache.current_bytes == 30


def test_item_larger_than_bound_is_returned_but_not_kept() -> None:
    cache: BlockCache[str] = BlockCache(50)
    load = Loader()
    cache.get("small", load("small", 20))
    assert cache.get("huge", load("huge", 51)) == "value-huge"
    # Not kept, and it did not flush what was there.
    assert len(cache) == 1 and cache.current_bytes == 20
    cache.get("small", lambda: must_hit("small"))
    assert cache.get("huge", load("huge", 51)) == "value-huge"
    assert load.calls == ["small", "huge", "huge"]


def test_item_exactly_the_bound_is_kept() -> None:
    cache: BlockCache[str] = BlockCache(50)
    load = Loader()
    cache.get("x", load("x", 20))
    cache.get("y", load("y", 50))
    assert len(cache) == 1 and cache.current_bytes == 50
    cache.get("y", lambda: must_hit("y"))


def test_clear() -> None:
    cache: BlockCache[str] = BlockCache(50)
    load = Loader()
    cache.get("x", load("x", 20))
    cache.clear()
    assert len(cache) == 0 and cache.current_bytes == 0
    cache.get("x", load("x", 20))
    assert load.calls == ["x", "x"]


def test_matches_a_model_lru_under_random_use() -> None:
    """Random gets compared step by step with a plain LRU model: the same
    loads, the same held bytes, and never more bytes than the bound."""
    rng = random.Random(1234)
    bound = 1000
    cache: BlockCache[str] = BlockCache(bound)
    model: OrderedDict[int, int] = OrderedDict()
    costs = {k: rng.choice([1, 50, 120, 300, 999, 1000, 1001]) for k in range(40)}
    for _ in range(3000):
        key = rng.randrange(40)
        cost = costs[key]
        loaded: list[int] = []

        def load(key: int = key, cost: int = cost) -> tuple[str, int]:
            loaded.append(key)
            return f"v{key}", cost

        assert cache.get(key, load) == f"v{key}"
        expect_load = key not in model
        if key in model:
            model.move_to_end(key)
        elif cost <= bound:
            model[key] = cost
            while sum(model.values()) > bound:
                model.popitem(last=False)
        assert bool(loaded) == expect_load
        assert cache.current_bytes == sum(model.values()) <= bound
        assert len(cache) == len(model)


def _run_threads(n: int, target: Callable[[int], Any]) -> tuple[list[threading.Thread], list[Any]]:
    """Start ``n`` threads running ``target(i)``; returns the threads and a
    result list (a value, or the exception raised) filled in when they end."""
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            results[i] = target(i)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertions
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads, results


def _join(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join(timeout=30)
        assert not t.is_alive(), "thread hung"


N_THREADS = 16


def test_concurrent_misses_load_once() -> None:
    """Many threads ask for the same missing key: one load, one shared value."""
    cache: BlockCache[object] = BlockCache(1 << 20)
    value = object()
    calls: list[threading.Thread] = []
    started = threading.Event()
    threads: list[threading.Thread] = []

    def load() -> tuple[object, int]:
        calls.append(threading.current_thread())
        started.wait(10)
        # Hold the load until every other thread is waiting for it.
        wait_until_parked([t for t in threads if t is not threading.current_thread()])
        return value, 100

    started_threads, results = _run_threads(N_THREADS, lambda i: cache.get("k", load))
    threads.extend(started_threads)
    started.set()
    _join(threads)
    assert len(calls) == 1
    assert all(r is value for r in results), results
    assert cache.misses == 1
    assert cache.get("k", lambda: must_hit("k")) is value


def test_concurrent_load_exception_reaches_every_waiter_and_is_not_cached() -> None:
    cache: BlockCache[str] = BlockCache(1 << 20)
    calls: list[threading.Thread] = []
    started = threading.Event()
    threads: list[threading.Thread] = []

    class Boom(Exception):
        pass

    def failing_load() -> tuple[str, int]:
        calls.append(threading.current_thread())
        started.wait(10)
        wait_until_parked([t for t in threads if t is not threading.current_thread()])
        raise Boom("decode failed")

    started_threads, results = _run_threads(N_THREADS, lambda i: cache.get("k", failing_load))
    threads.extend(started_threads)
    started.set()
    _join(threads)
    assert len(calls) == 1
    assert all(isinstance(r, Boom) and str(r) == "decode failed" for r in results), results
    # The failure is not cached: the key is absent and a later get retries.
    assert len(cache) == 0 and cache.current_bytes == 0
    assert cache.get("k", lambda: ("ok", 10)) == "ok"
    assert cache.get("k", lambda: must_hit("k")) == "ok"


def test_loads_of_different_keys_run_in_parallel() -> None:
    """A load in progress must not block the load of another key (no global lock
    held while loading): each loader waits for the other to have started."""
    cache: BlockCache[str] = BlockCache(1 << 20)
    in_a, in_b = threading.Event(), threading.Event()

    def load_a() -> tuple[str, int]:
        in_a.set()
        assert in_b.wait(10), "load of b never started while a was loading"
        return "a", 1

    def load_b() -> tuple[str, int]:
        in_b.set()
        assert in_a.wait(10), "load of a never started while b was loading"
        return "b", 1

    threads, results = _run_threads(2, lambda i: cache.get("ab"[i], (load_a, load_b)[i]))
    _join(threads)
    assert results == ["a", "b"]


def test_charge_grows_an_item_and_evicts_the_least_recently_used() -> None:
    cache: BlockCache[str] = BlockCache(100)
    loader = Loader()
    for key in "abc":
        cache.get(key, loader(key, 30))
    cache.charge("a", 5)  # a is now the most recently used, at 35
    assert cache.current_bytes == 95
    cache.charge("c", 10)  # 105 > 100: b, the least recently used, goes
    assert cache.current_bytes == 75 and len(cache) == 2
    assert cache.get("a", must_hit) == "value-a" and cache.get("c", must_hit) == "value-c"
    cache.charge("b", 1000)  # gone already: nothing to charge
    cache.charge("a", 1000)  # over the bound alone: a goes, and c with it (older)
    assert cache.current_bytes <= 100 and cache.get("a", loader("a", 1)) == "value-a"
    assert loader.calls == ["a", "b", "c", "a"]


def test_peek_and_put_keep_the_bound_and_replace_in_place() -> None:
    cache: BlockCache[bytes] = BlockCache(100)
    assert cache.peek("a") is None
    cache.put("a", b"x", 40)
    cache.put("b", b"y", 40)
    assert cache.peek("a") == b"x"  # now the most recently used
    cache.put("b", b"z", 50)  # replaces b: 90 in all
    assert cache.current_bytes == 90 and cache.peek("b") == b"z"
    cache.put("c", b"w", 30)  # over the bound: a (least recently used) goes
    assert cache.peek("a") is None and cache.current_bytes == 80
    cache.put("d", b"big", 101)  # more than the bound: not kept
    assert cache.peek("d") is None and "d" not in cache and "c" in cache
