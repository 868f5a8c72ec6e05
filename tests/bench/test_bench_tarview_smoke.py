"""bench/tarview.py runs end to end at smoke sizes and prints every figure (the mounted tars
equal the exports, or it fails)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchprobe import run_probe, table_rows
from fusemount import require_fuse


@pytest.mark.fuse
def test_tarview_bench_smoke(tmp_path: Path) -> None:
    require_fuse()
    run = run_probe("tarview.py", "tarview", tmp_path, "--smoke")
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("image", "text", "tiny"):
        (row,) = table_rows(run.markdown, name)
        # MB/s and ratios, then CPU milliseconds (clock ticks of 10 ms: a smoke tar may take none)
        paired = row.pop(5)  # each repeat's cold / export: "median (min-max)"
        assert len(row) == 10 and all(float(cell) > 0 for cell in row[1:8]), row
        assert all(float(cell) >= 0 for cell in row[8:]), row
        figures = run.data["datasets"][name]
        assert f"{figures['cold cat'] / figures['export']:.2f}" == row[4]  # the ratio is of the same run's figures
        low, high = figures["cold / export min"], figures["cold / export max"]
        assert paired == f"{figures['cold / export']:.2f} ({low:.2f}-{high:.2f})" and 0 < low <= high, paired
