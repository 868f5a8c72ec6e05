"""The command line's points of issue #37 that mount or would if wrong: a shard folder names its
dataset, an index folder that cannot be written fails the mount in one line, and ``make
demo``'s script ends with the quick start (the rest: tests/unit/commands/test_cli_points.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from fusemount import atlasfs, force_unmount, is_mounted, require_fuse
from helpers import REPO, SHARED_DICT


def test_mounting_a_shard_folder_names_the_dataset(tmp_path: Path) -> None:
    require_fuse()
    dataset = Path(shutil.copytree(SHARED_DICT, tmp_path / "ds"))
    (tmp_path / "mnt").mkdir()
    result = atlasfs("mount", str(dataset / "0"), str(tmp_path / "mnt"))
    assert result.returncode == 1 and not is_mounted(tmp_path / "mnt")
    assert result.stderr == (f"atlasfs: {dataset / '0' / 'meta.json'}: missing key 'shard_sizes'; {dataset / '0'} "
                             f"is a shard folder of the dataset {dataset}: mount {dataset}\n"), result.stderr
    result = atlasfs("info", "0", cwd=dataset)  # relative, as typed
    assert result.stderr.endswith("; 0 is a shard folder of the dataset .: info .\n"), result.stderr
    result = atlasfs("info", str(tmp_path))  # not a dataset, nor in one: no hint
    assert "shard folder" not in result.stderr and result.stderr.count("\n") == 1


def test_mount_with_an_index_dir_that_cannot_be_written_fails_in_one_line(tmp_path: Path) -> None:
    """It exited 0 and said nothing (one line per shard in the daemon's log)."""
    (tmp_path / "mnt").mkdir()
    for flag in (["--index-dir", "/proc/atlasfs-idx"], ["-o", "index_dir=/proc/atlasfs-idx"]):
        result = atlasfs("mount", str(SHARED_DICT), str(tmp_path / "mnt"), *flag)
        if is_mounted(tmp_path / "mnt"):
            force_unmount(tmp_path / "mnt")
        assert result.returncode == 1, result
        assert result.stderr == ("atlasfs: /proc/atlasfs-idx: cannot create it (No such file or directory); choose "
                                 "a writable folder with --index-dir DIR\n"), result.stderr


def test_the_demo_script_keeps_its_dataset_and_ends_with_the_quick_start(tmp_path: Path) -> None:
    """`make demo`'s script: the dataset stays where the README's quick start mounts it, the
    script's last lines are that quick start, a second run reuses the dataset, and the
    three lines work (here on a mount point of the test's own, not the shared /tmp/ds)."""
    require_fuse()
    bin_dir = Path(sys.executable).parent
    script = REPO / "scripts" / "demo.sh"
    runs = [subprocess.run([str(script), str(bin_dir), "atlasfs-demo"], cwd=tmp_path, capture_output=True,
                           text=True, timeout=300) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
        assert run.stdout.splitlines()[-3:] == [f"mkdir -p /tmp/ds && {bin_dir}/atlasfs mount atlasfs-demo /tmp/ds",
                                                "ls /tmp/ds/0 | head", f"{bin_dir}/atlasfs umount /tmp/ds"]
    assert "reused" in runs[1].stdout and "reused" not in runs[0].stdout
    assert atlasfs("verify", str(tmp_path / "atlasfs-demo")).returncode == 0
    mnt = tmp_path / "ds"
    mnt.mkdir()
    try:
        assert atlasfs("mount", "atlasfs-demo", str(mnt), cwd=tmp_path).returncode == 0
        assert set(os.listdir(mnt / "0")) <= {"bird", "cat", "dog", "fish", "horse"} and os.listdir(mnt / "0")
    finally:
        result = atlasfs("umount", str(mnt))
        force_unmount(mnt)
    assert result.returncode == 0 and not is_mounted(mnt)
