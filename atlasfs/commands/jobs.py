"""Work on shards in parallel processes, for the commands that go over a whole dataset
(``index``, ``export``; ``pack`` uses :class:`Workers` too).

Each worker process opens the dataset itself (an :class:`Opener` says how, as the command
line did), makes its own state from it once (a tree with a small cache...), then does one
shard at a time and sends back one small :class:`Done` for it: a shard that fails is one
line in it, never an exception crossing processes. The parent gives each worker one shard
at a time and keeps nothing of theirs but those results, so its memory does not grow
with the dataset. With one job everything runs in the calling process, on the source it
already has open.

Progress within a shard (files written) comes back as messages on the worker's pipe, so
that a bar moves while a large shard is worked on.

:class:`Workers` is a small pool of our own rather than ``ProcessPoolExecutor``: a worker
that dies loses its own shard only, and the pool can be stopped at once on Ctrl-C (its
workers asked with SIGTERM to drop the shard in hand, killed if they do not within
:data:`GRACE`), with no management thread to wait for (:mod:`.interrupts`).

Where the workers run is an :class:`Executor`'s choice: :class:`Local` (this machine's
processes, :class:`Workers`) or a Ray cluster (``--ray``: :mod:`atlasfs.ray.executor`; only
``atlasfs/ray/`` imports Ray). Both give the same pool interface (:class:`Pool`), so a command's shards
and bytes are the same whichever runs them.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import re
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from atlasfs.commands import interrupts

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.factory import SourceOptions, open_source
from atlasfs.formats.source import Source
from atlasfs.storage import StorageOptions, set_default_options

#: Seconds between looks at the workers when none answers.
POLL_SECONDS = 0.2
#: Seconds workers asked to stop (SIGTERM) have to drop their shard and end before SIGKILL.
GRACE = 0.5
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



# -- executors


class Pool(ABC):
    """Workers that each ran an initializer once and then take one call at a time (what
    :class:`Workers` is on this machine, and :class:`~atlasfs.ray.executor.RayPool` on a
    cluster). Used as a context manager: leaving it on an exception (Ctrl-C) stops the calls
    under way (:meth:`stop`), else lets them end (:meth:`close`)."""

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, kind: type[BaseException] | None, *rest: object) -> None:
        if kind is None:
            self.close()
        else:
            self.stop()

    @abstractmethod
    def idle(self) -> bool:
        """Whether :meth:`submit` can start a call now."""

    @abstractmethod
    def busy(self) -> list[Any]:
        """The tags of the calls under way."""

    @abstractmethod
    def submit(self, tag: Any, func: Callable[[Any], Any], arg: Any) -> None:
        """Start ``func(arg)``; its answer comes back from :meth:`wait` with ``tag``."""

    @abstractmethod
    def wait(self, timeout: float = POLL_SECONDS) -> list[tuple[Any, str, Any]]:
        """The answers that came within ``timeout`` seconds, as ``(tag, kind, value)``."""

    @abstractmethod
    def close(self) -> None:
        """Once every answer came: end the workers."""

    @abstractmethod
    def stop(self) -> None:
        """End the calls under way now."""


class Executor(ABC):
    """Where the calls of a command that works shard by shard run."""

    #: Calls under way at once, at most.
    size: int = 1
    #: Worker processes sharing one machine's memory (a per-process cache is its share).
    per_machine: int = 1
    #: Whether a call whose worker died was already tried again (Ray's task retries): then
    #: it fails at once rather than being run again alone.
    retries_lost: bool = False

    @abstractmethod
    def parallel(self, items: int) -> bool:
        """Whether ``items`` calls go to a :meth:`pool` (else they run in this process)."""

    @abstractmethod
    def pool(self, items: int, initializer: Callable[..., None], initargs: tuple[Any, ...],
             on_message: Callable[..., None] | None = None) -> Pool:
        """Workers for ``items`` calls, each running ``initializer(*initargs)`` once first;
        ``on_message(*message)`` gets what they :func:`_send` besides their answers."""


class Local(Executor):
    """Up to ``jobs`` processes of this machine (:class:`Workers`); one runs in this process."""

    def __init__(self, jobs: int) -> None:
        self.size = self.per_machine = max(1, jobs)

    def parallel(self, items: int) -> bool:
        return min(self.size, items) > 1

    def pool(self, items: int, initializer: Callable[..., None], initargs: tuple[Any, ...],
             on_message: Callable[..., None] | None = None) -> Pool:
        return Workers(min(self.size, items), initializer, initargs, on_message)


def executor_of(jobs: int | Executor) -> Executor:
    """``jobs`` as an executor: a number of processes is :class:`Local`."""
    return jobs if isinstance(jobs, Executor) else Local(int(jobs))


def per_machine(jobs: int | Executor) -> int:
    """Worker processes of ``jobs`` sharing one machine (a memory budget is split by it)."""
    return max(1, executor_of(jobs).per_machine)


#: What to install for ``--ray`` (said in one line when Ray is missing).
RAY_EXTRA = "pip install 'atlasfs[ray]'"


#: What ``--ray`` takes as a cluster's address (Ray's own forms): ``auto`` (the cluster of this
#: node), ``local`` (one started for the command), ``HOST:PORT`` (a head's GCS, IPv6 in
#: brackets) or ``ray://HOST:PORT`` (Ray Client). Any other word after ``--ray`` is no address.
_ADDRESS = re.compile(r"auto|local|ray://\S+|(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):\d{1,5}")


def is_ray_address(text: str) -> bool:
    """Whether ``text`` is one of the forms of a Ray cluster's address (:data:`_ADDRESS`)."""
    return bool(_ADDRESS.fullmatch(text))


