"""systemd and fstab integration: units verified, readiness protocol, mount helper."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from fusemount import IN_CI, force_unmount, is_mounted, require_fuse
from helpers import REFERENCE, REPO

GOOD = REFERENCE / "s2_shared_dict" / "dataset"
BIN = Path(sys.executable).parent


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        if IN_CI:
            pytest.fail("systemd-analyze is missing (make test installs the systemd package)")
        pytest.skip("systemd-analyze is not installed")
    # verify insists that ExecStart's program exists: point it at this installation's atlasfs.
    unit = (REPO / "systemd" / "atlasfs@.service").read_text()
    assert "/usr/local/bin/atlasfs " in unit
    (tmp_path / "atlasfs@demo.service").write_text(unit.replace("/usr/local/bin/atlasfs", str(BIN / "atlasfs")))
    result = subprocess.run([analyze, "verify", str(tmp_path / "atlasfs@demo.service")],
                            capture_output=True, text=True)
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert "Type=notify" in unit and "OOMScoreAdjust=" in unit and "DeviceAllow=/dev/fuse" in unit


def test_foreground_daemon_speaks_the_notify_protocol(tmp_path: Path) -> None:
    require_fuse()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(30)
    daemon = subprocess.Popen([str(BIN / "atlasfs"), "mount", "-f", str(GOOD), str(mnt)],
                              env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")},
                              stderr=subprocess.PIPE, text=True)
    try:
        assert sock.recv(4096) == b"READY=1"
        # READY=1 promises a usable mount: no waiting allowed here
        assert is_mounted(mnt)
        assert sorted(os.listdir(mnt)) == ["0", "1", "2"]
        daemon.send_signal(signal.SIGTERM)
        assert sock.recv(4096) == b"STOPPING=1"
        assert daemon.wait(timeout=20) == 0
        assert not is_mounted(mnt)
        assert "mounted" in daemon.stderr.read()
    finally:
        if daemon.poll() is None:
            daemon.kill()
        force_unmount(mnt)
        sock.close()


def test_fstab_helper_mounts_with_options(tmp_path: Path) -> None:
    require_fuse()
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    log = tmp_path / "atlasfs.log"
    options = f"ro,allow_other,cache_size=1G,nofail,_netdev,x-systemd.automount,log_file={log}"
    result = subprocess.run([str(BIN / "mount.fuse.atlasfs"), str(GOOD), str(mnt), "-o", options],
                            capture_output=True, text=True, timeout=60)
    try:
        assert result.returncode == 0, result.stderr
        assert is_mounted(mnt)  # the helper returns only once the mount is live
        with open("/proc/self/mountinfo") as f:
            line = next(line for line in f if line.split()[4] == str(mnt))
        assert "allow_other" in line and "fuse.atlasfs" in line
        assert "cache 1.0 GiB" in log.read_text() and "allow_other" in log.read_text()
        assert sorted(os.listdir(mnt)) == ["0", "1", "2"]
    finally:
        force_unmount(mnt)
    # mount(8)'s -f means "fake": nothing is mounted
    result = subprocess.run([str(BIN / "mount.fuse.atlasfs"), str(GOOD), str(mnt), "-f", "-o", "ro"],
                            capture_output=True, text=True)
    assert result.returncode == 0 and not is_mounted(mnt)


def test_mount_8_uses_the_helper_for_fuse_atlasfs_fstab_lines(tmp_path: Path) -> None:
    require_fuse()
    helper = Path("/sbin/mount.fuse.atlasfs")
    if os.geteuid() != 0 or (helper.exists() and helper.resolve() != (BIN / "mount.fuse.atlasfs").resolve()):
        if IN_CI:
            pytest.fail("needs root and a free /sbin/mount.fuse.atlasfs")
        pytest.skip("needs root and a free /sbin/mount.fuse.atlasfs")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fstab = tmp_path / "fstab"
    fstab.write_text(f"{GOOD} {mnt} fuse.atlasfs ro,allow_other,cache_size=64M,nofail 0 0\n")
    created = not helper.exists()
    if created:
        helper.symlink_to(BIN / "mount.fuse.atlasfs")
    try:
        result = subprocess.run(["mount", "--fstab", str(fstab), str(mnt)], capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stderr
        assert is_mounted(mnt) and sorted(os.listdir(mnt)) == ["0", "1", "2"]
    finally:
        force_unmount(mnt)
        if created:
            helper.unlink()


def test_readme_demo_command_runs_from_a_clean_checkout(tmp_path: Path) -> None:
    """`make demo` in a fresh copy of the tracked files: installs, mounts, lists, exports, reads back."""
    require_fuse()
    readme = (REPO / "README.md").read_text()
    assert "make demo" in readme and "make test" in readme
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    checkout = tmp_path / "atlasfs"
    for name in files:
        if (REPO / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, checkout / name)
    result = subprocess.run(["make", "demo"], cwd=checkout, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    for expected in ("==> mounting it", "==> one sample's files", "==> archiving shard 0 with tar, keys clean",
                     "==> exporting it in the dataset's example order", "50 samples; the first: key=",
                     "export holds them in example order", "==> unmounting", "demo finished"):
        assert expected in out, out
    assert not any("atlasfs-demo" in line for line in open("/proc/self/mountinfo"))
