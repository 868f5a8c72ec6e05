"""ReadAhead: hinted work runs on one background thread, in order, bounded, and stops when done."""

from __future__ import annotations

import threading

from atlasfs.tree.readahead import ReadAhead
from threadwait import wait_until


def _readahead_threads() -> int:
    return sum(t.name == "atlasfs-readahead" for t in threading.enumerate())


def test_hinted_keys_load_in_order_on_a_thread_that_ends_when_idle() -> None:
    seen: list[tuple[object, str]] = []
    ahead = ReadAhead(lambda key: seen.append((key, threading.current_thread().name)))
    assert ahead.idle() and _readahead_threads() == 0
    ahead.hint([1, 2, 3])
    wait_until(ahead.idle)
    assert seen == [(1, "atlasfs-readahead"), (2, "atlasfs-readahead"), (3, "atlasfs-readahead")]
    wait_until(lambda: _readahead_threads() == 0)
    ahead.hint([4])  # and a new hint starts a new one
    wait_until(ahead.idle)
    assert [key for key, _ in seen] == [1, 2, 3, 4] and ahead.loaded == 4


def test_pending_hints_are_bounded_and_each_key_waits_once() -> None:
    started, release = threading.Event(), threading.Event()
    seen: list[object] = []

    def load(key: object) -> None:
        started.set()
        release.wait(10)
        seen.append(key)

    ahead = ReadAhead(load, max_pending=4)
    ahead.hint([0])
    assert started.wait(10)
    ahead.hint(range(1, 21))  # only the 4 latest stay pending
    ahead.hint([18, 17])  # already pending: no second load
    release.set()
    wait_until(ahead.idle)
    assert seen == [0, 17, 18, 19, 20]


def test_a_failing_load_is_forgotten_and_the_rest_still_load() -> None:
    seen: list[object] = []

    def load(key: object) -> None:
        if key == "bad":
            raise OSError(5, "corrupt block")
        seen.append(key)

    ahead = ReadAhead(load)
    ahead.hint(["bad", "good"])
    wait_until(ahead.idle)
    assert seen == ["good"] and ahead.loaded == 2
