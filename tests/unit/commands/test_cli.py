"""The library-level command line: info, verify, show, export, demo."""

from __future__ import annotations

import json
import resource
import shutil
import tarfile
from pathlib import Path

import numpy as np

from atlasfs import AtlasWriter
from fusemount import atlasfs
from helpers import REFERENCE

SHARED_DICT = REFERENCE / "s2_shared_dict" / "dataset"


def test_help_lists_every_command() -> None:
    result = atlasfs("--help")
    assert result.returncode == 0
    for command in ("info", "verify", "show", "mount", "umount", "export", "demo"):
        assert command in result.stdout


def test_info_summarises_shards() -> None:
    result = atlasfs("info", str(SHARED_DICT))
    assert result.returncode == 0, result.stderr
    assert "examples     75" in result.stdout
    assert "blocks       19" in result.stdout
    assert "compression ratio" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [(r[0], r[1], r[2], r[4]) for r in rows] == [("0", "32", "8", "2"), ("1", "32", "8", "2"),
                                                          ("2", "11", "3", "2")]


def test_verify_passes_every_reference_fixture() -> None:
    for dataset in sorted(REFERENCE.glob("*/dataset")):
        result = atlasfs("verify", str(dataset))
        assert result.returncode == 0, (dataset, result.stdout, result.stderr)
        assert "verify: OK" in result.stdout
        assert "\r" not in result.stderr  # no progress bar when not on a terminal


