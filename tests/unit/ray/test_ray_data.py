"""Atlas in Ray Data (``atlasfs.ray``, issue #38): ``read_atlas`` of any format, in order, and a
WebDataset -> Ray Data -> Atlas pipeline that the reader reads back."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray") if os.environ.get("CI") != "true" else __import__("ray")

from raydata import ordered, pipeline_once, run, tar_samples, write_tars  # noqa: E402

SHARDS = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight WebDataset tars of 400 samples: enough blocks for strategy 2's dictionary."""
    return write_tars(tmp_path_factory.mktemp("ray") / "wds", SHARDS, 400)


@pytest.fixture(scope="module")
def pipeline(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """WebDataset -> Ray Data (a transform) -> Atlas in one pipeline (written once per session:
    raydata.pipeline_once); the dataset written and the samples it must hold."""
    return pipeline_once(tmp_path_factory)


def test_read_atlas_gives_the_samples_in_order_from_any_format(dataset: Path, ray_address: str,
                                                               tmp_path: Path) -> None:
    from atlasfs.ray import read_atlas
    ordered()
    expected = tar_samples(dataset)
    assert [dict(row) for row in read_atlas(str(dataset)).take_all()] == expected
    packed = tmp_path / "packed"
    assert run(["pack", str(dataset), str(packed), "-j", "2"]).returncode == 0
    assert [dict(row) for row in read_atlas(str(packed)).take_all()] == expected
    decoded = read_atlas(str(packed), decode=True).take(3)
    assert [row["txt"] for row in decoded] == [s["txt"].decode() for s in expected[:3]]
    assert [row["bin"] for row in decoded] == [s["bin"] for s in expected[:3]]


def test_webdataset_to_atlas_in_one_pipeline(pipeline: tuple[Path, list]) -> None:
    from atlasfs.formats.atlas.dataset import AtlasDataset
    out, expected = pipeline
    root = json.loads((out / "meta.json").read_text())
    assert root["compression_strategy"] == 2 and (out / "zstd_dict.bin").is_file()
    assert root["shard_sizes"] == [700, 700, 700, 700, 400] and len(expected) == 3200
    reader = AtlasDataset(out)
    assert [dict(reader[i]) for i in range(len(reader))] == expected
    check = run(["verify", str(out)])
    assert check.returncode == 0 and check.stdout.startswith("verify: OK"), check.stdout + check.stderr
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # the temporary folder went
