"""Property: a dataset with any of its bytes mutated either reads back correctly or
raises AtlasFormatError; never another exception, a hang, or unbounded memory."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from atlasfs import AtlasDataset, AtlasFormatError, AtlasWriter
from helpers import deep_equal

EXAMPLES: list[Any] = [
    {"__key__": f"k{i}", "txt": "word " * (i % 7), "cls": i, "npy": np.arange(i % 4, dtype=np.int16),
     "blob": bytes([i]) * (i % 50), "meta": {"i": i, "f": [1.5, None]}}
    for i in range(40)
]
#: Small limits, so that whatever a mutation claims, memory stays small.
LIMIT = 1 << 20


def _build(strategy: int) -> Path:
    root = Path(tempfile.mkdtemp(prefix=f"atlasfs-fuzz-{strategy}-"))
    with AtlasWriter(root / "ds", shard_size=16, block_size=2, compression_strategy=strategy) as w:
        w.add_examples(EXAMPLES)
    return root / "ds"


DATASETS = {strategy: _build(strategy) for strategy in (0, 1, 2, 3)}


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@st.composite
def mutations(draw: st.DrawFn) -> tuple[int, str, str, int, bytes]:
    strategy = draw(st.sampled_from(sorted(DATASETS)))
    name = draw(st.sampled_from(_files(DATASETS[strategy])))
    size = (DATASETS[strategy] / name).stat().st_size
    kind = draw(st.sampled_from(["flip", "overwrite", "truncate", "insert", "delete"]))
    position = draw(st.integers(0, max(size - 1, 0)))
    payload = draw(st.binary(min_size=1, max_size=16))
    return strategy, name, kind, position, payload


def _mutate(path: Path, kind: str, position: int, payload: bytes) -> None:
    data = bytearray(path.read_bytes())
    if kind == "flip" and data:
        data[position] ^= 1 << (payload[0] % 8)
    elif kind == "overwrite":
        data[position:position + len(payload)] = payload
    elif kind == "truncate":
        del data[position:]
    elif kind == "insert":
        data[position:position] = payload
    elif kind == "delete":
        del data[position:position + len(payload)]
    path.write_bytes(bytes(data))


@settings(max_examples=int(os.environ.get("ATLASFS_FUZZ_EXAMPLES", "300")), deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(mutations())
def test_mutated_datasets_read_correctly_or_raise_format_errors(mutation: tuple[int, str, str, int, bytes]) -> None:
    strategy, name, kind, position, payload = mutation
    work = Path(tempfile.mkdtemp(prefix="atlasfs-fuzz-case-"))
    try:
        copy = work / "ds"
        shutil.copytree(DATASETS[strategy], copy)
        _mutate(copy / name, kind, position, payload)
        try:
            dataset = AtlasDataset(copy, max_block_bytes=LIMIT, cache_bytes=LIMIT)
            got = [dataset[i] for i in range(len(dataset))]
        except AtlasFormatError:
            return
        if strategy == 0 and name.endswith("data.bin"):
            # Uncompressed blocks carry no checksum: a mutated pickle may decode to other
            # values. It must still be a list of examples of the right count.
            assert len(got) == len(EXAMPLES)
        else:
            assert len(got) == len(EXAMPLES)
            assert all(deep_equal(a, b) for a, b in zip(got, EXAMPLES)), (name, kind, position)
    finally:
        shutil.rmtree(work)


def teardown_module() -> None:
    for path in DATASETS.values():
        shutil.rmtree(path.parent, ignore_errors=True)
