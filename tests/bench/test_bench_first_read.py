"""bench/first_read.py runs end to end at smoke sizes: the three sets (real JPEGs, the suite's image
set, the issue's random bytes), one pass each in a fresh mount; every block read once, its first
read's bytes checked against the source files, each read beside its in-process decompression up
to the file's end and whole; the table's verdicts are those of its own figures.

Pillow (bench/.venv-media) is installed by the run itself, as for bench/shuffle.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchprobe import run_probe, table_rows
from fusemount import require_fuse

SETS = ("real", "image", "random")
COLUMNS = ("set", "first reads", "p50 (ms)", "up to, p50", "p50 target", "p50", "p99 (ms)", "whole, p99",
           "p99 target", "p99", "excess, median", "whole, p50", "later read, p50", "bytes")


@pytest.mark.fuse
def test_first_read_bench_smoke(tmp_path: Path) -> None:
    require_fuse()
    run = run_probe("first_read.py", "first_read", tmp_path, "--smoke", timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    sets = run.data["sets"]
    assert sorted(sets) == sorted(SETS)
    for name, result in sets.items():
        assert len(result["passes"]) == 1, name
        reads = result["passes"][0]["reads"]
        # each block read once (but each shard's first, read first untimed), every byte as the source's
        shards = len({r["shard"] for r in reads})
        assert len(reads) == result["blocks"] - shards and len(reads) >= 4, (name, len(reads))
        assert all(r["block"] > 0 for r in reads), name
        assert len({(r["shard"], r["block"]) for r in reads}) == len(reads), name
        assert all(r["ok"] for r in reads) and result["passes"][0]["wrong"] == 0, name
        later = result["passes"][0]["later_reads"]  # another file of every block read
        assert len(later) == len(reads) and all(r["ok"] and r["ms"] > 0 for r in later), name
        assert {r["file"] for r in later}.isdisjoint(r["file"] for r in reads), name
        assert shards >= 2, name
        for r in reads:
            assert r["ms"] > 0 and r["whole_ms"] > 0 and r["up_to_ms"] >= 0, r
            assert 0 < r["end"] <= r["content"], r  # the file lies in its block's decompressed bytes
        s = result["summary"]
        assert s["reads"] == len(reads) and s["wrong"] == 0
        assert s["p50_ms"] <= s["p99_ms"]
        assert s["p50_target_ms"] == pytest.approx(s["up_to_p50_ms"] + 0.15)
        assert s["p99_target_ms"] == pytest.approx(s["whole_p99_ms"] + 0.3)
        row = table_rows(run.markdown, name)[0]
        cells = dict(zip(COLUMNS, row))
        assert cells["first reads"] == f"{len(reads):,}"
        assert float(cells["p50 (ms)"]) == pytest.approx(s["p50_ms"], abs=0.0006)
        assert cells["p50"] == ("met" if s["p50_ms"] <= s["p50_target_ms"] else "not met"), row
        assert cells["p99"] == ("met" if s["p99_ms"] <= s["p99_target_ms"] else "not met"), row
        assert cells["bytes"] == "ok"
    real = sets["real"]["passes"][0]["reads"]
    assert all(r["file"].endswith(".jpg") for r in real)
    assert all(r["file"].endswith(".bin") for r in sets["random"]["passes"][0]["reads"])
    # real media written with the writer's defaults: blocks of 64 JPEGs of ~40 KB, megabytes a block
    assert max(r["content"] for r in real) > 1_000_000
