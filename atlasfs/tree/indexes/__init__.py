"""The indexes training loaders read beside tar shards, computed from the tar view's layouts.

Megatron-Energon reads ``<shard>.tar.idx`` and a ``.nv-meta/`` folder that ``energon
prepare`` writes into a dataset; NVIDIA DALI's webdataset reader reads one text index per
tar that ``wds2idx`` writes. A mount cannot take those writes, and needs none: every offset
they hold is where a member of a ``<shard>.tar`` lies, which the tar view's
:class:`~atlasfs.tree.tarview.TarLayout` knows without reading the tar. Each module makes
one loader's files, byte for byte what its own tool writes for the same tars:

- :mod:`.energon`: ``.tar.idx``, ``.info.json``, ``split.yaml``, ``dataset.yaml``,
  ``index.uuid`` and the rows and schema of ``index.sqlite``;
- :mod:`.dali`: ``<shard>.idx`` (v1.2);
- :mod:`.sqlitefile`: where ``index.sqlite`` is kept (it is built once per dataset, as a
  file table is, in the user's cache, or beside the dataset by ``atlasfs index``);
- :mod:`.served`: which names the tar view shows and what each holds.
"""
