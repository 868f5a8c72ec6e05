"""The damaged copies of the fault isolation tests (issue #23): shard 03 of a copy of the
twelve-shard reference fixture damaged in place, and what the good shards must still give."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fusemount import atlasfs
from helpers import REFERENCE, expected_examples, shard_sizes


NAME = "s2_twelve_shards"
SHARDS = [f"{i:02d}" for i in range(12)]
BAD = "03"
GOOD = [s for s in SHARDS if s != BAD]


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
