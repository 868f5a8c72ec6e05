"""``atlasfs pack``: every dataset atlasfs mounts, written as Atlas, shows the same files byte for byte."""

from __future__ import annotations

import json
import os
import shutil
import io
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlasfs.commands.pack import PackError, PackSettings, pack, temporary_folder
from atlasfs.formats.atlas.dataset import AtlasDataset
from atlasfs.formats.factory import open_source
from atlasfs.tree.blocktree import BlockTree
from corpus import copy_data
from fusemount import atlasfs
from helpers import REFERENCE, reference_manifest, reference_names

Files = list[list[tuple[str, bytes]]]


def shown_files(path: Path | str) -> Files:
    """Each shard's files as a mount shows them (a tar's members, in order) with their bytes."""
    with open_source(str(path)) as source:
        tree = BlockTree(source, cache_bytes=8 << 20, log_failures=False)
        return [[(rel, tree.read(entry, 0, entry.size)) for rel, entry in tree.members(f"/{name}")]
                for name in tree.shard_folders()]


CORPUS = [("webdataset", "images"), ("webdataset", "tiny"), ("dolma", "mixed"), ("dolma", "tagged"),
          ("lavender", "tabular"), ("lavender", "wds_images"), ("modalities", "merged")]


@pytest.mark.parametrize(("fmt", "fixture"), CORPUS, ids=[f"{f}-{x}" for f, x in CORPUS])
def test_corpus_round_trip(tmp_path: Path, fmt: str, fixture: str) -> None:
    source = copy_data(fmt, fixture, tmp_path)
    out = tmp_path / "packed"
    report = pack(str(source), str(out), PackSettings(block_size=2))
    before = shown_files(source)
    assert shown_files(out) == before
    assert report.shards == len(before) and sum(map(len, before)) > 0
    assert not os.path.exists(temporary_folder(out))


@pytest.mark.parametrize("name", reference_names())
def test_reference_round_trip(tmp_path: Path, name: str) -> None:
    out = tmp_path / "packed"
    pack(str(REFERENCE / name / "dataset"), str(out), PackSettings(block_size=3, strategy=3))
    assert shown_files(out) == shown_files(REFERENCE / name / "dataset")


def test_reshard_round_trip_and_decode(tmp_path: Path) -> None:
    """--shard-size cuts the samples anew; --decode stores values that encode to the same bytes."""
    out = tmp_path / "packed"
    dataset = REFERENCE / "s2_twelve_shards" / "dataset"
    report = pack(str(dataset), str(out), PackSettings(shard_size=50, block_size=4, decode=True))
    assert report.shards == 4
    assert [f for shard in shown_files(out) for f in shard] == [f for shard in shown_files(dataset) for f in shard]
    source = copy_data("webdataset", "images", tmp_path)
    decoded = tmp_path / "decoded"
    pack(str(source), str(decoded), PackSettings(decode=True, strategy=0))
    assert shown_files(decoded) == shown_files(source)
    with AtlasDataset(str(decoded)) as atlas:
        first = atlas.shards[0].decode_block(0)[0][0]
    assert type(first["cls"]) is int and type(first["json"]) is dict, first


@pytest.mark.parametrize("name", [n for n in reference_names() if not n.startswith("legacy")])
def test_layout_matches_reference_writer(tmp_path: Path, name: str) -> None:
    """The same writer settings give the reference's layout: root and shard metas as text,
    shard folder names, index dtypes, where dictionaries are."""
    entry = reference_manifest()[name]
    kwargs: dict[str, Any] = entry["writer_kwargs"]
    settings = PackSettings(shard_size=kwargs["shard_size"], block_size=kwargs["block_size"],
                            strategy=kwargs.get("compression_strategy", 2), level=kwargs.get("compression_level", 3),
                            dict_size=kwargs.get("compression_dict_size", 0.01))
    reference = REFERENCE / name / "dataset"
    out = tmp_path / "packed"
    pack(str(reference), str(out), settings)
    assert (out / "meta.json").read_text() == (reference / "meta.json").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    for shard in entry["shard_dirs"]:
        assert (out / shard / "meta.json").read_text() == (reference / shard / "meta.json").read_text(), shard
        assert sorted(os.listdir(out / shard)) == sorted(os.listdir(reference / shard)), shard
        ours, theirs = np.load(out / shard / "index.npy"), np.load(reference / shard / "index.npy")
        assert ours.dtype == theirs.dtype and len(ours) == len(theirs), shard
    if name == "s0_index_dtype_edges":  # bytes fields pickle the same: the very same data.bin
        for shard in entry["shard_dirs"]:
            assert (out / shard / "data.bin").read_bytes() == (reference / shard / "data.bin").read_bytes()


