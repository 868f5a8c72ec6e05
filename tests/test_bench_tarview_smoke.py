"""bench/tarview.py runs end to end at smoke sizes and prints every figure (the mounted tars
equal the exports, or it fails)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fusemount import require_fuse

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.fuse
def test_tarview_bench_smoke() -> None:
    require_fuse()
    result = subprocess.run([sys.executable, str(REPO / "bench" / "tarview.py"), "--smoke"], capture_output=True,
                            text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["image", "text", "tiny"], result.stdout
    for row in rows[1:]:
        cells = [cell.strip() for cell in row.split("|")[2:-1]]
        assert len(cells) == 7 and all(float(cell) > 0 for cell in cells), row
    with open("/proc/self/mountinfo") as f:
        assert not any("tarview-" in line.split()[4] for line in f)
