"""Mounting for real in tests: FUSE is required in CI and skipped only elsewhere."""

from __future__ import annotations

import contextlib
import ctypes.util
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"


def fuse_unavailable() -> str | None:
    """Why FUSE cannot be used on this machine, or None."""
    if ctypes.util.find_library("fuse3") is None:
        return "libfuse 3 is not installed (apt-get install fuse3 libfuse3-3)"
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return f"/dev/fuse is not usable: {exc.strerror}"
    return None


def require_fuse() -> None:
    """Skip the test without FUSE, except in CI, where that is a failure."""
    reason = fuse_unavailable()
    if reason:
        if IN_CI:
            pytest.fail(f"FUSE test cannot mount in CI: {reason}")
        pytest.skip(reason)


def atlasfs(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    """Run the ``atlasfs`` command line in a subprocess (under scripts/test-sanitized.sh, with
    the sanitizer runtimes preloaded: its mount daemons are the code under test)."""
    preload = os.environ.get("ATLASFS_TEST_DAEMON_PRELOAD")
    if preload:
        kwargs["env"] = {**(kwargs.get("env") or os.environ), "LD_PRELOAD": preload}
    return subprocess.run([sys.executable, "-m", "atlasfs", *args], capture_output=True, text=True,
                          timeout=kwargs.pop("timeout", 120), **kwargs)


def is_mounted(path: str | Path) -> bool:
    """True if ``path`` is a mount point (per /proc/self/mountinfo)."""
    target = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


def wait_mounted(process: subprocess.Popen[str], mnt: str | Path, timeout: float = 30) -> None:
    """Wait until the foreground daemon ``process`` has mounted ``mnt``; fail the test if it
    exits first (with its stderr) or takes longer than ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not is_mounted(mnt):
        assert process.poll() is None, f"the daemon exited: {process.communicate()[1]}"
        assert time.monotonic() < deadline, f"not mounted within {timeout:g} s"
        time.sleep(0.02)


def force_unmount(path: str | Path) -> None:
    """Unmount ``path`` whatever its state, and wait until it is gone."""
    for command in (["fusermount3", "-u", str(path)], ["fusermount3", "-uz", str(path)]):
        if not is_mounted(path):
            return
        subprocess.run(command, capture_output=True)
    deadline = time.monotonic() + 10
    while is_mounted(path) and time.monotonic() < deadline:
        time.sleep(0.05)


@contextlib.contextmanager
def mounted(dataset: str | Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Path]:
    """Mount ``dataset`` with ``atlasfs mount`` (background mode) for the duration;
    ``env`` adds to the daemon's environment."""
    require_fuse()
    mountpoint = Path(tempfile.mkdtemp(prefix="atlasfs-test-mnt-"))
    result = atlasfs("mount", str(dataset), str(mountpoint), *args, env={**os.environ, **(env or {})})
    try:
        assert result.returncode == 0, f"mount failed: {result.stderr}"
        assert is_mounted(mountpoint)
        yield mountpoint
    finally:
        force_unmount(mountpoint)
        mountpoint.rmdir()


def engine_answered(line: str) -> dict[str, tuple[int, int]]:
    """The counts of the native engine's log line as it ends ("native engine answered lookup
    N in C, M in Python, ..."): kind -> (answered in C, in Python)."""
    return {kind: (int(c), int(python)) for kind, c, python in re.findall(r"(\w+) (\d+) in C, (\d+) in Python", line)}


def engine_answered_in_log(log: Path) -> dict[str, tuple[int, int]]:
    """What the native engine says it answered, in C and in Python, per kind (logged as the
    daemon ends: waited for)."""
    deadline = time.monotonic() + 20
    while True:
        lines = [line for line in log.read_text().splitlines() if "native engine answered" in line] \
            if log.exists() else []
        if lines or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert lines, f"the daemon did not say what it answered: {log.read_text() if log.exists() else 'no log'}"
    return engine_answered(lines[-1])


#: What a daemon holds besides its cache (Python, numpy, libfuse, the tree): measured ~70 MiB.
DAEMON_OVERHEAD = 100 << 20


def proc_status(pid: int, field: str) -> int:
    """A byte count of /proc/PID/status (VmRSS, VmHWM...)."""
    text = Path(f"/proc/{pid}/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert found, text
    return int(found.group(1)) * 1024

