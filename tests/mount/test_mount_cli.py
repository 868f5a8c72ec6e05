"""`atlasfs mount` / `umount` as a user meets them: refusals, signals, broken data."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusemount import atlasfs, force_unmount, is_mounted, mounted, require_fuse
from helpers import REFERENCE

GOOD = REFERENCE / "s2_shared_dict" / "dataset"


def one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 1, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("atlasfs: ")
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_refuses_invalid_dataset(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(GOOD, bad)
    (bad / "meta.json").write_text("{not json")
    (tmp_path / "mnt").mkdir()
    one_line_error(atlasfs("mount", str(bad), str(tmp_path / "mnt")), str(bad / "meta.json"), "not valid JSON")
    assert not is_mounted(tmp_path / "mnt")


def test_refuses_bad_mount_points(tmp_path: Path) -> None:
    require_fuse()
    one_line_error(atlasfs("mount", str(GOOD), str(tmp_path / "missing")), "does not exist")
    (tmp_path / "file").write_text("x")
    one_line_error(atlasfs("mount", str(GOOD), str(tmp_path / "file")), "not a folder")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    one_line_error(atlasfs("mount", str(GOOD), str(tmp_path / "full")), "not empty")
    (tmp_path / "mnt").mkdir()
    one_line_error(atlasfs("mount", str(GOOD), str(tmp_path / "mnt"), "-o", "rw"), "read-only")
    one_line_error(atlasfs("mount", str(GOOD), str(tmp_path / "mnt"), "-o", "bogus_option"), "bogus_option")
    one_line_error(atlasfs("mount", str(tmp_path / "nope"), str(tmp_path / "mnt")), "no such dataset")


def test_refuses_a_mount_point_that_is_already_mounted(tmp_path: Path) -> None:
    with mounted(GOOD) as mnt:
        one_line_error(atlasfs("mount", str(GOOD), str(mnt)), "already an atlasfs mount")


def test_mount_options_take_effect(tmp_path: Path) -> None:
    with mounted(GOOD, "-o", "cache_size=1M,allow_other,nofail,x-systemd.automount") as mnt:
        with open("/proc/self/mountinfo") as f:
            line = next(line for line in f if line.split()[4] == str(mnt))
        assert "fuse.atlasfs" in line and " ro," in line.replace(" ro ", " ro,")
        assert "allow_other" in line


def test_umount_reports_not_mounted_and_busy(tmp_path: Path) -> None:
    one_line_error(atlasfs("umount", str(tmp_path)), "not mounted")
    one_line_error(atlasfs("umount", str(tmp_path / "missing")), f"{tmp_path / 'missing'}: does not exist")
    with mounted(GOOD) as mnt:
        holder = subprocess.Popen(["sleep", "30"], cwd=mnt)
        try:
            time.sleep(0.2)
            one_line_error(atlasfs("umount", str(mnt)), "busy", "-z")
            assert is_mounted(mnt)
        finally:
            holder.kill()
            holder.wait()
        result = atlasfs("umount", str(mnt))
        assert result.returncode == 0, result.stderr
        assert not is_mounted(mnt)


def test_umount_refuses_a_file_system_that_is_not_atlasfs(tmp_path: Path) -> None:
    if os.geteuid() != 0:  # only root mounts a tmpfs; umount(8) would refuse a user anyway
        pytest.skip("needs root to mount a tmpfs")
    other = tmp_path / "tmpfs"
    other.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "atlasfs-test", str(other)], check=True)
    try:
        (other / "precious").write_text("keep me")
        for lazy in ([], ["-z"]):
            one_line_error(atlasfs("umount", *lazy, str(other)),
                           f"{other}: not an atlasfs mount (tmpfs); atlasfs only unmounts its own")
            assert is_mounted(other) and (other / "precious").read_text() == "keep me"
    finally:
        subprocess.run(["umount", str(other)], check=True)
    help_text = atlasfs("umount", "--help").stdout
    assert "the mount point of an atlasfs mount" in help_text


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_unmounts_a_foreground_mount(tmp_path: Path, sig: signal.Signals) -> None:
    require_fuse()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    daemon = subprocess.Popen([sys.executable, "-m", "atlasfs", "mount", "-f", str(GOOD), str(mnt)],
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 20
        while not (is_mounted(mnt) and os.listdir(mnt)):
            assert daemon.poll() is None and time.monotonic() < deadline, "foreground mount did not come up"
            time.sleep(0.05)
        assert sorted(os.listdir(mnt)) == ["0", "1", "2"]
        daemon.send_signal(sig)
        assert daemon.wait(timeout=20) == 0
        assert not is_mounted(mnt)
    finally:
        if daemon.poll() is None:
            daemon.kill()
        force_unmount(mnt)


def test_corrupt_block_fails_its_files_with_eio_and_the_rest_serves(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(GOOD, bad)
    import numpy as np
    index = np.load(bad / "1" / "index.npy")
    data = bytearray((bad / "1" / "data.bin").read_bytes())
    start = int(index[2])
    data[start + 20:start + 40] = b"\xff" * 20  # damage block 2 of shard 1
    (bad / "1" / "data.bin").write_bytes(bytes(data))
    with mounted(GOOD) as good_mnt:
        good_files = {str(p.relative_to(good_mnt)): p.read_bytes() for p in good_mnt.rglob("*") if p.is_file()}
    with mounted(bad) as mnt:
        listing = sorted(os.listdir(mnt / "1"))
        unreadable = [n for n in listing if n.endswith(".unreadable")]
        assert len(unreadable) == 4  # block_size 4: the examples of the damaged block
        for name in unreadable:
            with pytest.raises(OSError) as info:
                os.stat(mnt / "1" / name)
            assert info.value.errno == errno.EIO
        served = {str(p.relative_to(mnt)): p.read_bytes() for p in mnt.rglob("*")
                  if not p.name.endswith(".unreadable") and p.is_file()}
        lost = set(good_files) - set(served)
        assert len(lost) > 0 and all(path.startswith("1/") for path in lost)
        assert all(served[path] == good_files[path] for path in served)
        result = subprocess.run(["tar", "cf", str(tmp_path / "x.tar"), "-C", str(mnt / "1"), "."],
                                capture_output=True, text=True)
        assert result.returncode != 0 and "Input/output error" in result.stderr
