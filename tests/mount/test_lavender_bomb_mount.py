"""A Lavender dataset holding a parquet decompression bomb (``texts/shard.00000.parquet``: 15 KB,
5.4 GB decoded), under every command: ``verify``, ``export`` and ``pack`` fail that shard in one
line naming the file, within seconds, at a peak under 500 MiB; a mount serves the other shard,
fails the bomb's files with EIO and stays within the same memory. Before the row-group bound
(``atlasfs.formats.lavender.bounds``) each of them decoded the 5.4 GB."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from atlasfs.formats.lavender import write_csv_shard
from fusemount import mounted, proc_status
from parquetbomb import dictionary_bomb, padding_bomb

UIDS = [f"u{i}" for i in range(5400)]
PEAK = 500 << 20
DEADLINE = 60
REFUSED = "texts/shard.00000.parquet: row group 0 decodes to more than the row-group bound of"


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    """Shardsets ``meta`` (csv: uid, caption) and ``texts`` (parquet: uid, text); shard 0's texts
    file is the bomb, shard 1 is sound."""
    root = tmp_path / "ds"
    (root / "meta").mkdir(parents=True)
    (root / "texts").mkdir()
    write_csv_shard(str(root / "meta" / "shard.00000.csv"), [{"uid": u, "caption": f"c {u}"} for u in UIDS])
    write_csv_shard(str(root / "meta" / "shard.00001.csv"), [{"uid": f"v{i}", "caption": f"c v{i}"} for i in range(10)])
    bomb = dictionary_bomb(root / "texts" / "shard.00000.parquet", UIDS)
    assert bomb.stat().st_size < 64 << 10
    pq.write_table(pa.table({"uid": [f"v{i}" for i in range(10)], "text": [f"hello v{i}" for i in range(10)]}),
                   root / "texts" / "shard.00001.parquet")
    return root


_MEASURED = """
import resource, subprocess, sys
result = subprocess.run([sys.executable, "-m", "atlasfs", *sys.argv[2:]], capture_output=True, text=True)
sys.stdout.write(result.stdout + result.stderr)
with open(sys.argv[1], "w") as f:
    f.write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024))
sys.exit(result.returncode)
"""


def run_measured(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], int, float]:
    """``atlasfs ARGS``, its peak resident memory (bytes, of it and its workers) and seconds."""
    peak = tmp_path / "peak"
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", _MEASURED, str(peak), *args], capture_output=True, text=True,
                            timeout=DEADLINE)
    return result, int(peak.read_text()), time.monotonic() - start


def the_line(output: str) -> str:
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if REFUSED in line]
    assert len(lines) == 1, output
    return lines[0]


def test_verify(dataset: Path, tmp_path: Path) -> None:
    result, peak, seconds = run_measured(tmp_path, "verify", str(dataset))
    assert result.returncode == 1, result.stdout
    assert the_line(result.stdout) == (f"{dataset}/{REFUSED} 134217728 bytes (a decompression bomb?); not read")
    assert peak < PEAK and seconds < 30, (peak >> 20, seconds)


def test_verify_counts_a_page_past_a_chunks_end(dataset: Path, tmp_path: Path) -> None:
    """The bomb's data page hidden past its chunk's stated end, under an old parquet-mr's footer
    (pyarrow reads it there: PARQUET-816): refused from the page headers, nothing decoded."""
    padding_bomb(dataset / "texts" / "shard.00000.parquet", UIDS)
    result, peak, seconds = run_measured(tmp_path, "verify", str(dataset))
    assert result.returncode == 1, result.stdout
    lines = [line for line in result.stdout.splitlines() if "texts/shard.00000.parquet: " in line]
    assert "Traceback" not in result.stdout and len(lines) == 1, result.stdout
    assert lines[0].endswith("texts/shard.00000.parquet: row group 0 column 'text': its data pages hold 0 values, "
                             "fewer than the 5400 the footer states; not read"), lines[0]
    assert peak < PEAK and seconds < 30, (peak >> 20, seconds)


def test_export_writes_the_other_shard(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result, peak, seconds = run_measured(tmp_path, "export", str(dataset), str(out))
    assert result.returncode == 1, result.stdout
    assert the_line(result.stdout).startswith("atlasfs: export of shard shard.00000 failed: ")
    assert [p.name for p in out.glob("*.tar")] == ["shard.00001.tar"]
    assert peak < PEAK and seconds < 30, (peak >> 20, seconds)


def test_pack_stops_in_one_line(dataset: Path, tmp_path: Path) -> None:
    out = tmp_path / "packed"
    result, peak, seconds = run_measured(tmp_path, "pack", str(dataset), str(out))
    assert result.returncode == 1, result.stdout
    assert the_line(result.stdout).startswith(f"atlasfs: pack stopped, {out} not written: source shard shard.00000 ")
    assert not out.exists()
    assert peak < PEAK and seconds < 30, (peak >> 20, seconds)


def test_a_mount_serves_the_rest_within_its_memory(dataset: Path, tmp_path: Path) -> None:
    log = tmp_path / "log"
    with mounted(dataset, "-o", f"log_file={log}") as mnt:
        assert sorted(os.listdir(mnt)) == ["shard.00000", "shard.00001"]
        assert (mnt / "shard.00001" / "v3.text").read_text() == "hello v3"
        listing = subprocess.run(["ls", str(mnt / "shard.00000")], capture_output=True, text=True, timeout=DEADLINE)
        names = listing.stdout.split()
        assert names and all(name.endswith(".unreadable") for name in names), listing
        cat = subprocess.run(["cat", str(mnt / "shard.00000" / names[3])], capture_output=True, text=True,
                             timeout=DEADLINE)
        assert cat.returncode != 0 and "Input/output error" in cat.stderr, cat
        assert (mnt / "shard.00001" / "v4.caption.txt").read_text() == "c v4"
        assert proc_status(_daemon_pid(mnt), "VmHWM") < PEAK
    logged = [line for line in log.read_text().splitlines() if REFUSED in line]
    assert logged and all("(its files fail with EIO)" in line for line in logged), log.read_text()


def _daemon_pid(mnt: Path) -> int:
    """The pid of the daemon serving ``mnt`` (its command line names the mount point)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                command = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"mount" in command and str(mnt).encode() in command:
                return int(entry.name)
    raise AssertionError(f"no daemon found for {mnt}")
