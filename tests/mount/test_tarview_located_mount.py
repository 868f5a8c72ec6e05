"""``cat`` of a mount's ``<shard>.tar`` (``--view tars``) over incompressible files: each file read
through its locator by the tar's pass (``LocatedReads.block_in_pass``), readers of the same and of
other tars at once: every reader gets exactly ``atlasfs export``'s tar, and the daemon stays
within its bound (the unit tests, tests/unit/tree/test_tarview_located.py, count the reads)."""

from __future__ import annotations

import errno
import re
import subprocess
import time
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


def test_a_data_bin_rewritten_during_a_cat_of_its_tar_fails_the_rest_with_eio(tmp_path: Path) -> None:
    """data.bin rewritten while its tar is read (same size, another dataset's bytes): what was
    read before is the export's, and the rest fails with EIO, never the new bytes after the old
    (the pass checks data.bin after each block's reads: tests/unit/tree/test_tarview_located.py)."""
    sizes = np.random.default_rng(0).integers(20_000, 60_000, 600)

    def write(root: Path, seed: int) -> Path:
        rng = np.random.default_rng(seed)
        with AtlasWriter(root, shard_size=len(sizes), block_size=8, compression_strategy=0) as writer:
            writer.add_examples([{"jpg": rng.bytes(int(size)), "cls": i} for i, size in enumerate(sizes)])
        return root

    dataset, other = write(tmp_path / "ds", 1), write(tmp_path / "other", 2)
    data, new = dataset / "0" / "data.bin", (other / "0" / "data.bin").read_bytes()
    assert len(new) == data.stat().st_size and new != data.read_bytes()  # same size, other bytes
    assert cli.main(["export", str(dataset), str(tmp_path / "export")]) == 0
    exported = (tmp_path / "export" / "0.tar").read_bytes()
    assert len(exported) > 4 * (tarstream.WINDOW + tarstream.LEAD)  # far past what a pass makes ahead
    index_tables(dataset, tmp_path / "tables")
    got = b""
    with mounted(dataset, "--view", "tars", "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        with open(mnt / "0.tar", "rb", buffering=0) as tar:
            got = tar.read(MIB)
            time.sleep(tarstream.IDLE + 0.5)  # the pass's lead thread gone idle, its read-ahead done
            data.write_bytes(new)
            try:
                while part := tar.read(MIB):
                    got += part
            except OSError as exc:
                failed = exc.errno
            else:
                failed = 0
    assert failed == errno.EIO, f"read {len(got)} of {len(exported)} bytes, then error {failed}"
    assert MIB <= len(got) < len(exported) and got == exported[:len(got)]
