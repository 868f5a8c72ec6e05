"""bench/memory.py runs end to end (``--smoke``): every figure measured, within its bound, no
wrong byte, no mount left behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchprobe import run_probe
from fusemount import require_fuse

#: The rows of the report, each a daemon RSS beside its bound.
STEPS = ("mounted", "after `ls -R`", "after `tar cf - -C MNT .`", "max during 16 random readers",
         "first mount, tables built", "second mount, tables stored")


@pytest.mark.fuse
def test_memory_bench_smoke_measures_every_figure_within_its_bound(tmp_path: Path) -> None:
    require_fuse()
    run = run_probe("memory.py", "memory-latest", tmp_path, "--smoke")
    text = run.markdown
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
    assert all(f["within"] for f in run.data["figures"]) and len(run.data["figures"]) == len(STEPS)
    assert run.returncode == 0, run.stderr[-3000:]
