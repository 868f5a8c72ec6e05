"""Ctrl-C and SIGTERM in the commands that go over a whole dataset (``pack``, ``export``,
``index``, ``verify``): the command stops within :data:`DEADLINE` seconds with status 130
and one line saying what it kept, never a traceback, and a second Ctrl-C is never needed.

The first SIGINT or SIGTERM raises :class:`KeyboardInterrupt` in the main thread (for both):
the command unwinds as it would from any error, its workers are stopped
(:class:`atlasfs.commands.jobs.Workers`), the output of the shards in hand goes, and the
command raises :class:`Interrupted` with the line. Signals after the first are ignored, so
that nothing interrupts the unwinding. Should the unwinding not end in time (a read that
does not return), a watchdog kills the workers left, says the line the command last
registered (:func:`set_status`) and ends the process with 130.

The worker processes never see a signal meant for the command line: they start with
SIGINT and SIGTERM blocked (a mask kept through exec), then ignore SIGINT and take
SIGTERM as the parent's request to stop.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

#: Seconds from the signal to the process's end, at the latest.
DEADLINE = 1.7
#: The exit status of an interrupted command (SIGTERM too).
STATUS = 130
SIGNALS = (signal.SIGINT, signal.SIGTERM)

_lock = threading.Lock()
_state: dict[str, Any] = {"signum": None, "said": False, "status": None, "deferred": 0, "pending": False}
#: Process ids to kill should the deadline pass (the commands' workers register theirs).
children: set[int] = set()


class Interrupted(Exception):
    """The command was interrupted and has cleaned up; ``line`` says what it kept."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


def install() -> dict[int, Any]:
    """Handle SIGINT and SIGTERM as above from now on (the main thread only); returns the
    handlers there were, for :func:`restore`."""
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig in SIGNALS:
        signal.signal(sig, _first_signal)
    return previous


def restore(previous: dict[int, Any]) -> None:
    """Put back the handlers :func:`install` replaced, unless a signal came: then they stay
    ignored until the process ends (a late Ctrl-C would break the exit with a traceback)."""
    if _state["signum"] is None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _first_signal(signum: int, frame: object) -> None:
    for sig in SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if _state["signum"] is not None:
        return
    _state["signum"] = signum
    threading.Thread(target=_watchdog, args=(time.monotonic() + DEADLINE,), name="atlasfs-deadline",
                     daemon=True).start()
    if _state["deferred"]:
        _state["pending"] = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """A section that an interrupt does not cut in half (starting or stopping a worker):
    the KeyboardInterrupt of a signal that comes meanwhile is raised as it ends. A signal
    handler runs in the main thread whichever thread the signal came to, so blocking it
    there would not do."""
    _state["deferred"] += 1
    try:
        yield
    finally:
        _state["deferred"] -= 1
        if not _state["deferred"] and _state["pending"]:
            _state["pending"] = False
            raise KeyboardInterrupt


def signalled() -> int | None:
    """The signal that interrupted the command, if one did."""
    return _state["signum"]


def set_status(status: Callable[[], str] | None) -> None:
    """What the watchdog says was kept, should the command not say it in time."""
    _state["status"] = status


def say(line: str) -> None:
    """Write ``line`` on stderr, once per process (the command or the watchdog, not both)."""
    with _lock:
        if _state["said"]:
            return
        _state["said"] = True
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode(errors="replace"))


def _watchdog(deadline: float) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))
    kill_all(children)
    status = _state["status"]
    try:
        line = f"atlasfs: interrupted: {status()}" if status is not None else "atlasfs: interrupted"
    except Exception:  # noqa: BLE001 (whatever the command's state, the line is said)
        line = "atlasfs: interrupted"
    say(line)
    os._exit(STATUS)


def kill_all(pids: set[int]) -> None:
    """SIGKILL each of ``pids`` (the children registered, not reaped yet)."""
    for pid in list(pids):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def worker_signals(on_term: Callable[[int, object], None]) -> None:
    """In a worker process, first thing: SIGINT ignored (Ctrl-C is the command line's to
    handle), SIGTERM to ``on_term``; then the block a worker starts with is lifted (a SIGINT
    that came while it started is dropped, a SIGTERM taken now)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_term)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
