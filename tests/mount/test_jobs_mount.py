"""``export`` in parallel processes through a real mount: the tars of one process, of many and of
the mount's tar view are the same bytes (the commands alone: tests/unit/commands/test_jobs.py)."""

from __future__ import annotations

from pathlib import Path

from fusemount import atlasfs, mounted
from jobsdata import jobs_dataset


def test_export_in_two_processes_writes_the_bytes_of_one_and_of_the_tar_view(tmp_path: Path) -> None:
    dataset = jobs_dataset(tmp_path / "ds")
    one, two = tmp_path / "one", tmp_path / "two"
    for out, jobs in ((one, "1"), (two, "2")):
        result = atlasfs("export", str(dataset), str(out), "-j", jobs)
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""  # no bar, no line: stderr is not a terminal
    files = sorted(p.name for p in one.iterdir())
    assert files == ["0.tar", "1.tar", "2.tar", "3.tar", "4.tar", "shards.json"]
    for name in files:
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    assert (one / "1.tar").stat().st_size > 2_500_000  # the big file, written in pieces
    with mounted(dataset, "--view", "tars") as mnt:
        for name in files:
            assert (mnt / name).read_bytes() == (two / name).read_bytes(), name
    # the shards asked for, in the order asked: shards.json follows it whatever finishes first
    result = atlasfs("export", str(dataset), str(tmp_path / "some"), "-j", "2", "--shards", "3", "0")
    assert result.returncode == 0, result.stderr
    assert '"url": "3.tar"' in (tmp_path / "some" / "shards.json").read_text().split('"url": "0.tar"')[0]
