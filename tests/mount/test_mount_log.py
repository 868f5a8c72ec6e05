"""Where a mount's log goes, and the problems ``atlasfs mount`` prints before it returns
(the log's names, rotation and the ready pipe alone: tests/unit/fuse/test_daemonlog.py)."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from atlasfs.fuse import daemonlog
from atlasfs.fuse.daemonlog import SHOWN_PROBLEMS, log_name
from fusemount import IN_CI, atlasfs, force_unmount, is_mounted, require_fuse
from helpers import REFERENCE


GOOD = REFERENCE / "s2_shared_dict" / "dataset"


def no_syslog(tmp_path: Path) -> dict[str, str]:
    """An environment in which the daemon finds no syslog and keeps its log under ``tmp_path/state``."""
    return {**os.environ, "XDG_STATE_HOME": str(tmp_path / "state"),
            daemonlog.SYSLOG_SOCKET_ENV: str(tmp_path / "no-syslog-here")}


def state_log(tmp_path: Path, mnt: Path) -> Path:
    return tmp_path / "state" / "atlasfs" / log_name(str(mnt))


def test_no_syslog_logs_to_a_state_file_and_says_where(tmp_path: Path) -> None:
    require_fuse()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = atlasfs("mount", str(GOOD), str(mnt), env=no_syslog(tmp_path))
    try:
        assert result.returncode == 0, result.stderr
        log = state_log(tmp_path, mnt)
        assert result.stderr == f"atlasfs: logging to {log}\n"
        assert sorted(os.listdir(mnt)) == ["0", "1", "2"]
        assert f"mounted {GOOD} at {mnt}" in log.read_text()
        assert stat.S_IMODE(os.stat(log.parent).st_mode) == 0o700
    finally:
        force_unmount(mnt)


def test_with_syslog_the_log_goes_there_and_mount_says_nothing(tmp_path: Path) -> None:
    require_fuse()
    short = Path(tempfile.mkdtemp(prefix="atlasfs-syslog-"))  # a socket's path must be short
    syslog = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    syslog.bind(str(short / "log"))
    syslog.settimeout(30)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {**no_syslog(tmp_path), daemonlog.SYSLOG_SOCKET_ENV: str(short / "log")}
    result = atlasfs("mount", str(GOOD), str(mnt), env=env)
    try:
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""
        assert f"mounted {GOOD} at {mnt}" in syslog.recv(4096).decode()
        assert not (tmp_path / "state").exists()
    finally:
        force_unmount(mnt)
        syslog.close()
        shutil.rmtree(short)


def _without_dac(command: list[str]) -> list[str]:
    """``command`` run without root's power to read any file (so chmod 000 keeps it out)."""
    if os.geteuid() != 0:
        return command
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        if IN_CI:
            pytest.fail("setpriv (util-linux) is needed to read as root without CAP_DAC_OVERRIDE")
        pytest.skip("setpriv is not installed")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", *command]


def _damage(data: Path, kind: str) -> str:
    """Damage a shard's ``data.bin`` as ``kind`` says; returns what the mount's line says of it."""
    if kind == "no permission":
        data.chmod(0)
        return f"{data}: cannot be read (Permission denied)"
    if kind == "truncated":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size - 1)
        return f"{data}: "
    if kind == "missing":
        data.unlink()
        return f"{data}: missing"
    data.unlink()
    data.mkdir()
    return f"{data}: "


@pytest.mark.parametrize("kind", ["no permission", "truncated", "missing", "a folder"])
def test_a_bad_shard_is_printed_by_mount_and_kept_in_the_log(tmp_path: Path, kind: str) -> None:
    require_fuse()
    dataset = Path(shutil.copytree(GOOD, tmp_path / "ds"))
    said = _damage(dataset / "1" / "data.bin", kind)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    command = _without_dac([sys.executable, "-m", "atlasfs", "mount", str(dataset), str(mnt)])
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=no_syslog(tmp_path))
    try:
        assert result.returncode == 0, result.stderr
        log = state_log(tmp_path, mnt)
        lines = result.stderr.splitlines()
        assert len(lines) == 2, result.stderr
        assert lines[0].startswith(f"atlasfs: {said}") and "(shard 1 fails with EIO)" in lines[0]
        assert lines[1] == f"atlasfs: logging to {log}"
        assert sorted(os.listdir(mnt)) == ["0", "1", "2"]
        assert os.listdir(mnt / "0") and os.listdir(mnt / "2")
        with pytest.raises(OSError) as info:
            os.listdir(mnt / "1")
        assert info.value.errno == errno.EIO
        assert lines[0].removeprefix("atlasfs: ") in log.read_text()
    finally:
        force_unmount(mnt)
        if kind == "no permission":
            (dataset / "1" / "data.bin").chmod(0o644)


def test_many_problems_are_counted_after_the_first_ten(tmp_path: Path) -> None:
    require_fuse()
    dataset = tmp_path / "ds"
    from atlasfs import AtlasWriter
    with AtlasWriter(dataset, shard_size=2, block_size=2, compression_strategy=1) as writer:
        writer.add_examples([{"__key__": f"s{i:03d}", "txt": f"text {i}"} for i in range(2 * 14)])
    for shard in range(1, 14):  # 13 bad shards, one good
        (dataset / f"{shard:02d}" / "data.bin").unlink()
    log = tmp_path / "given.log"
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = atlasfs("mount", str(dataset), str(mnt), "--log-file", str(log), env=no_syslog(tmp_path))
    try:
        assert result.returncode == 0, result.stderr
        lines = result.stderr.splitlines()
        assert len(lines) == SHOWN_PROBLEMS + 1, result.stderr
        assert all("data.bin: missing" in line for line in lines[:SHOWN_PROBLEMS])
        # the given file is used, and mount does not say so again
        assert lines[-1] == f"atlasfs: ... and 3 more (see {log})"
        assert log.read_text().count("data.bin: missing") == 13
        assert not (tmp_path / "state").exists()
        assert os.listdir(mnt / "00") and is_mounted(mnt)
    finally:
        force_unmount(mnt)
