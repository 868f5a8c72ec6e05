"""Another user's FUSE file system that says its symbolic link is root's (tests/support/forgedfs.c,
built here with gcc against libfuse 3): what ``user_allow_other`` in /etc/fuse.conf lets any
user mount where root can read it."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

from fusemount import IN_CI, force_unmount, is_mounted, require_fuse

SOURCE = Path(__file__).resolve().parent / "forgedfs.c"


def build(folder: Path) -> Path:
    """forgedfs built into ``folder``; a failure in CI (gcc and libfuse3-dev are installed there)."""
    require_fuse()
    gcc, pkg_config = shutil.which("gcc"), shutil.which("pkg-config")
    flags = subprocess.run([pkg_config, "--cflags", "--libs", "fuse3"], capture_output=True, text=True,
                           check=False) if gcc and pkg_config else None
    if flags is None or flags.returncode != 0:
        if IN_CI:
            pytest.fail("gcc, pkg-config or libfuse3-dev missing: forgedfs cannot be built")
        pytest.skip("gcc, pkg-config or libfuse3-dev missing")
    binary = folder / "forgedfs"
    made = subprocess.run([gcc, "-std=gnu11", "-O1", "-Wall", "-Wextra", "-Werror", str(SOURCE), "-o", str(binary),
                           *flags.stdout.split()], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    return binary


@contextlib.contextmanager
def forged_link(binary: Path, mountpoint: Path, name: str, target: str | Path, user: int,
                claimed: int = 0) -> Iterator[Path]:
    """``mountpoint`` mounted as ``user``'s FUSE file system (``allow_other``), whose only entry,
    ``name``, is a symbolic link to ``target`` that says it is ``claimed``'s; yields the link's path."""
    mountpoint.mkdir(parents=True, exist_ok=True)
    server = subprocess.Popen([str(binary), str(mountpoint), name, str(target), str(user), str(claimed)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = server.stdout.readline() if server.stdout else ""
        assert ready.strip() == "ready" and is_mounted(mountpoint), server.stderr.read() if server.stderr else ""
        yield mountpoint / name
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        if is_mounted(mountpoint):
            force_unmount(mountpoint)
