"""A confused deputy through a dataset's symbolic links: root mounts (``-o allow_other``), verifies
or exports a dataset of another user (uid 12345 here, no user of the machine), who linked its
files to files only root may read. Without the rule of ``atlasfs.storage.links`` everybody
would read root's secret through the mount.

The dataset, 4 Atlas shards all owned by uid 12345:

- shard 1's ``data.bin``: uid 12345's link to a root-only (0600) copy of it: never served;
- shard 2's ``data.bin``: root's link to a root-only copy: served (root made it);
- shard 3's ``data.bin``: uid 12345's link to their own copy outside the dataset: served;
- shard 0: no link.

These tests run as root (chown); in CI they fail if they cannot mount.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from atlasfs import AtlasWriter
from forged import build, forged_link
from fusemount import atlasfs, mounted
from linkattack import OTHER, as_root  # noqa: F401 (as_root: autouse)

SHARDS = ("0", "1", "2", "3")


def chown_tree(path: Path, owner: int) -> None:
    for here, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.lchown(os.path.join(here, name), owner, owner)
    os.lchown(path, owner, owner)


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    ds = tmp_path / "ds"
    examples = [{"__key__": f"s{i:03d}", "txt": f"text {i}", "cls": i} for i in range(16 * len(SHARDS))]
    with AtlasWriter(ds, shard_size=16, block_size=4) as writer:
        writer.add_examples(examples)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for shard, owner, link_owner in (("1", 0, OTHER), ("2", 0, 0), ("3", OTHER, OTHER)):
        target = elsewhere / f"data-{shard}.bin"
        shutil.move(ds / shard / "data.bin", target)
        target.chmod(0o600)
        os.chown(target, owner, owner)
        os.symlink(target, ds / shard / "data.bin")
    chown_tree(ds, OTHER)
    os.lchown(ds / "2" / "data.bin", 0, 0)  # root's own link, in the user's dataset
    return ds


REFUSED = (f"1/data.bin: a symbolic link of uid {OTHER} to a file of uid 0, "
           "not followed when atlasfs runs as uid 0")


def lines_with(output: str, fragment: str) -> list[str]:
    assert "Traceback" not in output, output
    return [line for line in output.splitlines() if fragment in line]


def test_verify_refuses_the_link_alone(dataset: Path) -> None:
    result = atlasfs("verify", str(dataset), timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert len(lines_with(output, REFUSED)) == 1, output
    assert "data-2.bin" not in output and "3/data.bin" not in output and "2/data.bin" not in output, output


def test_export_writes_every_other_shard(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = atlasfs("export", str(dataset), str(out), timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert len(lines_with(output, REFUSED)) == 1, output
    assert sorted(p.name for p in out.glob("*.tar")) == ["0.tar", "2.tar", "3.tar"], output


def test_a_mount_with_allow_other_never_serves_the_secret(dataset: Path, tmp_path: Path) -> None:
    with mounted(dataset, "-o", "allow_other") as mnt:
        assert sorted(os.listdir(mnt)) == list(SHARDS)
        for shard in ("0", "2", "3"):
            number = int(shard) * 16 + 5
            assert (mnt / shard / f"s{number:03d}.txt").read_text() == f"text {number}"
        listing = subprocess.run(["ls", str(mnt / "1")], capture_output=True, text=True, timeout=30)
        assert listing.returncode != 0 and "Input/output error" in listing.stderr, listing
        cat = subprocess.run(["cat", str(mnt / "1" / "s021.txt")], capture_output=True, text=True, timeout=30)
        assert cat.returncode != 0 and cat.stdout == "", cat
        tar = subprocess.run(["tar", "cf", "-", "-C", str(mnt), "1"], capture_output=True, timeout=30)
        assert b"text 21" not in tar.stdout


def test_the_mount_says_why(dataset: Path, tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    result = atlasfs("mount", str(dataset), str(mnt), "-o", f"allow_other,log_file={tmp_path / 'log'}", timeout=60)
    try:
        assert result.returncode == 0, result.stderr
        assert len(lines_with(result.stdout + result.stderr, REFUSED)) == 1, result.stderr
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, timeout=30)


def test_a_link_on_the_users_own_fuse_file_system_is_theirs(tmp_path: Path) -> None:
    """The dataset lies on the attacker's FUSE file system (mounted with ``allow_other``, which
    ``user_allow_other`` lets any user do), whose server says its link to root's secret tar is
    root's. Root mounts it for everyone: the mount's user answers for the link, and the shard
    fails, saying why, instead of serving the secret."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "s000.txt").write_text("root's secret text")
    tar = tmp_path / "secret.tar"
    subprocess.run(["tar", "cf", str(tar), "-C", str(source), "s000.txt"], check=True)
    tar.chmod(0o600)
    with forged_link(build(tmp_path), tmp_path / "fuse", "0.tar", tar, OTHER) as forged:
        mnt = tmp_path / "mnt"
        mnt.mkdir()
        result = atlasfs("mount", str(forged.parent), str(mnt), "-o", f"allow_other,log_file={tmp_path / 'log'}",
                         timeout=60)
        try:
            assert result.returncode == 0, result.stderr
            said = (f"{forged}: a symbolic link of uid {OTHER} (the user of its FUSE file system, which says uid 0) "
                    "to a file of uid 0, not followed when atlasfs runs as uid 0")
            assert len(lines_with(result.stdout + result.stderr, said)) == 1, result.stderr
            cat = subprocess.run(["cat", str(mnt / "0" / "s000.txt")], capture_output=True, text=True, timeout=30)
            assert cat.returncode != 0 and "secret" not in cat.stdout, cat
            tarred = subprocess.run(["tar", "cf", "-", "-C", str(mnt), "."], capture_output=True, timeout=30)
            assert b"secret text" not in tarred.stdout
        finally:
            subprocess.run(["fusermount3", "-u", str(mnt)], capture_output=True, timeout=30)
