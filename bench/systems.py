"""The systems the benchmarks compare: atlasfs (``atlasfs mount -f`` of a dataset, local or in a
bucket), tmpfs (the same files materialized in /dev/shm: the physical limit), ratarmount (a FUSE
mount of the exported WebDataset tars: the peer) and a served tree (any :class:`Tree` through
atlasfs's own engine: the floor's do-nothing tree).

Each system gives :class:`View` objects through :meth:`System.session`, a context manager that
mounts freshly (a new daemon, so nothing of an earlier mount is in memory) and always unmounts
and stops the daemon on the way out, whatever happened. The daemons are started here with
``subprocess.Popen`` in the foreground, so the benchmark owns their pids (for peak RSS and for
stopping them), and nothing is dropped from any cache system-wide.
"""

from __future__ import annotations

import contextlib
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
RATARMOUNT_REQUIREMENTS = os.path.join(BENCH_DIR, "requirements-ratarmount.txt")
DEFAULT_RATARMOUNT_VENV = os.path.join(BENCH_DIR, ".venv-ratarmount")
#: How long a mount may take to come up before the benchmark gives up on it.
MOUNT_TIMEOUT = 120.0


def host() -> str:
    """This machine, for a report's header: cores, memory, kernel, Python."""
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        mem = 0.0
    return (f"{os.cpu_count()} cores, {mem:.0f} GiB, Linux {platform.release()}, "
            f"Python {platform.python_version()}")


def stop_on_signals() -> None:
    """Make SIGTERM and SIGHUP raise KeyboardInterrupt, so that a stopped benchmark unmounts on its way out."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)


class SystemUnavailable(Exception):
    """A system cannot be measured here (the reason is reported in place of its figures)."""


@dataclass
class View:
    """One dataset as seen through one system: where its shard folders are."""

    system: str
    root: str
    shard_dirs: dict[str, str]
    pid: int | None = None
    mount_seconds: float | None = None

    def path(self, relative: str) -> str:
        """The absolute path of ``<shard>/<file>`` (a path relative to the materialized folder)."""
        shard, _, rest = relative.partition("/")
        return os.path.join(self.shard_dirs[shard], rest)

    def peak_rss(self) -> int | None:
        """The daemon's peak resident set size (VmHWM) in bytes, None without a daemon."""
        if self.pid is None:
            return None
        return peak_rss(self.pid)


def rss(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of process ``pid`` in bytes: its resident set now and at its peak."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                values[line[:5]] = int(line.split()[1]) * 1024
    return values["VmRSS"], values["VmHWM"]


def peak_rss(pid: int) -> int | None:
    """VmHWM of process ``pid`` in bytes (None if it is gone)."""
    try:
        return rss(pid)[1]
    except (OSError, KeyError):
        return None


def is_mounted(path: str) -> bool:
    """True if ``path`` is a mount point, per /proc/self/mountinfo (never touches the mount)."""
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")
            if point == target:
                return True
    return False


def unmount(mountpoint: str, process: subprocess.Popen[bytes] | None) -> None:
    """Unmount ``mountpoint`` and stop the daemon ``process``, however stuck; never raises."""
    try:
        for command in (["fusermount3", "-u", mountpoint], ["fusermount3", "-uz", mountpoint]):
            if not is_mounted(mountpoint):
                break
            subprocess.run(command, capture_output=True, check=False, timeout=30)
            deadline = time.monotonic() + 5
            while is_mounted(mountpoint) and time.monotonic() < deadline:
                time.sleep(0.02)
        if process is not None:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=5)
        if is_mounted(mountpoint):  # the daemon died: detach what is left
            subprocess.run(["fusermount3", "-uz", mountpoint], capture_output=True, check=False, timeout=30)
    finally:
        with contextlib.suppress(OSError):
            os.rmdir(mountpoint)


def _wait(process: subprocess.Popen[bytes], ready: Callable[[], bool], what: str, log_path: str) -> None:
    deadline = time.monotonic() + MOUNT_TIMEOUT
    while True:
        if ready():
            return
        code = process.poll()
        if code is not None:
            raise RuntimeError(f"{what} exited with {code} before the mount was ready: {_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {MOUNT_TIMEOUT:.0f} s: {_tail(log_path)}")
        time.sleep(0.001)


def _tail(path: str, lines: int = 5) -> str:
    try:
        with open(path, errors="replace") as f:
            return " | ".join(f.read().strip().splitlines()[-lines:]) or "(no output)"
    except OSError:
        return "(no log)"


class System:
    """A way of presenting a dataset's files."""

    name = "?"

    def session(self, fresh_metadata: bool = False) -> contextlib.AbstractContextManager[View]:
        """A fresh mount; with ``fresh_metadata``, also without stored file tables or index."""
        raise NotImplementedError

    def prepare_metadata(self) -> None:
        """Build the stored file tables / index that later mounts reuse."""


class Tmpfs(System):
    """The materialized folder on /dev/shm, read by the same commands: the physical limit."""

    name = "tmpfs"

    def __init__(self, folder: str, shards: list[str]) -> None:
        self.folder = folder
        self.shards = shards

    @contextlib.contextmanager
    def session(self, fresh_metadata: bool = False) -> Iterator[View]:
        yield View(self.name, self.folder, {s: os.path.join(self.folder, s) for s in self.shards})


