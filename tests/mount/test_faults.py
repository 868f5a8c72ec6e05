"""Fault isolation through a real mount (issue #23): a bad shard fails its own files and its own
tar, and nothing else, as the mount serves them; in any format, a file that cannot be read fails
alone (the commands: tests/unit/commands/test_fault_isolation.py)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from faultdata import BAD, GOOD, damaged, good_index, good_keys, pristine
from fusemount import atlasfs, mounted
from helpers import TORCH_STANDIN


def _wids_keys(index: Path, links: Path) -> list[str]:
    """The keys wids reads by index through ``index`` (the mounted tars read in place)."""
    script = TORCH_STANDIN + '''
import wids
from atlasfs import wids_in_place
ds = wids.ShardListDataset(sys.argv[1], transformations=[], localname=wids_in_place(sys.argv[2]))
print(len(ds), *[ds[i]["__key__"] for i in range(len(ds))])
'''
    result = subprocess.run([sys.executable, "-c", script, str(index), str(links)], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    count, *keys = result.stdout.split()
    assert int(count) == len(keys)
    return keys


@pytest.mark.parametrize("fault", ("truncated", "bad_block"))
def test_the_mount_serves_every_good_shard_and_fails_only_the_bad_one(tmp_path: Path, fault: str,
                                                                       pristine: Path) -> None:
    dataset = damaged(tmp_path, fault)
    log = tmp_path / "mount.log"
    with mounted(dataset, "--view", "both", "-o", f"log_file={log}") as mnt:
        # ls -l: every good shard's tar with its size; the bad one alone fails (EIO on stat), and
        # the loaders' indexes of its tar (energon's .tar.idx, DALI's .idx: docs/training.md)
        listed = subprocess.run(["ls", "-l", str(mnt)], capture_output=True, text=True)
        assert listed.returncode != 0
        assert sorted(listed.stderr.splitlines()) == sorted(
            f"ls: cannot access '{mnt}/{name}': Input/output error" for name in (f"{BAD}.tar", f"{BAD}.tar.idx",
                                                                                   f"{BAD}.idx")), listed.stderr
        sizes = {line.split()[-1]: line.split()[4] for line in listed.stdout.splitlines()[1:]}
        for shard in GOOD:
            assert sizes[f"{shard}.tar"] == str((pristine / f"{shard}.tar").stat().st_size), listed.stdout
        assert f"{BAD}.tar" in sizes and "shards.json" in sizes
        for call in (os.stat, lambda path: open(path, "rb").read(1)):
            with pytest.raises(OSError) as info:
                call(mnt / f"{BAD}.tar")
            assert info.value.errno == errno.EIO
        # shards.json lists the good shards; wids and webdataset read them
        shown = subprocess.run(["cat", str(mnt / "shards.json")], capture_output=True, text=True)
        assert shown.returncode == 0 and json.loads(shown.stdout) == good_index(pristine)
        for shard in GOOD:
            assert subprocess.run(["cmp", str(mnt / f"{shard}.tar"), str(pristine / f"{shard}.tar")]).returncode == 0
        samples = list(wds.WebDataset(str(mnt / f"{{{','.join(GOOD)}}}.tar"), shardshuffle=False))
        assert [s["__key__"] for s in samples] == good_keys()
        assert _wids_keys(mnt / "shards.json", tmp_path / "links") == good_keys()
        # the files view of the good shards: ls and cat, every file as exported
        for shard in (GOOD[0], GOOD[-1]):
            found = subprocess.run(["find", str(mnt / shard), "-type", "f"], capture_output=True, text=True)
            assert found.returncode == 0, found.stderr
            with tarfile.open(pristine / f"{shard}.tar") as archive:
                members = {m.name: archive.extractfile(m).read() for m in archive.getmembers()}
            assert sorted(os.path.relpath(p, mnt / shard) for p in found.stdout.split()) == sorted(members)
            for name, data in members.items():
                assert (mnt / shard / name).read_bytes() == data
        # the bad shard's folder: all of it fails (it cannot be opened), or the bad block's files
        if fault == "truncated":
            with pytest.raises(OSError) as info:
                os.listdir(mnt / BAD)
            assert info.value.errno == errno.EIO
        else:
            unreadable = [n for n in os.listdir(mnt / BAD) if n.endswith(".unreadable")]
            assert unreadable == ["000046.unreadable", "000047.unreadable"]
            with pytest.raises(OSError) as info:
                (mnt / BAD / unreadable[0]).read_bytes()
            assert info.value.errno == errno.EIO
            assert (mnt / BAD / "part03" / "item0042.txt").read_bytes()  # block 0 serves
    text = log.read_text()
    assert "Traceback" not in text
    left_out = [line for line in text.splitlines() if f"shards.json leaves out {BAD}.tar" in line]
    assert len(left_out) == 1 and str(dataset / BAD / "data.bin") in left_out[0], text


def test_any_format_a_file_that_cannot_be_read_fails_alone(tmp_path: Path) -> None:
    """The same rule through the source interface: a .pbin file that is not one."""
    from atlasfs.formats.pbin import write_pbin
    root = tmp_path / "ds"
    root.mkdir()
    write_pbin(str(root / "a.pbin"), [[1, 2], [3]], token_width=2)
    (root / "b.pbin").write_bytes(b"\x10" + bytes(30))
    write_pbin(str(root / "c.pbin"), [[4], [5, 6], [7]], token_width=2)
    info = atlasfs("info", str(root))
    assert info.returncode == 1 and "Traceback" not in info.stderr
    rows = {line.split()[0]: line for line in info.stdout.splitlines() if line.split()[:1] in (["a"], ["b"], ["c"])}
    assert rows["a"].split()[1] == "2" and rows["c"].split()[1] == "3" and str(root / "b.pbin") in rows["b"]
    result = atlasfs("export", str(root), str(tmp_path / "out"))
    assert result.returncode == 1 and "EIO" not in result.stderr
    assert f"atlasfs: export of shard b failed: {root / 'b.pbin'}" in result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.tar", "c.tar", "shards.json"]
    with mounted(root, "--view", "tars") as mnt:
        index = json.loads((mnt / "shards.json").read_text())
        assert index["shardlist"] == [{"url": "a.tar", "nsamples": 2}, {"url": "c.tar", "nsamples": 3}]
        assert (mnt / "c.tar").read_bytes() == (tmp_path / "out" / "c.tar").read_bytes()
        with pytest.raises(OSError) as raised:
            os.stat(mnt / "b.tar")
        assert raised.value.errno == errno.EIO
