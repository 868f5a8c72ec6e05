"""Every kind of located file read through a mount, for every Atlas compression strategy
(0, 1, 2 and 3): runs stored as is and read alone (a whole-file read of raw bytes), runs of a
decompressed payload, runs with a prefix (arrays), inline files and kept files; read whole by
readers in random order, and in pieces at random offsets. Every byte is ``atlasfs export``'s.

scripts/test-sanitized.sh runs this file against the engine built with ASan and UBSan: these
are the reads that reach every copy located.c makes (a run with no prefix copied after a NULL
prefix was undefined behaviour that the sanitized build aborted on)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlasfs import AtlasWriter
from atlasfs.tree.table.layout import INLINE, KEPT, NO_LOCATOR
from fusemount import engine_answered_in_log, mounted
from helpers import in_threads
from locateddata import Exported, export_shards, index_tables, located_tree


def random_examples(seed: int, n: int = 24) -> list[dict[str, Any]]:
    """Every kind of file: random bytes (zstd stores them raw: a run read alone), some big
    enough for a few requests; text (a run of a compressed payload); arrays (a run with a
    prefix); small ints and JSON (inline); a larger JSON (kept with its block's)."""
    rng = np.random.default_rng(seed)
    return [{"jpg": rng.bytes(150_000 + 1000 * i if i % 6 == 0 else 2000 + 10 * i),
             "txt": "".join(rng.choice(list("abc"), 300 + 40 * i)),
             "npy": rng.random(50 + i), "cls": i, "json": {"id": i, "tag": "abc"[i % 3]},
             "values.json": {"id": i, "values": rng.integers(100, 1000, 60).tolist()}} for i in range(n)]


def _dataset(tmp_path: Path, strategy: int) -> tuple[Path, Path, Exported, set[str]]:
    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=12, block_size=2, compression_strategy=strategy) as writer:
        writer.add_examples(random_examples(strategy))
    exported = export_shards(dataset, tmp_path / "export")
    tables = tmp_path / "tables"
    index_tables(dataset, tables)
    tree = located_tree(dataset, tables)
    kinds = set()
    for s in range(len(tree.shards)):
        locators = tree.table(s).locators
        assert locators is not None
        for i in range(len(locators.offset)):
            number = int(locators.prefix[i])
            if int(locators.offset[i]) == NO_LOCATOR:
                continue
            kinds.add("inline" if number == INLINE else "kept" if number == KEPT else "prefix" if number else "run")
    tree.source.close()
    return dataset, tables, exported, kinds


def _files(exported: Exported) -> list[tuple[str, str]]:
    return [(shard, name) for shard, names in exported.items() for name in names]


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_every_kind_of_located_file_reads_exactly_whole_and_in_pieces(tmp_path: Path, strategy: int) -> None:
    dataset, tables, exported, kinds = _dataset(tmp_path, strategy)
    assert {"run", "prefix", "kept"} <= kinds and (strategy == 0 or "inline" in kinds), kinds
    files = _files(exported)
    errors: list[str] = []

    # Whole, by 3 readers each in its own random order (a fresh mount: nothing cached).
    log = tmp_path / "whole.log"
    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tables}") as mnt:
        def whole(seed: int) -> None:
            order = files[:]
            random.Random(seed).shuffle(order)
            for shard, name in order:
                try:
                    with open(mnt / shard / name, "rb", buffering=0) as f:
                        if f.read() != exported[shard][name]:
                            errors.append(f"whole {shard}/{name}")
                except OSError as exc:  # the daemon died (a sanitizer's abort): every read fails
                    errors.append(f"whole {shard}/{name}: {exc}")
                    return

        in_threads(whole, 3)
    assert errors == []
    answered = engine_answered_in_log(log)
    assert answered["located"][0] > 0 and answered["located"][1] == 0, answered
    assert answered["stored"][0] > 0, answered  # runs read alone, as stored

    # In pieces: a random piece first (the file's first request is from its middle), then the
    # file from its start in pieces of odd sizes, in random file order.
    log = tmp_path / "pieces.log"
    rng = random.Random(strategy)
    order = files[:]
    rng.shuffle(order)
    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tables}") as mnt:
        for shard, name in order:
            data = exported[shard][name]
            fd = os.open(mnt / shard / name, os.O_RDONLY)
            try:
                at = rng.randrange(len(data) + 1)
                size = rng.randrange(1, 5000)
                if os.pread(fd, size, at) != data[at:at + size]:
                    errors.append(f"piece {shard}/{name} at {at}")
                step = rng.choice([1, 7, 4093] if len(data) < 10_000 else [4093, 65537])
                got = b"".join(iter(lambda: os.read(fd, step), b""))  # noqa: B023 (used at once)
                if got != data:
                    errors.append(f"pieces {shard}/{name}")
                if os.pread(fd, 10, len(data) + 5) != b"":
                    errors.append(f"past the end {shard}/{name}")
            finally:
                os.close(fd)
    answered = engine_answered_in_log(log)
    assert errors == []
    assert answered["located"][0] > 0 and answered["located"][1] == 0, answered
