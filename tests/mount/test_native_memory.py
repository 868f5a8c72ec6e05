"""Located reads in C stay within the byte cache's bound however many workers read at once
(issue #35, point 10): each worker that reads a file of a block not yet decompressed made the
block's payload and held it while it answered, so 4 readers of 4 blocks held 4 payloads
(``--cache-size 16M``, blocks of 256 MiB: 1,054 MiB with 4 readers). A payload being made and
served now reserves its bytes of the bound first (cache_reserve): the others wait, and one
larger than the whole bound goes alone."""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path

import numpy as np

from atlasfs import AtlasWriter
from fusemount import DAEMON_OVERHEAD, engine_answered_in_log, mounted, proc_status
from locateddata import index_tables

MIB = 1 << 20
BLOCK_FILES = 128  # files of 256 KiB: a block of 32 MiB
FILE_BYTES = 256 << 10
BLOCKS = 4
CACHE = "16M"


def test_concurrent_located_readers_of_different_blocks_stay_within_the_cache_bound(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    # Bytes of 4 values: zstd compresses them ~3.5 times (each block's frame must be decompressed).
    files = [(rng.integers(0, 4, FILE_BYTES, dtype=np.uint8) + 97).tobytes() for _ in range(BLOCK_FILES)]
    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=BLOCK_FILES * BLOCKS, block_size=BLOCK_FILES, compression_strategy=1) as w:
        # The same files in every block, rotated: the blocks differ, nothing is shared.
        w.add_examples([{"bin": files[(i + b) % BLOCK_FILES]} for b in range(BLOCKS) for i in range(BLOCK_FILES)])
    index_tables(dataset, tmp_path / "tables")
    log = tmp_path / "daemon.log"
    with mounted(dataset, "--cache-size", CACHE, "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        pid = int(re.search(r"atlasfs\[(\d+)\]: mounted", log.read_text()).group(1))  # type: ignore[union-attr]
        names = sorted(os.listdir(mnt / "0"))
        assert len(names) == BLOCK_FILES * BLOCKS
        start = threading.Barrier(BLOCKS)
        errors: list[str] = []

        def reader(b: int) -> None:
            start.wait()
            for i in (5, 77, 120):  # three files of block b
                row = b * BLOCK_FILES + i
                with open(mnt / "0" / names[row], "rb", buffering=0) as f:
                    if f.read() != files[(i + b) % BLOCK_FILES]:
                        errors.append(names[row])

        began = time.monotonic()
        threads = [threading.Thread(target=reader, args=(b,)) for b in range(BLOCKS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        took = time.monotonic() - began
        peak = proc_status(pid, "VmHWM")
        print(f"daemon peak RSS {peak / MIB:.0f} MiB, {took:.1f} s")
    assert errors == []
    answered = engine_answered_in_log(log)
    assert answered["located"][0] >= 3 * BLOCKS and answered["read"][1] == 0, answered
    if os.environ.get("ATLASFS_TEST_SANITIZED"):
        return  # ASan's shadow memory and quarantine are no measure of the engine's (452 MiB there)
    bound = 16 * MIB
    assert peak <= bound + DAEMON_OVERHEAD, \
        f"peak RSS {peak / MIB:.0f} MiB past {CACHE} + {DAEMON_OVERHEAD // MIB} MiB ({took:.1f} s)"