def test_cli_parallel_pack_verifies(tmp_path: Path) -> None:
    out = tmp_path / "packed"
    dataset = REFERENCE / "s2_twelve_shards" / "dataset"
    result = atlasfs("pack", str(dataset), str(out), "-j", "2", "--block-size", "2")
    assert result.returncode == 0, result.stderr
    assert "12 shards, 160 examples, strategy 2" in result.stdout
    assert (out / "zstd_dict.bin").exists() and sorted(os.listdir(out))[:2] == ["00", "01"]
    check = atlasfs("verify", str(out))
    assert check.returncode == 0 and "verify: OK" in check.stdout, check.stdout
    assert shown_files(out) == shown_files(dataset)


def _cut_tar(path: Path) -> None:
    """Cut a tar in the middle of its last member's bytes."""
    with tarfile.open(path) as tar:
        last = tar.getmembers()[-1]
    os.truncate(path, last.offset_data + last.size // 2)


def test_bad_source_shard_stops_and_leaves_no_dataset(tmp_path: Path) -> None:
    source = copy_data("webdataset", "images", tmp_path)
    good = (source / "images-000001.tar").read_bytes()
    _cut_tar(source / "images-000001.tar")
    out = tmp_path / "packed"
    result = atlasfs("pack", str(source), str(out), "-j", "2")
    assert result.returncode == 1 and not out.exists()
    last = result.stderr.strip().splitlines()[-1]  # after the source's own note of the cut member
    assert last.startswith("atlasfs: pack stopped") and "source shard images-000001 cannot be read" in last
    assert "img0004.png': truncated" in last and "pack again" in last and "Traceback" not in result.stderr
    kept = Path(temporary_folder(out))
    assert (kept / "0" / "meta.json").exists() and not (kept / "1").exists()
    (source / "images-000001.tar").write_bytes(good)  # repaired: a changed source is packed afresh
    result = atlasfs("pack", str(source), str(out), "-j", "1")
    assert result.returncode == 0 and "from an earlier run" not in result.stdout, result.stderr
    assert shown_files(out) == shown_files(source) and not kept.exists()


def test_existing_outdir_and_unpackable_key(tmp_path: Path) -> None:
    out = tmp_path / "packed"
    out.mkdir()
    result = atlasfs("pack", str(REFERENCE / "s2_shared_dict" / "dataset"), str(out))
    assert result.returncode == 1 and "already exists" in result.stderr and not os.listdir(out)
    # a key of index-key shape that is not its own index key would be shown otherwise in Atlas
    wds = tmp_path / "wds"
    wds.mkdir()
    with tarfile.open(wds / "a.tar", "w") as tar:
        for key in ("000001", "000002"):
            info = tarfile.TarInfo(f"{key}.txt")
            info.size = 2
            tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(PackError, match=r"source shard a: sample '000001' would be shown as '000000'"):
        pack(str(wds), str(tmp_path / "p2"), PackSettings())
    assert not (tmp_path / "p2").exists() and not os.path.exists(temporary_folder(tmp_path / "p2"))


def test_interrupted_run_is_resumed(tmp_path: Path) -> None:
    """Shards an interrupted run finished are kept when nothing changed; a half shard is
    removed; a leftover of other settings is cleared."""
    dataset = REFERENCE / "s2_twelve_shards" / "dataset"
    out = tmp_path / "packed"
    settings = PackSettings(block_size=2)

    def stop_after(n: int):  # noqa: ANN202
        done = [0]

        def progress(total: int):  # noqa: ANN202
            def advance(k: int = 1) -> None:
                done[0] += k
                if done[0] == n:
                    raise KeyboardInterrupt
            return advance
        return progress

    with pytest.raises(KeyboardInterrupt):
        pack(str(dataset), str(out), settings, progress=stop_after(5))
    kept = Path(temporary_folder(out))
    assert not out.exists() and (kept / "zstd_dict.bin").exists()
    assert sorted(p.name for p in kept.iterdir() if p.is_dir()) == ["00", "01", "02", "03", "04"]
    (kept / "05.partial").mkdir()  # as a run killed while writing shard 05 leaves it
    (kept / "05.partial" / "data.bin").write_bytes(b"half")
    first = (kept / "00" / "data.bin").stat().st_mtime_ns
    report = pack(str(dataset), str(out), settings)
    assert report.reused == 5 and (out / "00" / "data.bin").stat().st_mtime_ns == first
    assert not (out / "05.partial").exists() and shown_files(out) == shown_files(dataset)
    assert atlasfs("verify", str(out)).returncode == 0
    shutil.rmtree(out)
    with pytest.raises(KeyboardInterrupt):
        pack(str(dataset), str(out), settings, progress=stop_after(3))
    report = pack(str(dataset), str(out), PackSettings(block_size=3, strategy=3))
    assert report.reused == 0 and json.loads((out / "00" / "meta.json").read_text())["block_size"] == 3
