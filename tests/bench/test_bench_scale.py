"""bench/scale.py runs end to end at smoke sizes (20,000 files in 4 shards): every figure measured
beside ratarmount, every RSS within its bound, no wrong byte, every count checked, the export
figure said to be a subset, and no mount left behind (tests/support/benchprobe.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchprobe import run_probe, table_rows
from fusemount import IN_CI, require_fuse


@pytest.mark.fuse
def test_scale_bench_smoke_measures_every_figure(tmp_path: Path) -> None:
    require_fuse()
    run = run_probe("scale.py", "scale", tmp_path, "--smoke", timeout=600)
    data, text = run.data, run.markdown
    ratarmount_missing = data["meta"]["ratarmount"] == "missing"
    if ratarmount_missing:
        assert "ratarmount figures are MISSING" in text
        if IN_CI:
            pytest.fail(f"ratarmount could not be installed in CI: {data['missing']}")
        assert run.returncode == 2, run.stderr[-3000:]  # not every figure was measured
    else:
        assert run.returncode == 0, run.stderr[-3000:]
        assert data["missing"] == [] and data["problems"] == [], (data["missing"], data["problems"])

    figures = data["figures"]
    assert data["data"]["files"] == 20_000 and data["data"]["shards"] == 4
    for key in ("atlasfs_first", "atlasfs_second") + (() if ratarmount_missing else ("ratarmount_first",
                                                                                      "ratarmount_second")):
        assert figures[key]["find_fps"] > 0 and figures[key]["mount_s"] > 0, key
    assert figures["index"]["seconds"] > 0
    assert figures["tar"]["fps"] > 0
    assert figures["readers"]["reads"] > 0 and figures["readers"]["wrong_bytes"] == 0
    assert figures["readers"]["errors"] == 0
    assert set(figures["export"]["fps"]) == {"tar cf", "export -j 1", "export -j 2"}
    assert "a SUBSET, 2 of 4 shards" in text

    # every RSS figure within the bound, and the targets table says so
    assert len(data["rss"]) == 4 and all(r["within"] for r in data["rss"])
    for target in data["targets"]:
        if target["enforced"]:
            assert target["met"] is True, target
        elif "ratarmount" in target["target"] and ratarmount_missing:
            assert target["met"] is None and target["measured"] is None, target
        else:
            assert target["met"] in (True, False) and target["measured"], target
    # the ratio is of the listing table's figures of the same run
    if not ratarmount_missing:
        (ours,) = table_rows(text, "atlasfs, tables stored")
        (theirs,) = table_rows(text, "ratarmount, index stored")
        (row,) = [t for t in data["targets"] if t["target"].startswith("stored-table `find`")]
        assert row["measured"].startswith(f"{ours[3]} / {theirs[3]} files/s"), (row, ours, theirs)
