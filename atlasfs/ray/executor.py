"""The Ray executor of the commands that work shard by shard (``--ray``): one Ray task per
shard, on an existing cluster or on a local one started for the command.

The command line imports this module only when ``--ray`` is given
(:func:`~atlasfs.commands.jobs.executor_from_args`), so atlasfs without Ray runs everywhere
else. A task does what a :class:`~atlasfs.commands.jobs.Workers` process does with one call:
the pool's initializer (opening the dataset...) runs once per Ray worker process and pool,
kept for the next task of the same pool that lands there; the call's answer comes back as a
value (``("ok", value)`` or ``("error", exception)``), so a bad shard is one answer, never
retried (``retry_exceptions=False``). A task whose worker process or node died is retried by
Ray (:data:`MAX_RETRIES`), then reported lost once. Progress within a shard reaches the
driver through a small actor drained as the driver waits.

Ctrl-C: the tasks under way are cancelled (their workers killed: a write in hand leaves
only its ``.partial``, which the command removes), and a local cluster started for the
command is killed with its processes, so the command ends within the interrupt deadline.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Callable
from typing import Any

import ray
import ray.exceptions

from atlasfs.commands import interrupts, jobs

log = logging.getLogger("atlasfs")

#: Times Ray runs a task again whose worker process or node died (never for an exception).
MAX_RETRIES = 3
#: What ends a task without its answer: its worker or node was lost (retries spent).
_LOST = (ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError,
         ray.exceptions.OwnerDiedError, ray.exceptions.TaskCancelledError, ray.exceptions.LocalRayletDiedError,
         getattr(ray.exceptions, "OutOfMemoryError", ray.exceptions.WorkerCrashedError))


def connect(address: str | None) -> bool:
    """Join the cluster at ``address``, or start a local one (no address); True if started
    here. Ray's start-up messages are kept off the terminal; the command's signal handlers
    are kept (Ray installs its own)."""
    if ray.is_initialized():
        return False
    if address is not None:
        _reachable(address)
    kept = {sig: signal.getsignal(sig) for sig in interrupts.SIGNALS}
    try:
        with interrupts.deferred():
            local = {"num_cpus": jobs.default_jobs(), "include_dashboard": False} if address is None else {}
            # "local": a new cluster even where one runs on this machine already (Ray would join
            # that one, and refuse num_cpus with a ValueError): --ray auto joins it
            ray.init(address=address or "local", logging_level=logging.ERROR, log_to_driver=False, **local)
    finally:
        for sig, handler in kept.items():
            signal.signal(sig, handler)
    return address is None


#: Seconds to reach a cluster's head before saying it cannot be reached (Ray itself retries
#: for minutes, printing its own warnings).
CONNECT_SECONDS = 5


def _reachable(address: str) -> None:
    """Raise :class:`~atlasfs.options.OptionError` (one line) if ``host:port`` does not
    answer within :data:`CONNECT_SECONDS`; other forms (``ray://``, ``auto``) are Ray's."""
    host, _, port = address.rpartition(":")
    if not host or "/" in host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_SECONDS).close()
    except OSError as exc:
        from atlasfs.options import OptionError
        raise OptionError(f"--ray {address}: no Ray cluster answers there ({exc.strerror or exc}); "
                          "start one with `ray start --head`, or give its head's host:port") from None


