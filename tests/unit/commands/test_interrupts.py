"""Ctrl-C (SIGINT to the process group) and SIGTERM in pack, export, index and verify
(issue #35, points 11 and 12): whatever the moment (the workers starting, importing,
mid-shard), the real command exits within 2 s with status 130 and one line on stderr
saying what it kept, no traceback, no process of its group left; a second Ctrl-C is never
needed, and running the same command again completes it with what an uninterrupted run
writes (pack resumes from the shards it kept)."""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

#: The one line each command says when interrupted (what it kept).
LINES = {
    "pack": r"atlasfs: interrupted: (stopped while counting the source's samples; nothing kept"
            r"|0 of 80 shards packed, nothing kept"
            r"|(?P<n>\d+) of 80 shards packed, kept in \S+\.pack-partial; the same command resumes"
            r"|\S+ was written)",
    "export": r"atlasfs: interrupted: (no tar written|(?P<n>\d+) of 80 tars written in \S+), shards\.json "
              r"(not written; run the same command again to write them all|written)",
    "index": r"atlasfs: interrupted: (no file table stored|(?P<n>\d+) of 80 file tables stored in \S+; "
             r"the same command builds the rest)",
    "verify": r"atlasfs: (interrupted before anything was written|verify interrupted while opening the dataset: "
              r"no problem found so far|verify interrupted after (?P<n>\d+) of 80 shards: no problem found so far)",
}
SHARDS = 80
#: What the last line of a run that finished says.
FINISHED = {"pack": " examples, strategy ", "export": "exported 80 shards",
            "index": "file tables of 80 shards are up to date", "verify": "verify: OK (80 shards"}


