"""The signals that end a mount.

While libfuse's loop runs in the main thread, Python's handlers only note a stop signal
(SIGHUP, SIGINT, SIGTERM) in a wake-up pipe; a thread reading the pipe calls the engine's
``stop(signum)``, which leaves the loop from outside it (libfuse's own signal handlers are
not installed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any, Protocol

#: The signals that unmount and end the daemon.
STOP_SIGNALS = (signal.SIGHUP, signal.SIGINT, signal.SIGTERM)


class Stoppable(Protocol):
    """An engine serving a mount: ``stop`` leaves its loop, from any thread."""

    def stop(self, signum: int) -> None: ...


def _noted(signum: int, frame: Any) -> None:
    """The Python-level handler of :data:`STOP_SIGNALS` while serving: the wake-up pipe has
    told the watcher already."""


def _watch(read_end: int, engine: Stoppable) -> None:
    """Stop ``engine`` on each stop signal written to the wake-up pipe; return on 0."""
    while True:
        for signum in os.read(read_end, 64):
            if signum == 0:
                return
            if signum in STOP_SIGNALS:
                engine.stop(signum)


@contextlib.contextmanager
def stopped_by_signals(engine: Stoppable) -> Iterator[None]:
    """For the duration (the loop, in the main thread), a stop signal stops ``engine``; the
    handlers before are put back after."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    old_handlers = {sig: signal.signal(sig, _noted) for sig in STOP_SIGNALS}
    old_wakeup = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    watcher = threading.Thread(target=_watch, args=(read_end, engine), name="atlasfs-signals", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(old_wakeup)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)
        os.write(write_end, b"\0")  # no signal is 0: the watcher's cue to end
        watcher.join()
        os.close(read_end)
        os.close(write_end)