class Atlasfs(System):
    """``atlasfs mount -f`` of the Atlas dataset, started here so that its pid is ours."""

    name = "atlasfs"

    def __init__(self, dataset: str, shards: list[str], workdir: str, extra_args: list[str] | None = None) -> None:
        self.dataset = dataset if "://" in dataset else os.path.abspath(dataset)
        self.shards = shards
        self.workdir = workdir
        self.extra_args = extra_args or []
        # Mounts store shard file tables under $XDG_CACHE_HOME (atlasfs index writes them
        # beside the dataset): point that into the work folder so that both places are ours
        # to clear.
        self.cache_home = os.path.join(workdir, "xdg-cache")
        self.env = dict(os.environ, XDG_CACHE_HOME=self.cache_home)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "atlasfs"]

    def clear_metadata(self) -> None:
        """Remove every stored file table (beside a local dataset and in the user cache)."""
        if "://" not in self.dataset:
            shutil.rmtree(os.path.join(self.dataset, ".atlasfs-tables"), ignore_errors=True)
        shutil.rmtree(self.cache_home, ignore_errors=True)

    def prepare_metadata(self) -> None:
        """``atlasfs index``: build and store every shard's file table ahead of the mounts."""
        result = subprocess.run([*self.command(), "index", self.dataset], capture_output=True, check=False, text=True,
                                env=self.env)
        if result.returncode != 0:  # an atlasfs without the index command: a mount that lists every shard does it
            with self.session() as view:
                for folder in view.shard_dirs.values():
                    os.listdir(folder)

    @contextlib.contextmanager
    def session(self, fresh_metadata: bool = False) -> Iterator[View]:
        if fresh_metadata:
            self.clear_metadata()
        os.makedirs(os.path.join(self.workdir, "mnt"), exist_ok=True)
        mountpoint = tempfile.mkdtemp(prefix="atlasfs-", dir=os.path.join(self.workdir, "mnt"))
        log_path = mountpoint + ".log"
        process = None
        try:
            with open(log_path, "ab") as log:
                start = time.perf_counter()
                process = subprocess.Popen([*self.command(), "mount", "-f", *self.extra_args, self.dataset, mountpoint],
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env)
                _wait(process, lambda: os.path.ismount(mountpoint), "atlasfs mount -f", log_path)
                seconds = time.perf_counter() - start
            yield View(self.name, mountpoint, {s: os.path.join(mountpoint, s) for s in self.shards},
                       pid=process.pid, mount_seconds=seconds)
        finally:
            unmount(mountpoint, process)


class Ratarmount(System):
    """ratarmount over every exported shard tar at once (``--disable-union-mount``: one
    folder per tar, named after it), from its own virtualenv; index files kept in the work
    folder."""

    name = "ratarmount"

    def __init__(self, executable: str, tars: str, shards: list[str], workdir: str) -> None:
        self.executable = executable
        self.tar_paths = [os.path.join(os.path.abspath(tars), f"{s}.tar") for s in shards]
        self.shards = shards
        self.workdir = workdir
        self.index_folder = os.path.join(workdir, "ratarmount-index")

    def clear_metadata(self) -> None:
        """Remove the stored .index.sqlite files (ratarmount then indexes the tars at mount)."""
        shutil.rmtree(self.index_folder, ignore_errors=True)
        for path in self.tar_paths:  # never written there, but make sure no index beside the tars is used
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path + ".index.sqlite")

    def prepare_metadata(self) -> None:
        """A first mount builds and stores the index of every tar."""
        with self.session():
            pass

    @contextlib.contextmanager
    def session(self, fresh_metadata: bool = False) -> Iterator[View]:
        if fresh_metadata:
            self.clear_metadata()
        os.makedirs(self.index_folder, exist_ok=True)
        os.makedirs(os.path.join(self.workdir, "mnt"), exist_ok=True)
        mountpoint = tempfile.mkdtemp(prefix="ratarmount-", dir=os.path.join(self.workdir, "mnt"))
        log_path = mountpoint + ".log"
        process = None

        def lists() -> bool:
            if not os.path.ismount(mountpoint):
                return False
            try:
                return bool(os.listdir(mountpoint))
            except OSError:
                return False

        try:
            with open(log_path, "ab") as log:
                start = time.perf_counter()
                process = subprocess.Popen(
                    [self.executable, "-f", "--disable-union-mount", "--index-folders", self.index_folder,
                     *self.tar_paths, mountpoint],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=log)
                _wait(process, lists, "ratarmount -f", log_path)
                seconds = time.perf_counter() - start
            yield View(self.name, mountpoint, self._shard_dirs(mountpoint), pid=process.pid, mount_seconds=seconds)
        finally:
            unmount(mountpoint, process)

    def _shard_dirs(self, mountpoint: str) -> dict[str, str]:
        if len(self.shards) == 1:  # a single archive is mounted at the root
            return {self.shards[0]: mountpoint}
        found = {}
        for shard in self.shards:
            for name in (f"{shard}.tar", shard):
                if os.path.isdir(os.path.join(mountpoint, name)):
                    found[shard] = os.path.join(mountpoint, name)
                    break
            else:
                raise RuntimeError(f"ratarmount: no folder for shard {shard} in {sorted(os.listdir(mountpoint))}")
        return found


