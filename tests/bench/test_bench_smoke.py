"""The benchmark suite runs end to end (``bench/run.py --smoke``) and reports every figure.

ratarmount is installed from PyPI by the run itself (into bench/.venv-ratarmount, kept between
runs). If it cannot be installed, its figures must be reported missing with the reason; in CI
that is a failure, elsewhere the atlasfs and tmpfs figures are still checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchprobe import run_probe
from fusemount import IN_CI, require_fuse

DATASETS = ("image", "text", "tiny")


@pytest.mark.fuse
def test_bench_smoke_reports_every_figure(tmp_path: Path) -> None:
    require_fuse()
    result = run_probe("run.py", "latest", tmp_path / "results", "--smoke", timeout=600)
    data, markdown = result.data, result.markdown

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