def _ray_value(text: str) -> str:
    """``--ray``'s value: empty (no address given) or an address; else argparse's error."""
    if text and not is_ray_address(text):
        raise argparse.ArgumentTypeError(f"{text!r} is no Ray address (auto, local, HOST:PORT or ray://HOST:PORT)")
    return text


def add_executor_arguments(parser: argparse.ArgumentParser) -> None:
    """``--ray [ADDRESS]`` on a command that works shard by shard. Its value is optional, so
    argparse alone would take ``pack --ray DATASET OUTDIR``'s DATASET for it: the command line
    is read through :func:`ray_address_apart` first."""
    parser.add_argument(
        "--ray", nargs="?", const="", default=None, metavar="ADDRESS", type=_ray_value,
        help="one Ray task per shard: on the cluster at ADDRESS (auto, HOST:PORT or ray://HOST:PORT; "
             "else $RAY_ADDRESS), or on a local one started for the command (no address, or local); a word "
             "after --ray that is none of these is the command's next argument (pack --ray DATASET OUTDIR); "
             "input and output on a file system every node shares, or a bucket "
             f"(needs {RAY_EXTRA})")


def ray_address_apart(argv: Sequence[str]) -> list[str]:
    """``argv`` with each ``--ray WORD`` whose WORD is no Ray address (:func:`is_ray_address`)
    written ``--ray= WORD``: ``--ray`` without an address, WORD left to the positionals. An
    address stays ``--ray``'s value; so does anything given as ``--ray=VALUE``."""
    out = list(argv)
    for i, arg in enumerate(out[:-1]):
        if arg == "--":
            break
        if len(arg) >= 4 and "--ray".startswith(arg) and not out[i + 1].startswith("-") \
                and not is_ray_address(out[i + 1]):
            out[i] = "--ray="
    return out


def executor_from_args(args: argparse.Namespace, jobs: int | None) -> int | Executor | None:
    """The executor ``--ray`` asks for (``jobs``, if given, caps the tasks under way), or
    None without it. Ray missing: :class:`~atlasfs.options.OptionError`, one line."""
    address = getattr(args, "ray", None)
    if address is None:
        return None
    try:
        from atlasfs.ray import executor
    except ImportError as exc:
        from atlasfs.options import OptionError
        missing = getattr(exc, "name", None) or "ray"
        raise OptionError(f"--ray needs Ray ({missing} cannot be imported): {RAY_EXTRA}") from None
    address = address or os.environ.get("RAY_ADDRESS") or None
    return executor.RayExecutor(None if address == "local" else address, jobs)


# -- the pool


