"""Atlas in Ray Data (the ``atlasfs[ray]`` extra): :func:`read_atlas` gives any dataset atlasfs
reads as a ``ray.data.Dataset`` of samples, :func:`write_atlas` writes one as an Atlas
dataset. WebDataset -> Ray Data transforms -> Atlas in one pipeline::

    import ray
    from atlasfs.ray import read_atlas, write_atlas

    samples = read_atlas("s3://bucket/webdataset-shards/")        # __key__, jpg, cls... (bytes)
    samples = samples.filter(lambda row: len(row["jpg"]) > 1000)
    write_atlas(samples, "/shared/atlas-out", shard_size=5000)     # pack's options

Only this package imports Ray: :mod:`atlasfs.ray.executor` runs the command line's ``--ray``
(imported by it alone, without Ray Data); the names below load Ray Data when first used.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AtlasDatasink", "AtlasDatasource", "read_atlas", "write_atlas"]
_WHERE = {"AtlasDatasource": "read", "read_atlas": "read", "AtlasDatasink": "write", "write_atlas": "write"}


def __getattr__(name: str) -> Any:
    """``read_atlas``... from their modules, imported on first use (``import ray.data`` takes
    a second and more: ``--ray`` needs none of it)."""
    if name not in _WHERE:
        raise AttributeError(f"module 'atlasfs.ray' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"atlasfs.ray.{_WHERE[name]}"), name)
