"""bench/scale.py --listing-only (issue #39, point 5) at smoke sizes: the two listings and the
index, beside ratarmount, and nothing else; the phases it leaves out are not counted against
its exit code, and the stored-table ratio is of the same run's figures."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchprobe import run_probe
from fusemount import IN_CI, require_fuse


@pytest.mark.fuse
def test_scale_listing_only_measures_the_listings_alone(tmp_path: Path) -> None:
    require_fuse()
    run = run_probe("scale.py", "scale", tmp_path, "--smoke", "--listing-only", timeout=600)
    data = run.data
    ratarmount_missing = data["meta"]["ratarmount"] == "missing"
    if ratarmount_missing and IN_CI:
        pytest.fail(f"ratarmount could not be installed in CI: {data['missing']}")
    figures = data["figures"]
    assert {"atlasfs_first", "atlasfs_second", "index"} <= set(figures)
    assert not {"tar", "readers", "export"} & set(figures), sorted(figures)
    targets = {t["target"]: t for t in data["targets"]}
    assert not any("wrong bytes" in t or "export" in t for t in targets), sorted(targets)
    if ratarmount_missing:
        assert run.returncode == 2
        return
    assert run.returncode == 0, run.stderr[-3000:]
    assert data["missing"] == [] and data["problems"] == [], (data["missing"], data["problems"])
    (row,) = [t for t in data["targets"] if t["target"].startswith("stored-table `find`")]
    ours, theirs = figures["atlasfs_second"]["find_fps"], figures["ratarmount_second"]["find_fps"]
    assert row["measured"].endswith(f"= {ours / theirs:.2f}x"), (row, ours, theirs)
