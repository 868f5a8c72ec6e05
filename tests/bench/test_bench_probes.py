"""Every probe of ``bench/`` runs end to end through the harness at its smoke sizes (a few seconds
each): its report is written and printed, its figures are measured, its ratios are of figures of
the same run, and it leaves no mount behind (tests/support/benchprobe.py). The suite (bench/run.py),
memory.py and tarview.py have their own tests."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from benchprobe import ProbeRun, run_probe, table_rows
from fusemount import require_fuse
from s3server import unavailable


@pytest.mark.fuse
def test_floor_serves_its_tree_and_an_atlas_dataset_and_reports_every_line(tmp_path: Path) -> None:
    """bench/floor.py mounts its own trivial Tree through the native engine's Python control plane
    (it broke once when the Tree interface grew a method its tree shadowed) and an indexed Atlas
    dataset, tar and parallel readers."""
    require_fuse()
    run = run_probe("floor.py", "floor", tmp_path, "--smoke")
    assert run.returncode == 0, run.stderr[-3000:]
    (case,) = run.data["cases"].values()
    tmpfs = statistics.median(case["tmpfs"])
    floor = "floor (Python control plane)"
    names = ("tmpfs", f"{floor} cold", f"{floor} warm", f"{floor} 1 reader", f"{floor} 4 readers", "atlas cold",
             "atlas 1 reader", "atlas 4 readers")
    assert set(case) == set(names), sorted(case)
    for name in names:
        (row,) = table_rows(run.markdown, name)
        assert float(row[1].replace(",", "")) > 0, row  # files/s
        assert row[4] == f"{tmpfs / statistics.median(case[name]):.3f}", row  # of tmpfs, in the same run


@pytest.mark.fuse
def test_cold_random_measures_atlasfs_and_reports_ratarmount_missing(tmp_path: Path) -> None:
    """Without ratarmount (as every smoke run but the suite's) its column and the ratios are
    "missing", never 0, and the exit code says so."""
    require_fuse()
    run = run_probe("cold_random.py", "cold_random", tmp_path, "--smoke", "--no-ratarmount", "--datasets", "tiny")
    assert run.returncode == 2, run.stderr[-3000:]
    result = run.data["results"]["tiny"]
    assert result["wrong_passes"] == 0 and set(result["raw"]) == {"atlasfs"}
    rows = table_rows(run.markdown, "tiny")
    assert len(rows) == 7, run.markdown
    for row in rows[:5]:
        assert row[2] != "missing" and row[3] == "missing" and row[4] == "missing", row
    decompression = result["block_decompression"]
    assert decompression["blocks"] > 0 and 0 < decompression["p50_ms"] <= decompression["p90_ms"]
    for row in rows[5:]:  # a block decompressed whole: atlasfs's own figure, measured without a mount
        assert "decompressed whole" in row[1] and float(row[2]) > 0 and row[3] == "none" and row[4] == "missing", row
    assert "ratarmount figures are MISSING: skipped (--no-ratarmount)" in run.markdown


@pytest.mark.fuse
def test_dolma_listing_against_parse(tmp_path: Path) -> None:
    require_fuse()
    run = run_probe("dolma.py", "dolma", tmp_path, "--smoke")
    assert run.returncode == 0, run.stderr[-3000:]
    d = run.data
    assert d["lines"] == 2000 and d["files"] >= d["lines"]
    assert d["parse_s"] > 0 and d["first_listing_s"] > 0 and d["second_listing_s"] > 0
    assert f"{d['first_listing_s'] / d['parse_s']:.2f}x the plain parse" in run.markdown
    assert d["cat_bytes"] > 0 and d["daemon_read_bytes"] > 0


@pytest.mark.fuse
def test_lavender_pbin_listing_against_parse(tmp_path: Path) -> None:
    require_fuse()
    run = run_probe("lavender_pbin.py", "lavender_pbin", tmp_path, "--smoke")
    assert run.returncode == 0, run.stderr[-3000:]
    for name in ("lavender csv (2 sets)", "lavender parquet (2 sets)", "pbin (2-byte tokens)"):
        found = run.data["results"][name]
        (row,) = table_rows(run.markdown, name)
        ratio = statistics.median(found["first"]) / statistics.median(found["parse"])
        assert row[3] == f"{ratio:.1f}x" and all(v > 0 for v in found["first"] + found["second"]), row


@pytest.mark.fuse
def test_s3_cold_tar_against_fetch_and_its_gets(tmp_path: Path) -> None:
    require_fuse()
    try:
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as exc:
        unavailable(f"moto[server] and s3fs are needed ({exc})")
    run = run_probe("s3.py", "s3", tmp_path, "--smoke")
    d = run.data
    assert 0 < d["gets"] <= d["get_bound"] and d["other_requests"] == {}, d
    assert d["ratio"] == statistics.median(d["fetch_s"]) / statistics.median(d["cold_tar_s"])
    assert f"cold tar / fetch: {d['ratio']:.2f}" in run.markdown
    assert run.returncode == (0 if d["ratio"] >= 0.5 else 1), run.stderr[-3000:]


def test_spans_probe_reads_both_paths(tmp_path: Path) -> None:
    """Every sampled file's bytes read both ways agree (the probe exits non-zero otherwise)."""
    run = run_probe("spans_probe.py", "spans_probe", tmp_path, "--smoke", "--datasets", "tiny,image",
                    "--strategies", "0,2", "--reads", "50")
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(run.data["results"]) == 4
    for result in run.data["results"]:
        assert result["files_with_span"] > 0 and len(result["block_path_us"]) == len(result["span_path_us"]) == 50
    rows = table_rows(run.markdown, "tiny") + table_rows(run.markdown, "image")
    assert len(rows) == 4 and rows[0][3] == str(run.data["results"][0]["files"]), rows


@pytest.mark.fuse
@pytest.mark.parametrize("compared, sides", [(("--baseline", "HEAD"), ("baseline", "working tree")),
                                             (("--views", "files,both"), ("--view files", "--view both"))],
                         ids=["revisions", "views"])
def test_ab_compares_two_sides_on_the_same_bytes(tmp_path: Path, compared: tuple[str, str],
                                                 sides: tuple[str, str]) -> None:
    """bench/ab.py runs a revision and the working tree (or two views of the working tree) over
    the same dataset, each figure's ratio of the same run."""
    require_fuse()
    run = run_probe("ab.py", "ab", tmp_path, "--smoke", *compared, "--datasets", "tiny")
    assert run.returncode == 0, run.stderr[-3000:]
    figures = run.data["tiny"]
    assert set(figures) == set(sides)
    _check_ratios(run, figures[sides[0]], figures[sides[1]])


def _check_ratios(run: ProbeRun, a_figures: dict, b_figures: dict) -> None:
    """Every row of the report is its figure of each side and their ratio (the daemon's CPU in
    10 ms ticks may be 0 in a smoke run)."""
    rows = table_rows(run.markdown, "tiny")
    assert {row[1] for row in rows} >= {"cold tar s", "warm reads files/s", "daemon CPU s, reads"}, rows
    for row in rows:
        figure = row[1]
        a, b = a_figures[figure], b_figures[figure]
        if figure.startswith("daemon CPU"):
            assert a >= 0 and b >= 0 and row[4] == (f"{b / a:.2f}" if a else "n/a"), row
        else:
            assert a > 0 and b > 0 and row[4] == f"{b / a:.2f}", row


def test_pack_probe_times_pack_against_tar_and_checks_what_it_packed(tmp_path: Path) -> None:
    """bench/pack.py packs the suite's tars with each strategy, checks the export of what it packed
    holds the source's files, and reports rates and sizes of the same run."""
    run = run_probe("pack.py", "pack", tmp_path, "--smoke", "--datasets", "tiny", "--strategies", "1,2")
    assert run.returncode == 0, run.stderr[-3000:]
    result = run.data["results"]["tiny"]
    rows = table_rows(run.markdown, "tiny")
    assert [row[1] for row in rows] == ["1", "2"]
    for row, strategy in zip(rows, ("s1", "s2")):
        s = result[strategy]
        assert row[2] == f"{result['files'] / s['pack s']:,.0f}" and row[6] == "missing"
        assert row[7] == f"{s['bytes'] / result['tars bytes']:.2f}"


def test_export_against_tar(tmp_path: Path) -> None:
    """bench/export.py: export -j 1 and -j 2 against tar cf at smoke sizes (every export's
    tars equal the first's, or it fails)."""
    run = run_probe("export.py", "export", tmp_path, "--smoke")
    assert run.returncode == 0, run.stderr[-3000:]
    rates = run.data["files_per_second"]
    assert sorted(rates) == sorted(["tar cf", "tar cf, 2 at once", "export -j 1", "export -j 2"])
    for name, rate in rates.items():
        (row,) = table_rows(run.markdown, name)
        assert row[2] == f"{rate:,.0f}" and float(row[3]) == round(rate / rates["tar cf"], 2), row
    assert run.data["files"] == 9000
