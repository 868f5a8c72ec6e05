"""Atlas in Ray Data (the ``atlasfs[ray]`` extra): :func:`read_atlas` gives any dataset atlasfs
reads as a ``ray.data.Dataset`` of samples, :func:`write_atlas` writes one as an Atlas
dataset. WebDataset -> Ray Data transforms -> Atlas in one pipeline::

    import ray
    from atlasfs.ray import read_atlas, write_atlas

    samples = read_atlas("s3://bucket/webdataset-shards/")        # __key__, jpg, cls... (bytes)
    samples = samples.filter(lambda row: len(row["jpg"]) > 1000)
    write_atlas(samples, "/shared/atlas-out", shard_size=5000)     # pack's options

Only this package imports Ray (and the command line's ``--ray``: :mod:`atlasfs.commands.rayjobs`).
"""

from atlasfs.ray.read import AtlasDatasource, read_atlas
from atlasfs.ray.write import AtlasDatasink, write_atlas

__all__ = ["AtlasDatasink", "AtlasDatasource", "read_atlas", "write_atlas"]
