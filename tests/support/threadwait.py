"""Test helper: wait until other threads are parked in a blocking wait.

Single-flight tests need the loading thread to hold its load until every
other thread has asked for the same key and is waiting for the result;
otherwise a late thread would simply hit the cache and the test would prove
nothing. Sleeping "long enough" is flaky, so instead we look at the live
stacks (``sys._current_frames``) and wait until each other thread is inside
a ``threading`` wait (``Condition.wait``, which ``Future.result`` and
``Event.wait`` use).
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

_THREADING_FILE = threading.__file__


def _current_frames() -> dict[int, Any]:
    # CPython 3.11 can deadlock when a garbage collection starts inside
    # sys._current_frames (python/cpython#106883): collect before, not during.
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


def _is_parked(ident: int) -> bool:
    frame = _current_frames().get(ident)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "wait" and code.co_filename == _THREADING_FILE:
            return True
        frame = frame.f_back
    return False


def wait_until_parked(threads: Iterable[threading.Thread], timeout: float = 5.0) -> bool:
    """Poll until every thread in ``threads`` is blocked in a ``threading`` wait.

    Returns False on timeout (the caller carries on; a broken single-flight
    implementation then shows up as extra loads instead of a hang).
    """
    idents = [t.ident for t in threads if t.ident is not None]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(_is_parked(i) for i in idents):
            return True
        time.sleep(0.001)
    return False


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``condition`` until it holds (work another thread finishes); fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)
