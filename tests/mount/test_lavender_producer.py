"""Datasets lavender-data 0.1.10 wrote (tests/fixtures/lavender, copied to tmp), mounted with no
option: every file is what lavender-data's own reader returned (expected.json), read with
``cat`` through a real mount; ``atlasfs export`` equals the mount; both joins."""

from __future__ import annotations

import io
import json
import math
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds

from corpus import FIXTURES, expected
from fusemount import atlasfs, mounted

PNG = b"\x89PNG\r\n\x1a\n"
#: What lavender-data's left join fills a missing shardset's columns with (``_default_null_type``).
FILLS = ("", b"")


def _copy(tmp_path: Path, fixture: str) -> Path:
    return Path(shutil.copytree(FIXTURES / "lavender" / fixture / "data", tmp_path / fixture))


def _name(column: str, ext: str) -> str:
    """A column's field under the naming contract: its name if it ends in a fitting extension."""
    return column if column.rsplit(".", 1)[-1].lower() == ext else f"{column}.{ext}"


def _expected_files(exp: dict[str, Any], join: str) -> tuple[dict[str, dict[str, Any]], list[Any]]:
    """Per shard folder, ``{file name: bytes or the array numpy.load must give}`` from lavender's
    reading with ``join``; and the uids lavender leaves out (inner: InnerJoinSampleInsufficient)."""
    uid = exp["uid_column"]
    main_columns = set(exp["shardsets"][exp["main_shardset"]]["columns"])
    shards: dict[str, dict[str, Any]] = {}
    left_out = []
    for s in exp["samples"]:
        files = shards.setdefault(f"shard.{s['shard']:05d}", {})
        sample = s[join]
        if "$error" in sample:
            assert sample["$error"].startswith("InnerJoinSampleInsufficient")
            left_out.append(s["uid"])
            continue
        missing = "$error" in s["inner"]  # join=left of a uid a feature shardset lacks
        key = str(s["uid"])
        for column, value in sample.items():
            if column in (uid, "__key__"):
                continue  # the key, not a file
            if missing and column not in main_columns:
                assert value in FILLS or (isinstance(value, float) and math.isnan(value))
                continue  # lavender's fill: atlasfs shows no file
            if column in s.get("deserialized", {}):
                files[f"{key}.{_name(column, 'npy')}"] = s["deserialized"][column]
            elif isinstance(value, bytes):
                assert value.startswith(PNG)
                files[f"{key}.{_name(column, 'png')}"] = value
            elif isinstance(value, str):
                files[f"{key}.{column if column in ('text', 'txt') else column + '.txt'}"] = value.encode()
            elif isinstance(value, int):
                files[f"{key}.{column if column == 'cls' else column + '.cls'}"] = str(value).encode()
            else:
                files[f"{key}.{column}.json"] = json.dumps(value).encode()
    return shards, left_out


def _check_equal(name: str, got: bytes, want: Any) -> None:
    if isinstance(want, np.ndarray):
        array = np.load(io.BytesIO(got), allow_pickle=False)
        assert array.dtype == want.dtype and array.shape == want.shape and np.array_equal(array, want), name
    else:
        assert got == want, name


