"""Work on shards in parallel processes, for the commands that go over a whole dataset
(``index``, ``export``).

Each worker process opens the dataset itself (an :class:`Opener` says how, as the command
line did), makes its own state from it once (a tree with a small cache...), then does one
shard at a time and sends back one small :class:`Done` for it: a shard that fails is one
line in it, never an exception crossing processes. The parent keeps only a few shards in
flight at a time and nothing of theirs but those results, so its memory does not grow
with the dataset. With one job everything runs in the calling process, on the source it
already has open.

Progress within a shard (files written) comes back through two shared counters that
the parent polls, so that a bar moves while a large shard is worked on.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.factory import SourceOptions, open_source
from atlasfs.formats.source import Source
from atlasfs.storage import StorageOptions, set_default_options

#: Seconds between looks at the workers' progress counters.
POLL_SECONDS = 0.2
#: Why a shard failed whose worker process died, the shard alone in its pool.
LOST = "a worker process ended without a result (killed, or out of memory?)"


def default_jobs() -> int:
    """Processes to use when not told: one per core this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Opener:
    """What a worker needs to open the dataset as the command line did (picklable)."""

    dataset: str
    format: str | None
    source_options: SourceOptions
    storage: StorageOptions
    verbose: bool = False

    def open(self) -> Source:
        """The dataset, opened."""
        return open_source(self.dataset, self.format, self.source_options)


@dataclass(frozen=True)
class Done:
    """One shard's result: ``error`` is the one line saying why it failed (None: it did not);
    ``value`` what the command wants back (small: counts, names)."""

    shard: int
    error: str | None = None
    value: Any = None


#: ``(what, n)``: ``("total", n)`` n more units to do, ``("done", n)`` n more done.
Report = Callable[[str, int], None]
#: Makes a worker's state from its open source (a module-level function: it is pickled by name).
Setup = Callable[[Source], Any]
#: Does shard ``s`` with the worker's state, reporting progress; returns its :class:`Done`.
Work = Callable[[Any, int, Report], Done]

# A worker process's own: its source, its state, its work, and the counters it reports to.
_worker: dict[str, Any] = {}


def _init_worker(opener: Opener, setup: Setup, work: Work, total: Any, done: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: it stops us
    signal.signal(signal.SIGTERM, _stop)  # ...with SIGTERM, which unwinds the shard in hand (no partial tar)
    set_default_options(opener.storage)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("atlasfs: %(message)s"))
    root = logging.getLogger("atlasfs")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if opener.verbose else logging.INFO)
    _worker.update(work=work, total=total, done=done)
    try:  # a worker that cannot open the dataset fails each shard it is given, in one line
        source = opener.open()
        _worker.update(source=source, state=setup(source))
    except Exception as exc:
        _worker["broken"] = f"{exc}" if isinstance(exc, (AtlasFormatError, OSError)) else f"{exc!r}"


def _stop(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _report(what: str, n: int) -> None:
    counter = _worker["total" if what == "total" else "done"]
    with counter.get_lock():
        counter.value += n


def _run_in_worker(s: int) -> Done:
    if "broken" in _worker:
        return Done(s, _worker["broken"])
    try:
        return _worker["work"](_worker["state"], s, _report)
    except Exception as exc:  # a bug still only fails its shard, in one line
        return Done(s, f"{exc!r}")


def _context() -> multiprocessing.context.BaseContext:
    """forkserver where there is one: workers start from a clean process, not a copy of one
    that has threads (a remote store's) or open files; else spawn."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")


def run(source: Source, opener: Opener, setup: Setup, work: Work, shards: Iterable[int], jobs: int,
        report: Report) -> Iterator[Done]:
    """Do ``work`` on each shard position of ``shards`` in ``jobs`` processes; yields each
    :class:`Done` as it comes (in shard order with one job, else as they finish).
    ``report`` is called in this process with the workers' progress."""
    if jobs <= 1:
        state = setup(source)
        for s in shards:
            try:
                yield work(state, s, report)
            except Exception as exc:
                yield Done(s, f"{exc!r}")
        return
    yield from _run_pool(opener, setup, work, list(shards), jobs, report)


def _run_pool(opener: Opener, setup: Setup, work: Work, shards: list[int], jobs: int,
              report: Report) -> Iterator[Done]:
    """:func:`run` in processes. A worker that dies (killed, out of memory, a crash in a
    decoder) breaks its pool and every shard in flight with it: those shards are done again
    one at a time, each in a pool of its own, so that only the shard that kills its worker is
    lost; the others go on in a new pool."""
    context = _context()
    total, done = context.Value("q", 0), context.Value("q", 0)
    seen = {"total": 0, "done": 0}

    def poll() -> None:
        for what, counter in (("total", total), ("done", done)):
            value = counter.value
            if value != seen[what]:
                report(what, value - seen[what])
                seen[what] = value

    def start(workers: int) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                                   initargs=(opener, setup, work, total, done))

    todo = list(reversed(shards))  # popped from the end: in the order given
    while todo:
        suspects: list[int] = []
        yield from _pool_pass(start(min(jobs, len(todo)) or 1), todo, jobs, poll, suspects)
        for s in suspects:  # each alone: a second death is that shard's own
            alone: list[int] = []
            yield from _pool_pass(start(1), [s], 1, poll, alone)
            if alone:
                yield Done(s, LOST)


def _pool_pass(executor: ProcessPoolExecutor, todo: list[int], jobs: int, poll: Callable[[], None],
               suspects: list[int]) -> Iterator[Done]:
    """Run shards popped from ``todo`` in ``executor`` until done or until a worker dies: then
    the shards that were in flight are put in ``suspects`` (the rest stay in ``todo``)."""
    pending: dict[Future[Done], int] = {}
    try:
        while True:
            while len(pending) < 2 * jobs and todo:  # a few in flight: the parent holds no more than that
                s = todo.pop()
                try:
                    pending[executor.submit(_run_in_worker, s)] = s
                except BrokenProcessPool:
                    todo.append(s)
                    break
            if not pending:
                break
            finished, _ = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
            poll()
            broken = False
            for future in finished:
                s = pending.pop(future)
                try:
                    yield future.result()
                except BrokenProcessPool:
                    suspects.append(s)
                    broken = True
                except Exception as exc:  # a worker that could not start (the dataset could not be opened)
                    yield Done(s, f"{exc}")
            if broken:
                suspects.extend(pending.values())
                pending.clear()
                break
        poll()
    except BaseException:
        # Ctrl-C or an error here: stop the workers now rather than after the shards in flight
        _stop_workers(executor)
        raise
    if suspects:
        _stop_workers(executor)
    else:
        executor.shutdown(wait=True)


def _stop_workers(executor: ProcessPoolExecutor) -> None:
    for process in list(getattr(executor, "_processes", {}).values()):
        process.terminate()
    executor.shutdown(wait=False, cancel_futures=True)
