"""The dataset a WebDataset -> Ray Data -> Atlas pipeline wrote (``atlasfs.ray.write_atlas``),
mounted: the transformed files, byte for byte (issue #38)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ray = pytest.importorskip("ray") if os.environ.get("CI") != "true" else __import__("ray")

from raydata import pipeline_once  # noqa: E402


@pytest.fixture(scope="module")
def pipeline(ray_address: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    """WebDataset -> Ray Data (a transform) -> Atlas in one pipeline (written once per session:
    raydata.pipeline_once); the dataset written and the samples it must hold."""
    return pipeline_once(tmp_path_factory)


@pytest.mark.fuse
def test_the_pipeline_s_dataset_mounts(pipeline: tuple[Path, list]) -> None:
    from fusemount import mounted
    out, expected = pipeline
    with mounted(out) as mnt:
        shown = {p.relative_to(mnt).as_posix().split("/", 1)[1]: p.read_bytes()
                 for p in sorted(mnt.rglob("*")) if p.is_file()}
    assert shown == {f"{s['__key__']}.{suffix}": data for s in expected for suffix, data in s.items()
                     if suffix != "__key__"}