@pytest.mark.parametrize("fixture", ["wds_images", "tabular"])
@pytest.mark.parametrize("join", ["inner", "left"])
def test_lavender_data_datasets_mount_as_lavender_reads_them(tmp_path: Path, fixture: str, join: str) -> None:
    data = _copy(tmp_path, fixture)
    exp = expected("lavender", fixture)
    want, left_out = _expected_files(exp, join)
    options = [] if join == "inner" else ["--join", "left"]  # inner: lavender-data's default, no option
    log = tmp_path / "daemon.log"
    with mounted(data, "-o", f"log_file={log}", *options) as mnt:
        assert sorted(p.name for p in mnt.iterdir()) == sorted(want)
        for shard, files in want.items():
            found = subprocess.run(["find", str(mnt / shard), "-type", "f", "-printf", "%P\\n"], capture_output=True,
                                   text=True, check=True).stdout.split()
            assert sorted(found) == sorted(files)
            for name, value in files.items():
                got = subprocess.run(["cat", str(mnt / shard / name)], capture_output=True, check=True).stdout
                _check_equal(name, got, value)
        out = tmp_path / "export"
        result = atlasfs("export", str(data), str(out), *options)
        assert result.returncode == 0, result.stderr
        for shard in want:
            with tarfile.open(out / f"{shard}.tar") as archive:
                members = archive.getmembers()
                assert sorted(m.name for m in members) == sorted(want[shard])
                for member in members:
                    assert archive.extractfile(member).read() == (mnt / shard / member.name).read_bytes()
    verify = atlasfs("verify", str(data), *options)
    lines = log.read_text().splitlines()
    # a sample lavender leaves out (join=inner) is one log line and one verify finding
    for uid in left_out:
        needle = f"uid '{uid}' is not in"
        assert len([line for line in lines if needle in line and "left out (join=inner" in line]) == 1, lines
        assert verify.returncode == 1 and any(needle in line for line in verify.stdout.splitlines()), verify.stdout
    if not left_out:
        assert verify.returncode == 0, verify.stdout + verify.stderr
    info = atlasfs("info", str(data), *options)
    assert f"{join} join onto 'main' by column '{exp['uid_column']}'" in info.stdout, info.stdout + info.stderr


def test_webdataset_decodes_the_exported_arrays_as_lavender_deserializes_them(tmp_path: Path) -> None:
    data = _copy(tmp_path, "wds_images")
    exp = expected("lavender", "wds_images")
    result = atlasfs("export", str(data), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    tars = sorted(str(p) for p in (tmp_path / "out").glob("*.tar"))
    decoded = {s["__key__"]: s for s in wds.WebDataset(tars, shardshuffle=False).decode()}
    for s in exp["samples"]:
        sample = decoded[s["uid"]]
        for column, array in s["deserialized"].items():
            assert np.array_equal(sample[f"{column}.npy"], array) and sample[f"{column}.npy"].dtype == array.dtype


def test_a_cell_of_another_kind_fails_its_block_in_one_line(tmp_path: Path) -> None:
    """A column's extension comes from its first cell; a later cell of another kind is not
    shown under it (nor under another name): its block fails, and verify names the cell."""
    data = _copy(tmp_path, "tabular")
    path = data / "main" / "shard.00001.parquet"
    table = pq.read_table(path)
    cells = table.column("image_png").to_pylist()
    cells[1] = b"\xff\xd8\xff\xe0 a jpeg"
    pq.write_table(table.set_column(table.schema.get_field_index("image_png"), "image_png",
                                    pa.array(cells, pa.binary())), path)
    with mounted(data, "-o", "join=left") as mnt:
        assert (mnt / "shard.00000" / "0.image_png.png").read_bytes().startswith(PNG)
        with pytest.raises(OSError):
            (mnt / "shard.00001" / "4.image_png.png").read_bytes()
    verify = atlasfs("verify", str(data), "--join", "left")
    assert verify.returncode == 1
    assert any(f"{path} row 2: column 'image_png' holds jpg, not png" in line for line in verify.stdout.splitlines())


def test_the_uid_column_not_decided_is_one_line_naming_the_candidates(tmp_path: Path) -> None:
    for name in ("a", "b"):
        (tmp_path / "ds" / name).mkdir(parents=True)
        pq.write_table(pa.table({"doc": ["x", "y"], "part": [1, 2], name: ["p", "q"]}),
                       tmp_path / "ds" / name / "shard.00000.parquet")
    info = atlasfs("info", str(tmp_path / "ds"))
    assert info.returncode != 0 and "Traceback" not in info.stderr
    [line] = info.stderr.strip().splitlines()
    assert "'doc', 'part'" in line and "-o uid_column=COLUMN" in line
    with mounted(tmp_path / "ds", "-o", "uid_column=doc") as mnt:
        assert (mnt / "shard.00000" / "x.b.txt").read_bytes() == b"p"
