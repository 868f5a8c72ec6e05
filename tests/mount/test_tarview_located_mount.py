"""``cat`` of a mount's ``<shard>.tar`` (``--view tars``) over incompressible files: each file read
through its locator by the tar's pass (``LocatedReads.in_pass``), readers of the same and of
other tars at once: every reader gets exactly ``atlasfs export``'s tar, and the daemon stays
within its bound (the unit tests, tests/unit/tree/test_tarview_located.py, count the reads)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import numpy as np

import atlasfs.tree.tarstream as tarstream
from atlasfs import AtlasWriter
from atlasfs.commands import cli
from fusemount import DAEMON_OVERHEAD, mounted, proc_status
from locateddata import index_tables

MIB = 1 << 20
CACHE = "16M"
SHARDS = 3


def test_concurrent_cats_of_tars_of_jpegs_get_the_export_within_the_bound(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=100, block_size=8, compression_strategy=2) as writer:
        writer.add_examples([{"jpg": rng.bytes(int(rng.integers(20_000, 60_000))), "cls": i, "json": {"id": i}}
                             for i in range(100 * SHARDS)])
    assert cli.main(["export", str(dataset), str(tmp_path / "export")]) == 0
    exported = {s: (tmp_path / "export" / f"{s}.tar").read_bytes() for s in range(SHARDS)}
    assert all(len(tar) > tarstream.WINDOW for tar in exported.values())  # past a pass's window
    index_tables(dataset, tmp_path / "tables")
    log = tmp_path / "daemon.log"
    with mounted(dataset, "--view", "tars", "--cache-size", CACHE, "-o", f"index_dir={tmp_path / 'tables'}",
                 "-o", f"log_file={log}") as mnt:
        pid = int(re.search(r"atlasfs\[(\d+)\]: mounted", log.read_text()).group(1))  # type: ignore[union-attr]
        # two readers of each tar at once: more passes than are kept (STREAMS), some requests
        # then served by the random-access read
        readers = [(s, subprocess.Popen(["cat", str(mnt / f"{s}.tar")], stdout=subprocess.PIPE))
                   for s in range(SHARDS) for _ in range(2)]
        got = [(s, process.communicate(timeout=120)[0], process.returncode) for s, process in readers]
        peak = proc_status(pid, "VmHWM")
        print(f"daemon peak RSS {peak / MIB:.0f} MiB")
    for s, data, code in got:
        assert code == 0 and data == exported[s], f"{s}.tar: {len(data)} bytes, the export {len(exported[s])}"
    # the cache, the passes kept (each its window, what it makes ahead and a request) and the rest
    passes = tarstream.STREAMS * (tarstream.WINDOW + tarstream.LEAD + 2 * MIB)
    assert peak <= 16 * MIB + passes + DAEMON_OVERHEAD, f"peak RSS {peak / MIB:.0f} MiB"
