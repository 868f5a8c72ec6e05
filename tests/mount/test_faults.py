"""Fault isolation (issue #23), one rule in every command and view: a bad shard (or block)
fails its own files and its own tar, and nothing else.

Each test damages shard 03 of a copy of the twelve-shard reference fixture: its
``data.bin`` cut short (its last block truncated: the shard cannot be opened by a
mount, block 0 is intact), one block's compressed bytes zeroed (only decoding sees it),
or that block's frame magic number zeroed (``info`` sees it too).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from fusemount import atlasfs, mounted
from helpers import REFERENCE, TORCH_STANDIN, expected_examples, shard_sizes

NAME = "s2_twelve_shards"
SHARDS = [f"{i:02d}" for i in range(12)]
BAD = "03"
GOOD = [s for s in SHARDS if s != BAD]
#: truncated: data.bin cut in its last block; bad_block: block 2's compressed bytes zeroed
#: (its frame header kept); bad_header: block 2's frame magic number zeroed.
FAULTS = ("truncated", "bad_block", "bad_header")


def damage(shard: Path, fault: str, block: int = 2) -> None:
    """Damage one shard folder of a copy in place."""
    data = shard / "data.bin"
    raw = bytearray(data.read_bytes())
    if fault == "truncated":
        data.write_bytes(bytes(raw[:-20]))
        return
    index = np.load(shard / "index.npy")
    start, end = int(index[block]), int(index[block + 1])
    if fault == "bad_block":
        middle = (start + end) // 2
        raw[middle - 20:middle + 20] = bytes(40)
    else:  # its magic number: not a zstd frame
        raw[start:start + 4] = bytes(4)
    data.write_bytes(bytes(raw))


def damaged(tmp_path: Path, fault: str) -> Path:
    """A copy of the fixture with shard 03 damaged by ``fault``."""
    dataset = Path(shutil.copytree(REFERENCE / NAME / "dataset", tmp_path / "ds"))
    damage(dataset / BAD, fault)
    return dataset


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``atlasfs export`` of the undamaged fixture: what every good shard must still give."""
    out = tmp_path_factory.mktemp("pristine") / "out"
    result = atlasfs("export", str(REFERENCE / NAME / "dataset"), str(out))
    assert result.returncode == 0, result.stderr
    return out


def good_index(pristine: Path) -> dict:
    """The pristine ``shards.json`` without the bad shard's entry."""
    index = json.loads((pristine / "shards.json").read_text())
    index["shardlist"] = [entry for entry in index["shardlist"] if entry["url"] != f"{BAD}.tar"]
    assert len(index["shardlist"]) == len(GOOD)
    return index


def good_keys() -> list[str]:
    """The keys of the examples outside the bad shard, in dataset order."""
    sizes = shard_sizes(NAME)
    start = sum(sizes[:SHARDS.index(BAD)])
    examples = expected_examples(NAME)
    return [e["__key__"] for e in examples[:start] + examples[start + sizes[SHARDS.index(BAD)]:]]


# ---------------------------------------------------------------- commands


@pytest.mark.parametrize("fault", FAULTS)
def test_export_writes_every_good_shard_and_names_the_bad_one(tmp_path: Path, fault: str, pristine: Path) -> None:
    dataset = damaged(tmp_path, fault)
    out = tmp_path / "out"
    result = atlasfs("export", str(dataset), str(out))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "EIO" not in result.stderr, result.stderr
    named = [line for line in result.stderr.splitlines() if line.startswith(f"atlasfs: export of shard {BAD} failed: ")]
    assert len(named) == 1, result.stderr
    cause = "truncated" if fault == "truncated" else "block 2"
    assert f"{dataset / BAD / 'data.bin'}" in named[0] and cause in named[0], named[0]
    assert named[0].endswith("; the other shards are written")
    assert not any(f"shard {s} " in result.stderr for s in GOOD), result.stderr
    # every good shard written, byte for byte as from the undamaged dataset; no partial file
    assert sorted(p.name for p in out.iterdir()) == sorted([f"{s}.tar" for s in GOOD] + ["shards.json"])
    for shard in GOOD:
        assert (out / f"{shard}.tar").read_bytes() == (pristine / f"{shard}.tar").read_bytes(), shard
    assert json.loads((out / "shards.json").read_text()) == good_index(pristine)
    # exporting only the bad shard: the same line, without the others'
    result = atlasfs("export", str(dataset), str(tmp_path / "alone"), "--shards", BAD)
    assert result.returncode == 1 and not (tmp_path / "alone" / f"{BAD}.tar").exists()
    assert f"export of shard {BAD} failed: " in result.stderr and "other shards" not in result.stderr