def _descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (a local cluster's servers, agents and workers)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in os.listdir(f"/proc/{parent}/task") if os.path.isdir(f"/proc/{parent}/task") else []:
            with contextlib.suppress(OSError), open(f"/proc/{parent}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
                found.extend(children)
                todo.extend(children)
    return found


class RayExecutor(jobs.Executor):
    """Ray tasks on the cluster at ``address`` (a local one started for the command when
    None); ``jobs`` caps the tasks under way (default: the cluster's CPUs)."""

    retries_lost = True

    def __init__(self, address: str | None, jobs_: int | None = None) -> None:
        self.started = connect(address)
        resources = ray.cluster_resources()
        cpus = max(1, int(resources.get("CPU", 1)))
        self.size = max(1, jobs_) if jobs_ else cpus
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        self.per_machine = max([int(n.get("Resources", {}).get("CPU", 1)) for n in nodes] or [1])
        if self.started:
            atexit.register(self.shutdown)

    def parallel(self, items: int) -> bool:
        return True  # the data may be reachable from the cluster's nodes only

    def pool(self, items: int, initializer: Callable[..., None], initargs: tuple[Any, ...],
             on_message: Callable[..., None] | None = None) -> RayPool:
        return RayPool(self, min(self.size, max(1, items)), initializer, initargs, on_message)

    def kill(self) -> None:
        """Kill a local cluster started for the command at once (interrupted): its processes
        are this one's descendants, its agents too (Ray's own shutdown takes seconds and
        leaves its agents behind when the driver ends first)."""
        if not self.started:
            return
        pids = _descendants(os.getpid())
        interrupts.children.update(pids)  # the deadline's watchdog kills them too
        interrupts.kill_all(set(pids))

    def shutdown(self) -> None:
        """Leave the cluster (a local one started for the command ends with it). At exit.
        Interrupted, a local cluster is killed and the process ends here with the interrupt's
        status: Ray's own shutdown (its exit handler, next) waits a second and more for the
        processes it started, past the interrupt's deadline."""
        if not ray.is_initialized():
            return
        if interrupts.signalled() is not None and self.started:
            self.kill()
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            os._exit(interrupts.STATUS)
        with contextlib.suppress(Exception):
            ray.shutdown()


def _progress_actor() -> Any:
    @ray.remote(num_cpus=0)
    class Progress:
        """Messages of a pool's tasks (progress within a shard) until the driver takes them."""

        def __init__(self) -> None:
            self.messages: list[Any] = []

        def put(self, message: Any) -> None:
            self.messages.append(message)

        def take(self) -> list[Any]:
            messages, self.messages = self.messages, []
            return messages
    return Progress.remote()


#: A Ray worker process's pool state: the key of the pool whose initializer ran in it.
_ran: dict[str, Any] = {}


def _call(key: str, setup: tuple[Callable[..., None], tuple[Any, ...]], func: Callable[[Any], Any], arg: Any,
          progress: Any) -> tuple[str, Any, str, list[tuple[int, str]]]:
    """One call in a Ray worker process: the pool's initializer first if it has not run
    here, then ``func(arg)``; an exception is the answer, never a task failure. The answer
    names the node it ran on, and carries the warnings the call logged (level, message) that
    it does not say itself: a worker's log goes to Ray's files, not the user's terminal."""
    jobs._sender = (lambda message: progress.put.remote(message)) if progress is not None else (lambda message: None)
    node = ray.get_runtime_context().get_node_id()
    warnings: list[tuple[int, str]] = []
    with jobs.said_once(lambda record: warnings.append((record.levelno, record.getMessage()))) as held:
        try:
            if _ran.get("key") != key:
                _ran.clear()
                initializer, initargs = setup
                initializer(*initargs)
                _ran["key"] = key
            answer: tuple[str, Any] = ("ok", held.answered(func(arg)))
        except Exception as exc:  # noqa: BLE001 (the call's answer, as a Workers process sends it)
            answer = ("error", held.answered(exc))
    return (*answer, node, warnings)


_remote_call = ray.remote(max_retries=MAX_RETRIES, retry_exceptions=False, num_cpus=1)(_call)


class RayPool(jobs.Pool):
    """:class:`~atlasfs.commands.jobs.Pool` of Ray tasks: ``size`` at most under way."""

    def __init__(self, executor: RayExecutor, size: int, initializer: Callable[..., None],
                 initargs: tuple[Any, ...], on_message: Callable[..., None] | None = None) -> None:
        self.executor, self.size = executor, size
        self._key = uuid.uuid4().hex
        self._setup = ray.put((initializer, initargs))  # once into the object store, not once a task
        self._on_message = on_message
        self._progress = _progress_actor() if on_message is not None else None
        self._refs: dict[Any, Any] = {}
        #: Tasks answered on each node (by node id): logged at the end with -v.
        self.nodes: collections.Counter[str] = collections.Counter()

    def idle(self) -> bool:
        """Whether :meth:`submit` can start a task now."""
        return len(self._refs) < self.size

    def busy(self) -> list[Any]:
        """The tags of the tasks under way."""
        return list(self._refs.values())

    def submit(self, tag: Any, func: Callable[[Any], Any], arg: Any) -> None:
        """Start ``func(arg)`` as a task; its answer comes back from :meth:`wait` with ``tag``."""
        ref = _remote_call.remote(self._key, self._setup, func, arg, self._progress)
        self._refs[ref] = tag

    def wait(self, timeout: float = jobs.POLL_SECONDS) -> list[tuple[Any, str, Any]]:
        """Answers that came within ``timeout`` seconds, as
        :meth:`~atlasfs.commands.jobs.Workers.wait` gives them."""
        if not self._refs:
            return []
        ready, _ = ray.wait(list(self._refs), num_returns=len(self._refs), timeout=timeout)
        self._drain()
        answers = []
        for ref in ready:
            tag = self._refs.pop(ref)
            try:
                kind, value, node, warnings = ray.get(ref)
                self.nodes[node] += 1
                for level, message in warnings:  # said here, as a local worker's are
                    log.log(level, "%s", message)
            except _LOST:
                kind, value = "lost", None
            except ray.exceptions.RayError as exc:  # the task could not run (its arguments did not unpickle...)
                kind, value = "error", RuntimeError(str(exc).strip().splitlines()[-1])
            answers.append((tag, kind, value))
        return answers

    def _drain(self) -> None:
        if self._progress is None or self._on_message is None:
            return
        with contextlib.suppress(ray.exceptions.RayError):
            for message in ray.get(self._progress.take.remote()):
                self._on_message(*message[1:])

    def close(self) -> None:
        """Once every answer came: the last progress, and the actor goes."""
        self._drain()
        self._end()
        if self.nodes:
            log.debug("Ray: %d tasks on %d node(s): %s", sum(self.nodes.values()), len(self.nodes),
                      ", ".join(f"{node} {n}" for node, n in sorted(self.nodes.items())))

    def stop(self) -> None:
        """Cancel the tasks under way (their workers killed) now."""
        with interrupts.deferred():
            for ref in list(self._refs):
                with contextlib.suppress(Exception):
                    ray.cancel(ref, force=True)
            self._refs.clear()
            if interrupts.signalled() is not None:
                self.executor.kill()
            self._end()

    def _end(self) -> None:
        if self._progress is not None:
            with contextlib.suppress(Exception):
                ray.kill(self._progress)
            self._progress = None
