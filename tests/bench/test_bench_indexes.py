"""bench/indexes.py runs end to end at smoke sizes (200-sample shards of real media and of the text
set, each from Atlas and from its exported tars): every loader index is read in fresh mounts with
tables stored and with nothing stored, gives the same bytes every time (or the run fails), and its
reads again are the kernel's page cache (the mount is sent fewer READs than the whole reads made).

Pillow (bench/.venv-media) is installed by the run itself, as for bench/shuffle.py.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from benchprobe import run_probe, table_rows
from fusemount import require_fuse

SETS = ("media", "text")
SOURCES = ("atlas", "webdataset")
FILES = ("0.tar.idx", "0.idx", ".nv-meta/.info.json", ".nv-meta/split.yaml", ".nv-meta/dataset.yaml",
         ".nv-meta/index.sqlite", ".nv-meta/index.uuid")


@pytest.mark.fuse
def test_indexes_bench_smoke(tmp_path: Path) -> None:
    require_fuse()
    run = run_probe("indexes.py", "indexes", tmp_path, "--smoke", "--datasets", ",".join(SETS), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    data = run.data
    assert data["wrong"] == [] and data["samples"] == 200
    runs = data["runs"]
    assert sorted((r["dataset"], r["source"], r["file"], r["mode"]) for r in runs) == sorted(
        (d, s, f, m) for d in SETS for s in SOURCES for f in FILES for m in ("stored", "nothing stored"))
    for r in runs:
        assert r["first"] > 0 and r["again"] > 0 and r["tmpfs again"] > 0, r
        if r["file"] == "0.tar.idx":
            assert r["size"] == 8 * (200 + 1), r  # a uint64 a sample, then the end
        # 23 whole reads, the first sent to the daemon, the others the page cache's
        assert r["daemon reads"] is not None and 1 <= r["daemon reads"] <= math.ceil(r["size"] / 4096) + 1, r

    figures = data["figures"]
    for name in SETS:
        first = [row for row in table_rows(run.markdown, name) if len(row) == 9]
        again = [row for row in table_rows(run.markdown, name) if len(row) == 8]
        assert [(row[1], row[2]) for row in first] == [(s, f) for s in SOURCES for f in FILES]
        assert [(row[1], row[2]) for row in again] == [(s, f) for s in SOURCES for f in FILES]
        for row in first:  # the verdict is of the same run's figures
            stored, cold = (figures[f"{name}|{row[1]}|{row[2]}|{mode}"] for mode in ("stored", "nothing stored"))
            worst = max(stored["first"]["max"], cold["first"]["max"])
            assert row[6] == f"{1.0 / worst:.1f}" and row[7] == ("met" if worst < 1.0 else "**not met**"), row
        for row in again:
            f = figures[f"{name}|{row[1]}|{row[2]}|stored"]
            assert row[6] == f"{f['again']['median'] / f['tmpfs again']['median']:.2f}", row
        for source in SOURCES:  # the floor of a first mount, in process
            (row,) = table_rows(run.markdown, f"{name} {source}")
            assert all(float(cell.replace(",", "")) >= 0 for cell in row[2:]), row
            assert (row[1] == "-") == (source == "webdataset"), row  # a decode of Atlas blocks, for Atlas only
