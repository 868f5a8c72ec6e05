"""Lavender through a real mount: listing, reads, the tar view and export agree; another uid
column; bad input logged one line each while the rest serves (the source alone:
tests/unit/formats/test_lavender_source.py)."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import webdataset as wds

from atlasfs.formats.lavender import write_csv_shard
from formatfixtures import shard_files as files_of
from fusemount import atlasfs, is_mounted, mounted
from lavenderdata import lavender_dataset, prepared_source


def test_mounted_shardsets_list_read_tar_and_export_equal(tmp_path: Path) -> None:
    lavender_dataset(tmp_path / "ds", shards=2, rows=10)
    expected = files_of(prepared_source(tmp_path / "ds").shards[0])
    with mounted(tmp_path / "ds") as mnt:  # detected from the layout
        assert sorted(os.listdir(mnt)) == ["shard.00000", "shard.00001"]
        listed = subprocess.run(["ls", "-U", str(mnt / "shard.00000")], capture_output=True, text=True,
                                check=True).stdout.split()
        assert listed == list(expected)  # in sample order, as the tree lists
        for name in ("u2.caption.txt", "u2.score.json", "u2.n.cls", "u2.jpg", "u3.caption.txt"):
            data = subprocess.run(["cat", str(mnt / "shard.00000" / name)], capture_output=True, check=True).stdout
            assert data == expected[name]
        found = subprocess.run(["find", str(mnt), "-type", "f"], capture_output=True, text=True, check=True).stdout
        assert len(found.split()) == 2 * len(expected)
        tar = tmp_path / "s0.tar"
        subprocess.run(f"cd {mnt / 'shard.00000'} && find . -type f -printf '%P\\n' | tar cf {tar} --no-recursion -T -",
                       shell=True, check=True)
        samples = list(wds.WebDataset(str(tar), shardshuffle=False))
        assert [s["__key__"] for s in samples][:3] == ["u0", "u1", "u2"]
        by_key = {s["__key__"]: s for s in samples}
        assert by_key["u2"]["caption.txt"].decode() == 'a caption, "quoted"\nfor u2 ü'
        assert json.loads(by_key["u2"]["score.json"]) == 0.5 and by_key["u2"]["jpg"] == b"u2"
        assert "u9" not in by_key and "extra0" not in by_key  # join=inner; only in a feature shardset
        out = tmp_path / "export"
        result = atlasfs("export", str(tmp_path / "ds"), str(out))
        assert result.returncode == 0, result.stderr
        for shard in ("shard.00000", "shard.00001"):
            with tarfile.open(out / f"{shard}.tar") as archive:
                for member in archive.getmembers():
                    assert archive.extractfile(member).read() == (mnt / shard / member.name).read_bytes()
    info = atlasfs("info", str(tmp_path / "ds"))
    assert info.returncode == 0 and "lavender" in info.stdout, info.stdout + info.stderr
    verify = atlasfs("verify", str(tmp_path / "ds"))
    assert verify.returncode == 1, verify.stdout + verify.stderr  # the samples not shown are findings
    for needle in ("row 10: uid 'u9' is not in", "row 10: uid 'extra0' is not in"):
        assert any(needle in line for line in verify.stdout.splitlines()), verify.stdout


def test_mounted_with_another_uid_column(tmp_path: Path) -> None:
    for name, column in (("a", "title"), ("b", "body")):
        (tmp_path / "ds" / name).mkdir(parents=True)
        write_csv_shard(str(tmp_path / "ds" / name / "shard.00000.csv"),
                        [{"id": f"d{i}", column: f"{column}{i}"} for i in range(3)])
    with mounted(tmp_path / "ds", "--format", "lavender", "-o", "uid_column=id") as mnt:
        assert (mnt / "shard.00000" / "d1.body.txt").read_bytes() == b"body1"
        assert (mnt / "shard.00000" / "d2.title.txt").read_bytes() == b"title2"


def test_mounted_bad_input_is_logged_one_line_each_and_the_rest_serves(tmp_path: Path) -> None:
    root = tmp_path / "ds"
    lavender_dataset(root, shards=4)
    (root / "images" / "shard.00002.csv").write_text("uid,image_url\nu20,a\nu21,b\nu20,again\nu22\nu23,d\n",
                                                      encoding="utf-8")
    write_csv_shard(str(root / "captions" / "shard.00003.csv"), [{"id": "u30", "caption": "c"}])
    pq.write_table(pa.table({"uid": ["u30", "u1"], "score": [1.0, 2.0]}), root / "scores" / "shard.00003.parquet")
    pq.write_table(pa.table({"uid": [f"u{i}" for i in range(10) if i != 1], "score": [0.0] * 9}),
                   root / "scores" / "shard.00000.parquet")
    log = tmp_path / "daemon.log"
    with mounted(root, "-o", f"log_file={log},join=left,main_shardset=scores") as mnt:
        for shard in ("shard.00000", "shard.00001", "shard.00002", "shard.00003"):
            assert os.listdir(mnt / shard)
        assert (mnt / "shard.00002" / "u20.image_url.txt").read_bytes() == b"a"
        assert (mnt / "shard.00003" / "u30.score.json").read_bytes() == b"1.0"
        assert (mnt / "shard.00003" / "u1.score.json").read_bytes() == b"2.0"
        assert (mnt / "shard.00001" / "u12.caption.txt").exists()
        assert is_mounted(mnt)
    text = log.read_text()
    assert "Traceback" not in text
    for needle in ("shard.00002.csv row 3: uid 'u20' again", "shard.00002.csv line 5: 1 cells",
                   "shard.00003.csv: no 'uid' column", "uid 'u1' is in shard 0 of captions but in shard 3 of scores"):
        assert len([line for line in text.splitlines() if needle in line]) == 1, needle
    verify = atlasfs("verify", str(root))
    assert verify.returncode == 1
    lines = (verify.stdout + verify.stderr).splitlines()
    for needle in ("row 3: uid 'u20' again", "no 'uid' column", "uid 'u1' is in shard 0 of captions but in shard 3"):
        assert any(needle in line for line in lines), needle
