"""The dataset a WebDataset -> Ray Data -> Atlas pipeline wrote (``atlasfs.ray.write_atlas``),
mounted: the transformed files, byte for byte (issue #38)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray") if os.environ.get("CI") != "true" else __import__("ray")

from raydata import ordered, tar_samples, write_tars  # noqa: E402

SHARDS = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Eight WebDataset tars of 400 samples: enough blocks for strategy 2's dictionary."""
    return write_tars(tmp_path_factory.mktemp("ray") / "wds", SHARDS, 400)


@pytest.fixture(scope="module")
def pipeline(dataset: Path, ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """WebDataset -> Ray Data (a transform) -> Atlas in one pipeline; the dataset written
    and the samples it must hold."""
    from atlasfs.ray import read_atlas, write_atlas
    ordered()
    out = tmp_path_factory.mktemp("pipeline") / "atlas"

    def shout(row: dict) -> dict:
        return {**row, "txt": row["txt"].upper()}
    write_atlas(read_atlas(str(dataset)).map(shout), str(out), shard_size=700, block_size=32)
    expected = [{**s, "txt": s["txt"].upper()} for s in tar_samples(dataset)]
    return out, expected


@pytest.mark.fuse
def test_the_pipeline_s_dataset_mounts(pipeline: tuple[Path, list]) -> None:
    from fusemount import mounted
    out, expected = pipeline
    with mounted(out) as mnt:
        shown = {p.relative_to(mnt).as_posix().split("/", 1)[1]: p.read_bytes()
                 for p in sorted(mnt.rglob("*")) if p.is_file()}
    assert shown == {f"{s['__key__']}.{suffix}": data for s in expected for suffix, data in s.items()
                     if suffix != "__key__"}
