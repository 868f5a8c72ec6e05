"""bench/memory.py runs end to end (``--smoke``): every figure measured, within its bound, no
wrong byte, no mount left behind."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fusemount import require_fuse

REPO = Path(__file__).resolve().parent.parent
SMOKE_TIMEOUT = 300
#: The rows of the report, each a daemon RSS beside its bound.
STEPS = ("mounted", "after `ls -R`", "after `tar cf - -C MNT .`", "max during 16 random readers",
         "first mount, tables built", "second mount, tables stored")


def _memory_mounts() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f if " - fuse" in line and "atlasfs-memory-bench-" in line.split()[4]}


@pytest.mark.fuse
def test_memory_bench_smoke_measures_every_figure_within_its_bound(tmp_path: Path) -> None:
    require_fuse()
    before = _memory_mounts()
    process = subprocess.Popen([sys.executable, str(REPO / "bench" / "memory.py"), "--smoke", "--out", str(tmp_path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        stdout, stderr = process.communicate(timeout=SMOKE_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)  # it unmounts on its way out
        stdout, stderr = process.communicate(timeout=60)
        pytest.fail(f"bench/memory.py --smoke took more than {SMOKE_TIMEOUT} s:\n{stderr[-3000:]}")
    assert _memory_mounts() <= before, "the benchmark left a mount behind"
    report = tmp_path / "smoke" / "memory-latest.md"
    assert report.exists(), f"no report (exit {process.returncode}):\n{stderr[-3000:]}"
    text = report.read_text()
    assert text == stdout.strip() + "\n" or text.strip() in stdout
    # the figures' table: case | after | RSS | peak | bound | within | files | notes
    rows = [cells for cells in ([cell.strip() for cell in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
                                for line in text.splitlines() if line.startswith(("| large |", "| listing |")))
            if len(cells) == 8]
    for step in STEPS:
        assert any(step in cells[1] for cells in rows), f"no row for {step!r}:\n{text}"
    for cells in rows:
        assert cells[5] == "yes", cells  # within the bound
    assert re.findall(r"(\d+) wrong bytes", text) == ["0", "0"], text
    assert "0 errors" in text
    assert process.returncode == 0, stderr[-3000:]
