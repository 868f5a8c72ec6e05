"""bench/shuffle.py runs end to end at smoke sizes (400 real-media samples in 2 shards): every pass
of every system reports its figures, and every pass read the source files' bytes (or it fails).

Pillow (bench/.venv-media) and squashfuse (Debian) are installed by the run itself. If squashfuse
cannot be installed, its figures must be reported missing with the reason; in CI that is a
failure, elsewhere atlasfs's and tmpfs's figures are still checked.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchprobe import run_probe, table_rows
from fusemount import IN_CI, require_fuse

PASSES = ("1 reader", "4 readers", "map-style loop")
SYSTEMS = ("atlasfs", "squashfuse_ll", "tmpfs")


@pytest.mark.fuse
def test_shuffle_bench_smoke(tmp_path: Path) -> None:
    require_fuse()
    run = run_probe("shuffle.py", "shuffle", tmp_path, "--smoke", timeout=600)
    data, unavailable = run.data, run.data["meta"]["unavailable"]
    if "squashfuse_ll" in unavailable:
        assert "squashfuse_ll figures are MISSING" in run.markdown
        if IN_CI:
            pytest.fail(f"squashfuse could not be installed in CI: {unavailable['squashfuse_ll']}")
        assert run.returncode == 2, run.stderr[-3000:]
    else:
        assert run.returncode == 0, run.stderr[-3000:]
    present = [s for s in SYSTEMS if s not in unavailable]
    assert "atlasfs" in present

    # 400 samples of three files each, the .jpg about 40 KB (real JPEGs, not a few bytes)
    assert data["data"]["file_count"] == 3 * 400 and len(data["data"]["shards"]) == 2
    assert 20_000 < data["data"]["jpg_bytes"] / 400 < 80_000
    assert data["wrong"] == []
    source = data["source_bytes"]
    assert source["files"] == data["data"]["jpg_bytes"] == source["samples"]
    runs = data["runs"]
    assert {(r["system"], r["pass"]) for r in runs} == {(s, p) for s in present for p in PASSES}
    for r in runs:  # every pass read every file of the source whole, right
        assert r["count"] == 400 and r["wrong"] == 0, r
        assert r["bytes"] == r["expected_bytes"] == source[r["unit"]], r
        assert r["per_s"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"], r

    for pass_name in PASSES:
        rows = table_rows(run.markdown, pass_name)
        assert [row[1] for row in rows] == [
            "samples/s" if pass_name == "map-style loop" else "files/s", "p50 (ms)", "p99 (ms)"]
        for row in rows:
            cells = dict(zip(("pass", "figure", *SYSTEMS, "vs squashfuse_ll", "vs tmpfs"), row))
            for system in SYSTEMS:
                if system in present:  # a median (and, with 1 repeat, nothing else)
                    assert float(cells[system].replace(",", "")) > 0, row
                else:
                    assert cells[system] == "missing", row
            assert float(cells["vs tmpfs"]) > 0, row
            figure = {"files/s": "per_s", "samples/s": "per_s", "p50 (ms)": "p50_ms", "p99 (ms)": "p99_ms"}[row[1]]
            atlas = data["figures"][pass_name]["atlasfs"][figure]["median"]
            tmpfs = data["figures"][pass_name]["tmpfs"][figure]["median"]
            assert cells["vs tmpfs"] == f"{atlas / tmpfs:.3g}"  # the ratio is of the same run's figures
