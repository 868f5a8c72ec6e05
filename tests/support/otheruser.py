"""Running atlasfs as another user (``nobody``) in tests, without changing the machine.

The commands run in a private mount namespace (``unshare --mount``), as root
until ``setpriv`` drops to ``nobody`` with no extra groups. Inside it, and only
there: folders on the way to the interpreter, the repository or the test's
folder that other users may not enter (``/root`` holding a pyenv Python, say)
are covered by a tmpfs showing only the one entry needed, bound from the
original; and ``/dev/fuse`` can be replaced by a copy of the device with
other permission bits. Everything goes when the namespace's last process does.
Needs root, ``unshare`` and ``setpriv`` (util-linux): without them a test
fails under ``CI=true`` and is skipped elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from fusemount import IN_CI
from helpers import REPO

NOBODY = pwd.getpwnam("nobody")


def require_root() -> None:
    """Skip the test unless it can switch users (root, unshare, setpriv); in CI, fail."""
    missing = [tool for tool in ("unshare", "setpriv") if shutil.which(tool) is None]
    reason = "needs root to run commands as another user" if os.geteuid() != 0 else (
        f"needs {', '.join(missing)} (util-linux)" if missing else None)
    if reason:
        if IN_CI:
            pytest.fail(f"cannot run as another user in CI: {reason}")
        pytest.skip(reason)


@contextlib.contextmanager
def shared_folder() -> Iterator[Path]:
    """A temporary folder (0755) other users can read; removed afterwards."""
    require_root()
    folder = Path(tempfile.mkdtemp(prefix="atlasfs-test-shared-"))
    try:
        folder.chmod(0o755)
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def nobody_folder(path: Path) -> Path:
    """Make folder ``path``, owned by ``nobody`` (its cache, mount points, logs)."""
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    return path


def _closed_ancestors(paths: list[str]) -> dict[str, set[str]]:
    """Folders on the way to ``paths`` that other users may not enter -> the entries wanted in each."""
    closed: dict[str, set[str]] = {}
    for path in paths:
        parts = Path(os.path.realpath(path)).parts
        for depth in range(1, len(parts) - 1):
            folder = os.path.join(*parts[:depth])
            if not os.stat(folder).st_mode & 0o001:
                closed.setdefault(folder, set()).add(parts[depth])
    return closed


def _prologue(scratch: Path, fuse_mode: int | None) -> list[str]:
    """The namespace's set-up, run as root: open closed folders, replace /dev/fuse."""
    q = shlex.quote
    lines = ["set -e"]
    wanted = [os.path.realpath(sys.executable), sys.prefix, sys.base_prefix, str(REPO), str(scratch)]
    for n, (folder, entries) in enumerate(sorted(_closed_ancestors(wanted).items())):
        original = scratch / f"closed{n}"
        lines += [f"mkdir -p {q(str(original))}", f"mount --bind {q(folder)} {q(str(original))}",
                  f"mount -t tmpfs -o mode=0755 atlasfs-test {q(folder)}"]
        for entry in sorted(entries):
            target = os.path.join(folder, entry)
            kind = "mkdir" if os.path.isdir(target) else "touch"
            lines += [f"{kind} {q(target)}", f"mount --bind {q(str(original / entry))} {q(target)}"]
    if fuse_mode is not None:
        device = os.stat("/dev/fuse").st_rdev
        dev = scratch / "dev"
        lines += [f"mkdir -p {q(str(dev))}", f"mount -t tmpfs -o mode=0755 atlasfs-test-dev {q(str(dev))}",
                  f"mknod -m {fuse_mode:o} {q(str(dev / 'fuse'))} c {os.major(device)} {os.minor(device)}",
                  f"mount --bind {q(str(dev / 'fuse'))} /dev/fuse"]
    return lines


def run_as_nobody(script: str, scratch: Path, *, fuse_mode: int | None = None, env: dict[str, str] | None = None,
                  timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run shell ``script`` as ``nobody`` in a private mount namespace; ``scratch``: a root-owned
    folder for the namespace's own mounts; ``fuse_mode``: the permission bits of the
    ``/dev/fuse`` it sees (None: the machine's). ``$PYTHON`` in the script is this interpreter."""
    require_root()
    scratch.mkdir(mode=0o700, parents=True, exist_ok=True)
    home = env.get("HOME", "/nonexistent") if env else "/nonexistent"
    environment = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": home, "LANG": "C.UTF-8",
                   "PYTHON": sys.executable, "PYTHONDONTWRITEBYTECODE": "1", **(env or {})}
    setup = "\n".join(_prologue(scratch, fuse_mode))
    drop = ["setpriv", f"--reuid={NOBODY.pw_uid}", f"--regid={NOBODY.pw_gid}", "--clear-groups",
            "env", "-i", *(f"{k}={v}" for k, v in environment.items()), "sh", "-c", script]
    command = ["unshare", "--mount", "sh", "-c", f"{setup}\nexec {shlex.join(drop)}"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, cwd="/")
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # the script and anything it left running
        out, err = process.communicate()
        pytest.fail(f"ran over {timeout} s as nobody: {out}\n{err}")
    return subprocess.CompletedProcess(command, process.returncode, out, err)