class _Child:
    """A worker process: its pid and its end of the pipe to it (the pipe's EOF: it ended)."""

    def __init__(self, pid: int, conn: Any) -> None:
        self.pid, self.conn = pid, conn
        self.returncode: int | None = None
        self.tag: Any = None
        self.busy = False

    def poll(self, block: bool = False) -> int | None:
        """Its exit status once it ended (reaped then), else None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, 0 if block else os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                interrupts.children.discard(self.pid)
        return self.returncode

    def signal(self, signum: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)


#: A worker process's pipe to its parent (None in the parent).
_conn: Any = None
#: The file descriptor a worker process finds its pipe on.
CHILD_FD = 3


def _child() -> None:
    """A worker process's life (``python -c`` runs it, with SIGINT and SIGTERM blocked: see
    :meth:`Workers._start`): the parent's ``sys.path``, then ``(initializer, initargs)``; the
    initializer runs once, then each ``(func, arg)`` received is answered ``("ok",
    func(arg))`` or ``("error", exception)``; ends at EOF."""
    interrupts.worker_signals(_stop)  # first: until now both were blocked
    try:
        _serve()
    except BaseException:
        if _worker.get("stopping"):  # see _stopping: whatever the SystemExit became, the worker ends quietly
            raise SystemExit(0) from None
        raise


def _serve() -> None:
    """:func:`_child`'s work, once its signals are set."""
    global _conn
    import pickle
    conn = _conn = multiprocessing.connection.Connection(CHILD_FD)
    try:
        sys.path[:] = conn.recv()
        payload = conn.recv_bytes()
    except (EOFError, OSError):
        return
    broken: BaseException | None = None
    try:  # unpickling imports the modules of the work: one that cannot load here fails each call
        initializer, initargs = pickle.loads(payload)
    except Exception as exc:
        broken = _unloadable(exc)
    if broken is None:
        try:
            initializer(*initargs)
        except Exception as exc:  # each call is answered with it
            broken = exc
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        with said_once() as held:
            try:
                if broken is not None:
                    raise broken
                try:
                    func, arg = pickle.loads(message)
                except Exception as exc:
                    raise _unloadable(exc) from None
                reply: tuple[str, Any] = ("ok", held.answered(func(arg)))
            except Exception as exc:
                reply = ("error", held.answered(exc))
        try:
            conn.send(reply)
        except (BrokenPipeError, EOFError):
            return
        except Exception as exc:  # an answer that does not pickle
            conn.send(("error", RuntimeError(f"{reply[1]!r}: {exc}")))


def _unloadable(exc: BaseException) -> BaseException:
    """The one-line failure of work a worker cannot unpickle (a module of it that does not
    import in the worker: moved, or a native library that does not load there). It used to
    end the worker with a traceback, every shard it was given then lost, said only as
    :data:`LOST`. Stopped meanwhile (:func:`_stop`), the worker ends quietly."""
    if _stopping(exc):
        raise SystemExit(0) from None
    return RuntimeError(f"a worker process cannot load its work: {exc}")


