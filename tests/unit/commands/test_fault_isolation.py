"""Fault isolation (issue #23), one rule in every command and view: a bad shard (or block)
fails its own files and its own tar, and nothing else (through a mount: tests/mount/test_faults.py).

Each test damages shard 03 of a copy of the twelve-shard reference fixture: its
``data.bin`` cut short (its last block truncated: the shard cannot be opened by a
mount, block 0 is intact), one block's compressed bytes zeroed (only decoding sees it),
or that block's frame magic number zeroed (``info`` sees it too).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from faultdata import BAD, GOOD, NAME, SHARDS, damage, damaged, good_index, good_keys, pristine
from fusemount import atlasfs
from helpers import REFERENCE


#: truncated: data.bin cut in its last block; bad_block: block 2's compressed bytes zeroed
#: (its frame header kept); bad_header: block 2's frame magic number zeroed.
FAULTS = ("truncated", "bad_block", "bad_header")


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
