"""The benchmark suite runs end to end (``bench/run.py --smoke``) and reports every figure.

ratarmount is installed from PyPI by the run itself (into bench/.venv-ratarmount, kept between
runs). If it cannot be installed, its figures must be reported missing with the reason; in CI
that is a failure, elsewhere the atlasfs and tmpfs figures are still checked.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from fusemount import IN_CI, require_fuse

REPO = Path(__file__).resolve().parent.parent
DATASETS = ("image", "text", "tiny")
SMOKE_TIMEOUT = 600


def _run_smoke(out: Path) -> subprocess.CompletedProcess[str]:
    """Run the smoke benchmark; on a timeout stop it with SIGTERM so that it unmounts on its way out."""
    process = subprocess.Popen([sys.executable, str(REPO / "bench" / "run.py"), "--smoke", "--out", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        stdout, stderr = process.communicate(timeout=SMOKE_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        pytest.fail(f"bench/run.py --smoke took more than {SMOKE_TIMEOUT} s:\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _bench_mounts() -> set[str]:
    """FUSE mounts in the benchmark's work folders (other tests may mount meanwhile)."""
    with open("/proc/self/mountinfo") as f:
        return {line.split()[4] for line in f if " - fuse" in line and "atlasfs-bench-" in line.split()[4]}


@pytest.mark.fuse
def test_bench_smoke_reports_every_figure(tmp_path: Path) -> None:
    require_fuse()
    before = _bench_mounts()
    out = tmp_path / "results"
    result = _run_smoke(out)
    assert _bench_mounts() <= before, "the benchmark left a mount behind"
    assert (out / "latest.json").exists(), f"no report (exit {result.returncode}):\n{result.stderr[-3000:]}"
    data = json.loads((out / "latest.json").read_text())
    markdown = (out / "latest.md").read_text()

    unavailable = data["meta"]["unavailable"]
    if "ratarmount" in unavailable:
        assert "ratarmount figures are MISSING" in markdown
        if IN_CI:
            pytest.fail(f"ratarmount could not be installed in CI: {unavailable['ratarmount']}")
    assert result.returncode == 0, f"bench/run.py --smoke exited {result.returncode}:\n{result.stderr[-3000:]}"

    assert set(data["datasets"]) == set(DATASETS)
    for name in DATASETS:
        dataset = data["datasets"][name]
        assert dataset["mismatches"] == [], dataset["mismatches"]
        assert f"### {name}:" in markdown
        for figure_id, figure in dataset["figures"].items():
            assert "atlasfs" in figure["systems"], figure_id
            for system, stats in figure["systems"].items():
                where = f"{name} {figure_id} {system}"
                if system in unavailable:
                    assert "median" not in stats and stats["missing"], where
                    continue
                assert "missing" not in stats, f"{where}: {stats.get('missing')}"
                assert stats["median"] > 0 and stats["min"] <= stats["median"] <= stats["max"], where
                if not figure_id.startswith("mount"):  # every fresh mount adds a mount time
                    assert len(stats["samples"]) == data["meta"]["repeat"], where
            for key, value in figure["ratios"].items():
                if key.split("/")[1] not in unavailable:
                    assert value is not None and value > 0, f"{name} {figure_id} {key}"

    targets = data["targets"]
    assert {t["dataset"] for t in targets} == set(DATASETS)
    for target in targets:
        if "ratarmount" in target["target"] and "ratarmount" in unavailable:
            assert target["measured"] is None and target["met"] is None
        else:
            assert target["measured"] is not None and target["met"] in (True, False), target


@pytest.mark.fuse
def test_floor_script_runs_and_reports_every_line() -> None:
    """bench/floor.py mounts its own trivial Tree through the adapter (it broke once when the
    Tree interface grew a method its tree shadowed)."""
    require_fuse()
    result = subprocess.run([sys.executable, str(REPO / "bench" / "floor.py"), "--files", "300", "--repeat", "1"],
                            capture_output=True, text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("tmpfs", "adapter cold", "adapter warm"):
        line = next((line for line in result.stdout.splitlines() if line.strip().startswith(name)), "")
        assert "files/s" in line and "of tmpfs" in line, result.stdout
    with open("/proc/self/mountinfo") as f:
        assert not [line for line in f if "atlasfs-floor-" in line]