def _stop(signum: int, frame: object) -> None:
    """SIGTERM in a worker: the parent stops the pool (or the whole group was sent it): the
    shard in hand is unwound (its partial output removed) and the process ends quietly."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _worker["stopping"] = True
    raise SystemExit(0)


def _stopping(exc: BaseException) -> bool:
    """Whether ``exc`` stands for this worker being stopped (:func:`_stop`): the SystemExit it
    raises in the middle of an import comes out as another exception (numpy's import turns it
    into a 30-line ImportError), which is no failure of the shard: never said, never sent."""
    return bool(_worker.get("stopping"))


#: Sends a message to the parent where it is no pipe (a Ray task's: :mod:`atlasfs.ray.executor`).
_sender: Callable[[Any], None] | None = None


def _send(message: Any) -> None:
    """Send ``message`` to the parent (from a worker's main thread)."""
    if _sender is not None:
        _sender(message)
    else:
        _conn.send(message)


class Workers(Pool):
    """Up to ``size`` worker processes, each a new interpreter (not a copy of this process,
    which has threads and open files) running ``initializer(*initargs)`` once, then one call
    at a time. Used as a context manager: leaving it on an exception (Ctrl-C) stops the
    workers at once (:meth:`stop`), else lets them end (:meth:`close`). ``on_message(*message)``
    is given what workers :func:`_send` besides their answers.

    A worker is started with ``posix_spawn`` and SIGINT and SIGTERM blocked, a mask the new
    interpreter keeps until :func:`_child` has set its handlers: a Ctrl-C to the process
    group while it starts (imports) is dropped, never a traceback (multiprocessing's spawn
    does not pass the mask on)."""

    def __init__(self, size: int, initializer: Callable[..., None], initargs: tuple[Any, ...],
                 on_message: Callable[..., None] | None = None) -> None:
        import pickle
        self.size = max(1, size)
        self._payload = pickle.dumps((initializer, initargs))
        self._on_message = on_message
        self._workers: list[_Child] = []

    def _start(self) -> _Child:
        import subprocess
        ours, theirs = multiprocessing.Pipe()
        argv = [sys.executable, *subprocess._args_from_interpreter_flags(),  # type: ignore[attr-defined]
                "-c", "from atlasfs.commands.jobs import _child; _child()"]
        actions = [(os.POSIX_SPAWN_DUP2, theirs.fileno(), CHILD_FD),
                   (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)]
        with interrupts.deferred():  # a start is never cut in half: a Ctrl-C now is taken after it
            try:
                pid = os.posix_spawn(sys.executable, argv, dict(os.environ), file_actions=actions,
                                     setsigmask=interrupts.SIGNALS)
            finally:
                theirs.close()
            interrupts.children.add(pid)
            child = _Child(pid, ours)
            self._workers.append(child)
        try:
            ours.send(sys.path)
            ours.send_bytes(self._payload)
        except OSError:  # it died already: wait() finds it so
            pass
        return child

    def idle(self) -> bool:
        """Whether :meth:`submit` can give a call to a worker now."""
        return len(self._workers) < self.size or any(not w.busy for w in self._workers)

    def busy(self) -> list[Any]:
        """The tags of the calls under way."""
        return [w.tag for w in self._workers if w.busy]

    def submit(self, tag: Any, func: Callable[[Any], Any], arg: Any) -> None:
        """Give ``func(arg)`` to an idle worker (one is started if there are fewer than
        ``size``); its answer comes back from :meth:`wait` with ``tag``."""
        worker = next((w for w in self._workers if not w.busy), None) or self._start()
        worker.tag, worker.busy = tag, True
        try:
            worker.conn.send((func, arg))
        except OSError:  # it died: wait() finds it so
            pass

    def wait(self, timeout: float = POLL_SECONDS) -> list[tuple[Any, str, Any]]:
        """Answers that came within ``timeout`` seconds: ``(tag, "ok", value)``, ``(tag,
        "error", exception)``, or ``(tag, "lost", None)`` for a call whose worker died."""
        busy = {w.conn: w for w in self._workers if w.busy}
        if not busy:
            return []
        answers = []
        for conn in multiprocessing.connection.wait(list(busy), timeout):
            w = busy[conn]
            answer = self._receive(w)
            while answer is None and self._readable(w):  # messages first, then the answer
                answer = self._receive(w)
            if answer is not None:
                answers.append((w.tag, *answer))
                w.tag, w.busy = None, False
                if answer[0] == "lost":
                    self._forget(w)
        return answers

    @staticmethod
    def _readable(w: _Child) -> bool:
        try:
            return bool(w.conn.poll(0))
        except (OSError, EOFError):
            return True

    def _receive(self, w: _Child) -> tuple[str, Any] | None:
        """The answer on ``w``'s pipe if that is what comes (a message is handed on: None)."""
        try:
            if not w.conn.poll(0):
                return None
            message = w.conn.recv()
        except Exception:  # noqa: BLE001 (EOF, or a message cut short: it died)
            return ("lost", None)
        if message[0] in ("ok", "error"):
            return message
        if self._on_message is not None:
            self._on_message(*message[1:])
        return None

    def _forget(self, w: _Child) -> None:
        with interrupts.deferred():
            self._workers.remove(w)
            self._end([w], graceful=False)

    def close(self) -> None:
        """Let the workers end (their pipes close: they return) and wait for them."""
        with interrupts.deferred():
            workers, self._workers = self._workers, []
            for w in workers:
                with contextlib.suppress(OSError):
                    w.conn.close()
            deadline = time.monotonic() + 60
            while any(w.poll() is None for w in workers) and time.monotonic() < deadline:
                time.sleep(0.005)
            self._end(workers)

    def stop(self) -> None:
        """End the workers now: SIGTERM (each drops its shard in hand, removing what it
        wrote of it), SIGKILL for those still there after :data:`GRACE` seconds."""
        with interrupts.deferred():
            workers, self._workers = self._workers, []
            self._end(workers)

    @staticmethod
    def _end(workers: list[_Child], graceful: bool = True) -> None:
        if graceful:
            for w in workers:
                w.signal(signal.SIGTERM)
            deadline = time.monotonic() + GRACE
            left = [w for w in workers if w.poll() is None]
            while left and time.monotonic() < deadline:
                time.sleep(0.005)
                left = [w for w in left if w.poll() is None]
        for w in workers:
            w.signal(signal.SIGKILL)
        deadline = time.monotonic() + GRACE
        for w in workers:
            while w.poll() is None and time.monotonic() < deadline:
                time.sleep(0.002)
            with contextlib.suppress(OSError):
                w.conn.close()


# -- shards in workers

# A worker process's own: its source, its state and its work.
_worker: dict[str, Any] = {}


def _init_worker(opener: Opener, setup: Setup, work: Work) -> None:
    set_default_options(opener.storage)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("atlasfs: %(message)s"))
    root = logging.getLogger("atlasfs")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if opener.verbose else logging.INFO)
    _worker.update(work=work)
    try:  # a worker that cannot open the dataset fails each shard it is given, in one line
        source = opener.open()
        _worker.update(source=source, state=setup(source))
    except Exception as exc:
        if _stopping(exc):
            raise SystemExit(0) from None
        _worker["broken"] = f"{exc}" if isinstance(exc, (AtlasFormatError, OSError)) else f"{exc!r}"