class ServedTree(System):
    """A :class:`Tree` (``module:callable(*args)``) served in a fresh process through atlasfs's own
    engine and mount options (:func:`bench._atlasfs.serve_tree`): the floor's do-nothing tree.
    The mount is ready once ``serve``'s ``on_ready`` ran (the mount answers and its read-ahead
    is set, as ``atlasfs mount`` waits for)."""

    def __init__(self, name: str, factory: str, args: list[int], shards: list[str], workdir: str) -> None:
        self.name = name
        self.factory = factory
        self.args = args
        self.shards = shards
        self.workdir = workdir

    @contextlib.contextmanager
    def session(self, fresh_metadata: bool = False) -> Iterator[View]:
        os.makedirs(os.path.join(self.workdir, "mnt"), exist_ok=True)
        mountpoint = tempfile.mkdtemp(prefix=f"{self.name}-", dir=os.path.join(self.workdir, "mnt"))
        log_path, ready = mountpoint + ".log", mountpoint + ".ready"
        code = ("import sys\n"
                f"sys.path.insert(0, {os.path.dirname(BENCH_DIR)!r})\n"
                "from bench._atlasfs import serve_tree\n"
                f"serve_tree({self.factory!r}, {self.args!r}, {mountpoint!r}, lambda: open({ready!r}, 'w').close())\n")
        process = None
        try:
            with open(log_path, "ab") as log:
                start = time.perf_counter()
                process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=log,
                                           stderr=log)
                _wait(process, lambda: os.path.exists(ready) and is_mounted(mountpoint), self.name, log_path)
                seconds = time.perf_counter() - start
            yield View(self.name, mountpoint, {s: os.path.join(mountpoint, s) for s in self.shards},
                       pid=process.pid, mount_seconds=seconds)
        finally:
            unmount(mountpoint, process)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(ready)


# -- ratarmount's own virtualenv


def requirement_lines(path: str) -> str:
    """The requirement lines of the requirements file ``path`` (comments and blank lines left out)."""
    with open(path) as f:
        return "".join(line for line in f if line.strip() and not line.lstrip().startswith("#")).strip()


def ratarmount_requirement() -> str:
    """The pinned requirement line(s) of the benchmark's ratarmount."""
    return requirement_lines(RATARMOUNT_REQUIREMENTS)


def ensure_venv(venv: str, requirements: str, executable: str, what: str, log: Callable[[str], None],
                install: bool = True) -> None:
    """Make sure the virtualenv ``venv`` holds the requirements file ``requirements``: made anew
    and installed from PyPI (if ``install``) when its stamp names other requirements or
    ``executable`` is missing. ``what`` names it in messages. Raises :class:`SystemUnavailable`
    with the reason otherwise."""
    stamp = os.path.join(venv, ".bench-requirements")
    wanted = requirement_lines(requirements)
    try:
        with open(stamp) as f:
            installed = f.read()
    except OSError:
        installed = None
    if installed == wanted and os.access(executable, os.X_OK):
        return
    if not install:
        raise SystemUnavailable(f"{what} is not installed in {venv} (run without --no-install)")
    log(f"installing {wanted.replace(chr(10), ' ')} into {venv} (benchmark-only dependency)")
    shutil.rmtree(venv, ignore_errors=True)
    steps = [[sys.executable, "-m", "venv", venv],
             [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--quiet",
              "--disable-pip-version-check", "-r", requirements]]
    for step in steps:
        try:
            result = subprocess.run(step, capture_output=True, check=False, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SystemUnavailable(f"cannot install {what}: {' '.join(step[:3])}...: {exc}") from None
        if result.returncode != 0:
            detail = (result.stderr.strip() or result.stdout.strip()).splitlines()
            raise SystemUnavailable(f"cannot install {what} ({' '.join(step[:4])}... exited "
                                    f"{result.returncode}): {detail[-1] if detail else 'no output'}")
    with open(stamp, "w") as f:
        f.write(wanted)


def ensure_ratarmount(venv: str, log: Callable[[str], None], install: bool = True) -> tuple[str, str]:
    """The ratarmount executable of ``venv`` and its version, installing it there from PyPI when
    missing (``install``). Raises :class:`SystemUnavailable` with the reason otherwise."""
    executable = os.path.join(venv, "bin", "ratarmount")
    ensure_venv(venv, RATARMOUNT_REQUIREMENTS, executable, "ratarmount", log, install)
    result = subprocess.run([executable, "--version"], capture_output=True, check=False, text=True)
    if result.returncode != 0:
        raise SystemUnavailable(f"{executable} --version failed: {result.stderr.strip()[-200:]}")
    first = result.stdout.strip().splitlines()[0] if result.stdout.strip() else "ratarmount ?"
    return executable, first
