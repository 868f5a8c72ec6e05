"""Running a benchmark of ``bench/`` from a test: a real run of the script, in a subprocess, at its
smoke sizes, through the harness (``bench/harness.py``), with its report read back."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ProbeRun:
    """A finished run: its exit code, output, and its report (``OUT/<report>.md`` and ``.json``)."""

    returncode: int
    stdout: str
    stderr: str
    markdown: str
    data: dict[str, Any]


def bench_mounts() -> set[str]:
    """FUSE mounts in the harness's work folders (``atlasfs-bench-*``; other tests may mount meanwhile)."""
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f if " - fuse" in line and "atlasfs-bench-" in line.split()[4]}


def run_probe(script: str, report: str, out: Path, *args: str, timeout: float = 300) -> ProbeRun:
    """``python bench/<script> --out OUT ARGS``; fails the test if it times out (after stopping it with
    SIGTERM, so that it unmounts on its way out), leaves a mount behind or writes no report."""
    before = bench_mounts()
    process = subprocess.Popen([sys.executable, str(REPO / "bench" / script), "--out", str(out), *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(f"bench/{script} {' '.join(args)} took more than {timeout:.0f} s:\n{stderr[-3000:]}")
    assert bench_mounts() <= before, f"bench/{script} left a mount behind"
    md, js = out / f"{report}.md", out / f"{report}.json"
    assert md.exists() and js.exists(), f"bench/{script}: no report (exit {process.returncode}):\n{stderr[-3000:]}"
    markdown = md.read_text()
    assert markdown == stdout, "the report printed is the report written"
    data = json.loads(js.read_text())
    assert data["meta"]["command"].startswith(f"python bench/{script} --out"), data["meta"]
    assert markdown.startswith("# ") and f"- command: `{data['meta']['command']}`" in markdown
    return ProbeRun(process.returncode, stdout, stderr, markdown, data)


def table_rows(markdown: str, first_cell: str) -> list[list[str]]:
    """The cells of every Markdown table row of ``markdown`` whose first cell is ``first_cell``."""
    rows = []
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [cell.strip() for cell in line.strip().strip("|").split(" | ")]
            if cells[0] == first_cell:
                rows.append(cells)
    return rows
