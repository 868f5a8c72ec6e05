"""The atlasfs internals that ``bench/`` uses, imported here and nowhere else in ``bench/``
(the public API, ``atlasfs.AtlasDataset`` and ``atlasfs.AtlasWriter``, is imported directly):
when atlasfs's modules move, this is the one file of the benchmarks to change."""

from __future__ import annotations

import importlib
from collections.abc import Callable

from atlasfs.formats.atlas import spans
from atlasfs.formats.atlas.dataset import Shard
from atlasfs.formats.atlas.meta import FORMAT_VERSION, RootMeta
from atlasfs.formats.atlas.writer import ShardWriter, shard_name_width
from atlasfs.formats.dolma import DolmaSource
from atlasfs.formats.lavender import write_csv_shard
from atlasfs.formats.naming import MAX_NAME_BYTES, encode_as, example_fields, index_key, index_key_width
from atlasfs.formats.pbin import write_pbin
from atlasfs.formats.safepickle import loads as safe_loads
from atlasfs.fuse.mount import serve
from atlasfs.options import MountOptions
from atlasfs.sizes import parse_size
from atlasfs.tree.base import Entry, Tree
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.filetable import Locators
from atlasfs.tree.table.store import TableStore
from atlasfs.tree.tarview import TarLayout

__all__ = ["BlockTree", "DolmaSource", "Entry", "FORMAT_VERSION", "Locators", "MAX_NAME_BYTES", "MountOptions",
           "RootMeta", "Shard", "ShardWriter", "TableStore", "TarLayout", "Tree", "default_cache_bytes", "encode_as",
           "example_fields", "index_key", "index_key_width", "parse_size", "safe_loads", "serve_tree",
           "shard_name_width", "spans", "write_csv_shard", "write_pbin"]


def default_cache_bytes() -> int:
    """The block cache bound of a mount with default options."""
    return MountOptions().cache_bytes


def serve_tree(factory: str, args: list[int], mountpoint: str, on_ready: Callable[[], None]) -> None:
    """Serve the tree ``module:callable(*args)`` at ``mountpoint`` in the foreground, through
    atlasfs's own engine and mount options (what ``atlasfs mount`` does, minus a dataset)."""
    module, _, name = factory.partition(":")
    tree = getattr(importlib.import_module(module), name)(*args)
    serve(tree, mountpoint, MountOptions(foreground=True), name, on_ready)