def test_verify_reports_each_problem_and_fails(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(SHARED_DICT, bad)
    data = bytearray((bad / "0" / "data.bin").read_bytes())
    index = np.load(bad / "0" / "index.npy")
    data[int(index[1]) + 10:int(index[1]) + 30] = b"\x00" * 20  # damage block 1 of shard 0
    (bad / "0" / "data.bin").write_bytes(bytes(data))
    (bad / "2" / "meta.json").write_text('{"version": 2}')
    result = atlasfs("verify", str(bad))
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert any(line.startswith(f"{bad / '0' / 'data.bin'} block 1") for line in lines), lines
    assert any(line.startswith(str(bad / "2" / "meta.json")) for line in lines), lines
    assert lines[-1].startswith("verify: 2 problem(s)")
    assert "Traceback" not in result.stderr


def test_show_prints_one_example_readably() -> None:
    result = atlasfs("show", str(REFERENCE / "s0_wds_keyed_dicts" / "dataset"), "-1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("example 22 (shard 2, block 0, position 2)")  # what -1 stands for
    assert "'__key__'" in result.stdout
    result = atlasfs("show", str(SHARED_DICT), "75")
    assert result.returncode == 1 and "out of range" in result.stderr


def test_show_keeps_the_order_of_nested_keys_and_takes_verbose_after_the_command(tmp_path: Path) -> None:
    from atlasfs import AtlasWriter
    with AtlasWriter(tmp_path / "ds", shard_size=4, block_size=2) as w:
        w.add_examples({"__key__": f"k{i}", "json": {"zebra": i, "apple": {"pear": 1, "fig": 2}, "mango": 3}}
                       for i in range(6))
    for args in (["show", "-v", str(tmp_path / "ds"), "-1"], ["-v", "show", str(tmp_path / "ds"), "-1"],
                 ["show", str(tmp_path / "ds"), "--", "-1"]):
        result = atlasfs(*args)
        assert result.returncode == 0, (args, result.stderr)
        assert result.stdout.startswith("example 5 (shard 1, block 0, position 1)"), result.stdout
        assert "{'zebra': 5, 'apple': {'pear': 1, 'fig': 2}, 'mango': 3}" in result.stdout, result.stdout
    # the same for a format that is not Atlas: 1 + 12 documents
    from atlasfs.formats.pbin import write_pbin
    (tmp_path / "pbin").mkdir()
    write_pbin(str(tmp_path / "pbin" / "a.pbin"), [[2, 3]], token_width=4)
    write_pbin(str(tmp_path / "pbin" / "b.pbin"), [[1]] * 12, token_width=1)
    result = atlasfs("show", str(tmp_path / "pbin"), "--", "-1")
    assert result.stdout.startswith("example 12 (shard b, block 0, position 11)"), (result.stdout, result.stderr)
    # -v takes effect after the command too: index's debug lines appear
    quiet = atlasfs("index", str(tmp_path / "ds"), "--index-dir", str(tmp_path / "quiet"))
    loud = atlasfs("index", str(tmp_path / "ds"), "-v", "--index-dir", str(tmp_path / "loud"))
    assert loud.returncode == quiet.returncode == 0
    assert "stored the file table of shard 0" not in quiet.stderr and "stored the file table of shard 0" in loud.stderr


def test_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    for args in (("info", str(tmp_path / "missing")), ("show", str(tmp_path), "0"),
                 ("export", str(tmp_path), str(tmp_path / "out"))):
        result = atlasfs(*args)
        assert result.returncode == 1
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("atlasfs: "), result.stderr
    # verify reports on stdout: one line per problem, then the summary
    result = atlasfs("verify", str(tmp_path))
    assert result.returncode == 1 and result.stderr == ""
    lines = result.stdout.splitlines()
    assert len(lines) == 2 and lines[0].startswith(f"{tmp_path}: not a dataset atlasfs knows (looked for a meta.json")
    assert lines[1] == "verify: 1 problem(s) (0 shards, 0 blocks, 0 examples checked)"
    # a folder that looks like an Atlas dataset still gets the precise finding
    (tmp_path / "0").mkdir()
    (tmp_path / "0" / "data.bin").write_bytes(b"")
    result = atlasfs("verify", str(tmp_path))
    assert result.stdout.splitlines()[0] == f"{tmp_path / 'meta.json'}: missing"


def test_export_writes_one_tar_per_shard(tmp_path: Path) -> None:
    result = atlasfs("export", str(SHARED_DICT), str(tmp_path / "out"), "--shards", "0", "2")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["0.tar", "2.tar", "shards.json"]
    with tarfile.open(tmp_path / "out" / "2.tar") as archive:
        names = archive.getnames()
    assert len({n.split(".")[0] for n in names}) == 11
    index = json.loads((tmp_path / "out" / "shards.json").read_text())
    assert index == {"wids_version": 1, "shardlist": [{"url": "0.tar", "nsamples": 32}, {"url": "2.tar", "nsamples": 11}]}
    result = atlasfs("export", str(SHARED_DICT), str(tmp_path / "out"), "--shards", "9")
    assert result.returncode == 1 and "no shard named '9'" in result.stderr
    (tmp_path / "file").write_text("not a folder")
    result = atlasfs("export", str(SHARED_DICT), str(tmp_path / "file"))
    assert result.returncode == 1
    assert result.stderr == f"atlasfs: {tmp_path / 'file'}: exists and is not a folder (OUTDIR is the folder " \
                            "the tars go in)\n"
    assert (tmp_path / "file").read_text() == "not a folder"


def test_export_and_index_of_more_shards_than_open_files_allowed(tmp_path: Path) -> None:
    """``export`` and ``index`` keep one shard's files open at a time: 80 shards go through a
    process allowed 48 descriptors (each shard's data.bin stayed open until the end before)."""
    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=2, block_size=2, compression_strategy=1) as writer:
        writer.add_examples([{"txt": f"example {i}", "cls": i} for i in range(160)])

    def few_descriptors() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    result = atlasfs("export", "-j", "1", str(dataset), str(tmp_path / "out"), preexec_fn=few_descriptors)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(list((tmp_path / "out").glob("*.tar"))) == 80
    result = atlasfs("index", "-j", "1", str(dataset), preexec_fn=few_descriptors)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "80 shards" in result.stdout + result.stderr


def test_demo_writes_a_valid_dataset(tmp_path: Path) -> None:
    result = atlasfs("demo", str(tmp_path / "demo"))
    assert result.returncode == 0, result.stderr
    result = atlasfs("verify", str(tmp_path / "demo"))
    assert result.returncode == 0 and "200 examples" in result.stdout
    assert (tmp_path / "demo" / "zstd_dict.bin").exists()