def _report(what: str, n: int) -> None:
    _send(("progress", what, n))


def _run_in_worker(s: int) -> Done:
    if "broken" in _worker:
        return Done(s, _worker["broken"])
    try:
        return _worker["work"](_worker["state"], s, _report)
    except Exception as exc:  # a bug still only fails its shard, in one line
        if _stopping(exc):
            raise SystemExit(0) from None
        return Done(s, f"{exc!r}")


class _Held(logging.Filter):
    """Warnings logged during one call, held until what the call says of itself is known
    (:func:`said_once`)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []
        #: What the call's answer says (a shard's failure line, an exception's words).
        self.said = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:  # -v's lines go on as they come
            return True
        self.records.append(record)
        return False

    def answered(self, answer: Any) -> Any:
        """Note what ``answer`` (a :class:`Done`, an exception, any value) says; returns it."""
        if isinstance(answer, Done):
            self.said = answer.error or ""
        elif isinstance(answer, BaseException):
            self.said = str(answer)
        return answer


@contextlib.contextmanager
def said_once(say: Callable[[logging.LogRecord], Any] | None = None) -> Iterator[_Held]:
    """Hold the warnings logged during a call on a shard (give its answer to the yielded
    :meth:`_Held.answered`); at the end, say those its answer does not say already. A damaged
    tar is then one line, the command's (``export of shard X failed: <why>``), not also the
    pass's warning of the same words (said first, by the worker: two lines for one problem).
    The warnings of a call that did not fail are all said, once it returns: given to ``say``
    (by default, logged here)."""
    held = _Held()
    logger = logging.getLogger("atlasfs")  # every module logs there: a filter on it sees all
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)
        for record in held.records:
            if record.getMessage() not in held.said:
                (say or logger.handle)(record)


def run(source: Source, opener: Opener, setup: Setup, work: Work, shards: Iterable[int], jobs: int | Executor,
        report: Report, running: set[int] | None = None) -> Iterator[Done]:
    """Do ``work`` on each shard position of ``shards`` in ``jobs`` processes (or on the
    executor ``jobs`` is); yields each :class:`Done` as it comes (in shard order in this
    process, else as they finish).
    ``report`` is called in this process with the workers' progress; ``running`` (if given)
    holds the shards under way. Close the iterator (``contextlib.closing``) when leaving
    early: that stops the workers."""
    running = set() if running is None else running
    shards = list(shards)
    executor = executor_of(jobs)
    if not executor.parallel(len(shards)):
        state = setup(source)
        for s in shards:
            running.add(s)
            with said_once() as held:
                try:
                    done = held.answered(work(state, s, report))
                except Exception as exc:
                    done = held.answered(Done(s, f"{exc!r}"))
            running.discard(s)
            yield done
        return
    yield from _run_pool(opener, setup, work, shards, executor, report, running)


def _run_pool(opener: Opener, setup: Setup, work: Work, shards: list[int], executor: Executor, report: Report,
              running: set[int]) -> Iterator[Done]:
    """:func:`run` in processes. A worker that dies (killed, out of memory, a crash in a
    decoder) loses the shard it had: once the others are done, that shard is done again
    alone (no other in flight), and if its worker dies again it fails, :data:`LOST` (at
    once where the executor tried it again already)."""
    todo = collections.deque(shards)
    suspects: list[int] = []
    with executor.pool(len(shards), _init_worker, (opener, setup, work), report) as workers:
        yield from _drive(workers, todo, len(shards), running, suspects)
        for s in suspects:
            if executor.retries_lost:
                yield Done(s, LOST)
                continue
            again: list[int] = []
            yield from _drive(workers, collections.deque([s]), 1, running, again)
            if again:
                yield Done(s, LOST)


def _drive(workers: Pool, todo: collections.deque[int], at_once: int, running: set[int],
           lost: list[int]) -> Iterator[Done]:
    """Shards from ``todo``, ``at_once`` at most under way, until all are answered; those
    whose worker died go in ``lost``."""
    while True:
        while todo and workers.idle() and len(running) < at_once:
            s = todo.popleft()
            running.add(s)
            workers.submit(s, _run_in_worker, s)
        if not running:
            return
        for s, kind, value in workers.wait():
            running.discard(s)
            if kind == "ok":
                yield value
            elif kind == "lost":
                lost.append(s)
            else:
                yield Done(s, f"{value}")