@pytest.mark.parametrize("fault", FAULTS)
def test_info_summarises_every_good_shard_and_names_the_bad_one(tmp_path: Path, fault: str) -> None:
    dataset = damaged(tmp_path, fault)
    result = atlasfs("info", str(dataset))
    assert "Traceback" not in result.stderr
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()[:2] in SHARDS}
    assert sorted(rows) == SHARDS, result.stdout
    for shard in GOOD:
        assert re.fullmatch(rf"\s+{shard}\s+\d+\s+\d+\s+2\s+2\s+\d+\s+[\d.]+", rows[shard]), rows[shard]
    if fault == "bad_block":  # info reads frame headers, not blocks: only verify sees this one
        assert result.returncode == 0 and "problem" not in result.stdout
        return
    assert result.returncode == 1
    assert f"{BAD} problem: {dataset / BAD / 'data.bin'}" in rows[BAD], rows[BAD]
    assert "shards       12 (1 with problems, below)" in result.stdout
    assert f"examples     {len(good_keys())}" in result.stdout


def test_verify_names_every_problem(tmp_path: Path) -> None:
    dataset = damaged(tmp_path, "truncated")
    damage(dataset / "07", "bad_block", block=4)
    damage(dataset / "10", "bad_header", block=1)
    result = atlasfs("verify", str(dataset))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 4, lines
    assert lines[0].startswith(f"{dataset / BAD / 'data.bin'}: ") and "(truncated)" in lines[0]
    assert lines[1].startswith(f"{dataset / '07' / 'data.bin'} block 4: ")
    assert lines[2].startswith(f"{dataset / '10' / 'data.bin'} block 1: ")
    assert lines[3] == "verify: 3 problem(s) (11 shards, 73 blocks, 142 examples checked)"


@pytest.mark.parametrize("fault", ("truncated", "bad_block", "no_index"))
def test_show_reads_any_example_whose_block_is_intact(tmp_path: Path, fault: str) -> None:
    if fault == "no_index":  # a shard that cannot be opened at all
        dataset = Path(shutil.copytree(REFERENCE / NAME / "dataset", tmp_path / "ds"))
        (dataset / BAD / "index.npy").unlink()
    else:
        dataset = damaged(tmp_path, fault)
    first = SHARDS.index(BAD) * 14  # shards 00-10 hold 14 examples each, two to a block
    for index, key in ((0, "part00/item0000"), (first + 14, "part04/item0056"), (-1, "part11/item0159")):
        result = atlasfs("show", str(dataset), str(index))
        assert result.returncode == 0 and f"'{key}'" in result.stdout, (index, result.stderr)
    if fault != "no_index":  # block 0 of the bad shard is intact
        result = atlasfs("show", str(dataset), str(first))
        assert result.returncode == 0 and f"'part{BAD}/item{first:04d}'" in result.stdout, result.stderr
    broken = {"truncated": (first + 13, "data.bin: block 6 truncated"), "bad_block": (first + 4, "data.bin block 2: "),
              "no_index": (first, "index.npy: missing")}[fault]
    result = atlasfs("show", str(dataset), str(broken[0]))
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.startswith(f"atlasfs: {dataset / BAD}/") and broken[1] in result.stderr, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr


# ---------------------------------------------------------------- through a real mount


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


@pytest.mark.parametrize("fault", ("truncated", "bad_block"))
def test_index_stores_every_good_shard_and_names_the_bad_one(tmp_path: Path, fault: str) -> None:
    dataset = damaged(tmp_path, fault)
    result = atlasfs("index", str(dataset))
    assert result.returncode == 1 and "Traceback" not in result.stderr and "EIO" not in result.stderr
    [line] = result.stderr.splitlines()
    assert line.startswith(f"atlasfs: index of shard {BAD} failed: {dataset / BAD / 'data.bin'}"), line
    assert result.stdout == f"file tables of 11 of 12 shards are up to date in {dataset / '.atlasfs-tables'}\n"
    # the good shards' tables are there: a mount lists them without decoding
    from atlasfs import AtlasDataset
    from atlasfs.tree.blocktree import BlockTree
    from atlasfs.tree.table.store import TableStore
    with AtlasDataset(dataset, tolerate_broken_shards=True) as source:
        tree = BlockTree(source, store=TableStore(str(dataset)), log_failures=False)
        for shard in GOOD:
            assert tree.names(f"/{shard}")
        assert tree.cache.misses == 0


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