def _command() -> list[str]:
    """The installed ``atlasfs`` (what a user runs), else ``python -m atlasfs``."""
    script = Path(sys.executable).parent / "atlasfs"
    return [str(script)] if script.exists() else [sys.executable, "-m", "atlasfs"]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """80 small WebDataset tars of 100 samples each: small, but enough shards that each
    command runs for a second or two."""
    folder = tmp_path_factory.mktemp("interrupts") / "wds"
    folder.mkdir()
    rng = random.Random(35)
    for t in range(SHARDS):
        with tarfile.open(folder / f"shard-{t:03d}.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(100):
                for ext, data in (("txt", f"sample {t} {i}".encode()), ("bin", rng.randbytes(300))):
                    info = tarfile.TarInfo(f"s{t:03d}_{i:03d}.{ext}")
                    info.size, info.mtime = len(data), 0
                    tar.addfile(info, io.BytesIO(data))
    return folder


def _args(command: str, dataset: Path, out: Path, jobs: str | None) -> list[str]:
    args = {"pack": ["pack", str(dataset), str(out)], "export": ["export", str(dataset), str(out)],
            "index": ["index", str(dataset), "--index-dir", str(out)], "verify": ["verify", str(dataset)]}[command]
    return args + (["-j", jobs] if jobs else [])


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _started(pid: int, dataset: Path) -> bool:
    """Whether the command got past its imports: it has a worker, or a file of the dataset open."""
    try:
        if any(open(f).read().strip() for f in Path(f"/proc/{pid}/task").glob("*/children")):
            return True
        return any(os.readlink(fd).startswith(str(dataset)) for fd in Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return False


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


def _interrupt(command: str, dataset: Path, out: Path, jobs: str | None, after: float,
               signum: int = signal.SIGINT) -> tuple[subprocess.CompletedProcess[str] | None, str]:
    """Start the command in a session of its own, send ``signum`` to its group ``after``
    seconds once it started; check what the issue asks and return its line (None: it had
    finished first)."""
    process = subprocess.Popen([*_command(), *_args(command, dataset, out, jobs)], start_new_session=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not _started(process.pid, dataset) and process.poll() is None:
            assert time.monotonic() < deadline, "the command did not start within 30 s"
            time.sleep(0.005)
        time.sleep(after)
        if process.poll() is not None:  # done before the signal: nothing to check
            process.communicate()
            return None, ""
        os.killpg(process.pid, signum)
        sent = time.monotonic()
        try:
            stdout, stderr = process.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{command} -j {jobs}: still running 5 s after {signal.Signals(signum).name}")
        took = time.monotonic() - sent
        gone = _group_gone(process.pid)  # right after it exited: its workers ended before it
    finally:
        if process.poll() is None or not _group_gone(process.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    where = f"{command} -j {jobs} {signal.Signals(signum).name} {after:.2f} s after start"
    assert gone, f"{where}: a process of its group is left"
    if process.returncode in (0, -signum) and stderr == "" and FINISHED[command] in stdout:
        return None, ""  # it had finished as the signal came (at its exit: the default action then)
    assert process.returncode == 130, (where, process.returncode, stderr)
    assert took < 2, f"{where}: exited {took:.2f} s after the signal"
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, (where, stderr)
    lines = stderr.splitlines()
    assert len(lines) == 1, (where, stderr)
    match = re.fullmatch(LINES[command], lines[0])
    assert match, (where, lines[0])
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), match["n"] or "0"


def _no_partial_output(command: str, out: Path) -> None:
    """What the shards in hand had written is gone (pack: the shards finished stay)."""
    kept = out.parent / f".{out.name}.pack-partial"
    for folder in (out, kept):
        if folder.exists():
            left = [p.name for p in folder.rglob("*") if p.name.endswith(".partial")
                    or p.name.startswith((".write-", ".table-"))]
            assert left == [], (command, left)


@pytest.mark.parametrize("jobs", [None, "1"], ids=["j-default", "j1"])
@pytest.mark.parametrize("command", ["pack", "export", "index"])
def test_interrupted_at_any_moment_then_run_again(command: str, jobs: str | None, dataset: Path,
                                                  tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    done = subprocess.run([*_command(), *_args(command, dataset, reference, jobs)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = tmp_path / "out"
    moments = [0.0, 0.05, 0.2, 0.5, 0.9] if jobs is None else [0.0, 0.3, 0.7]
    for after in moments:  # on the same output: each run keeps or drops what the issue says
        result, n = _interrupt(command, dataset, out, jobs, after)
        _no_partial_output(command, out)
        if result is None:
            continue
        if command == "pack":  # the shards said kept are those in the folder
            kept = out.parent / f".{out.name}.pack-partial"
            assert int(n) == (sum((p / "meta.json").is_file() for p in kept.iterdir()) if kept.exists() else 0)
        elif command == "export":
            assert int(n) <= len(list(out.glob("*.tar"))) and not (out / "shards.json").exists()
        else:
            assert int(n) <= len(list(out.glob("*.table")))
    again = subprocess.run([*_command(), *_args(command, dataset, out, jobs)], capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    assert _files(out) == _files(reference)
    assert not (out.parent / f".{out.name}.pack-partial").exists()


@pytest.mark.parametrize("command", ["pack", "export", "index", "verify"])
def test_sigterm_is_an_interrupt_too(command: str, dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    for after in (0.1, 0.6):
        _interrupt(command, dataset, out, None, after, signal.SIGTERM)
        _no_partial_output(command, out)


def test_verify_interrupted_says_how_far_it_got(dataset: Path, tmp_path: Path) -> None:
    reference = subprocess.run([*_command(), "verify", str(dataset)], capture_output=True, text=True, timeout=120)
    assert reference.returncode == 0 and reference.stdout.startswith("verify: OK (80 shards"), reference
    for after in (0.0, 0.1, 0.3, 0.6):
        result, n = _interrupt("verify", dataset, tmp_path, None, after)
        if result is not None:
            assert result.stdout == "" and 0 <= int(n) < SHARDS
    again = subprocess.run([*_command(), "verify", str(dataset)], capture_output=True, text=True, timeout=120)
    assert again.stdout == reference.stdout


_STOPPED_IN_IMPORT = """
import os, signal
if os.environ.get("STOP_ME_IN_IMPORT"):
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # the worker's handler raises SystemExit here
    except SystemExit as exc:  # as numpy's import does: "PyCapsule_Import could not import module"
        raise ImportError("PyCapsule_Import could not import module 'datetime'") from exc


def init():
    pass
"""


def test_a_worker_stopped_while_it_imports_ends_quietly(tmp_path: Path) -> None:
    """SIGTERM reached an `index -j 2` worker while unpickling its initializer imported numpy:
    numpy turned the handler's SystemExit into a 30-line ImportError, printed as the worker's
    traceback above the command's one line (1 run in about 30 with random delays). A worker
    that was asked to stop now ends quietly, whatever the SystemExit became."""
    import multiprocessing.connection
    import pickle

    (tmp_path / "stopped_in_import.py").write_text(_STOPPED_IN_IMPORT)
    sys.path.insert(0, str(tmp_path))
    try:
        import stopped_in_import
        payload = pickle.dumps((stopped_in_import.init, ()))
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("stopped_in_import", None)
    ours, theirs = multiprocessing.Pipe()
    errors = tmp_path / "stderr"
    actions = [(os.POSIX_SPAWN_DUP2, theirs.fileno(), 3), (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
               (os.POSIX_SPAWN_OPEN, 2, str(errors), os.O_WRONLY | os.O_CREAT, 0o600)]
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", "from atlasfs.commands.jobs import _child; _child()"],
                         {**os.environ, "STOP_ME_IN_IMPORT": "1"}, file_actions=actions)
    theirs.close()
    ours.send([str(tmp_path), *sys.path])
    ours.send_bytes(payload)
    status = os.waitpid(pid, 0)[1]
    ours.close()
    err = errors.read_text()
    assert (os.waitstatus_to_exitcode(status), err) == (0, ""), err
