"""``atlasfs export``: a tree's shard folders as WebDataset tar files, without FUSE.

Each tar is the :class:`~atlasfs.tree.tarview.TarLayout` of a shard folder written
out, so its bytes are exactly those of ``<shard>.tar`` in the mount's tar view:
the shard's files in example order (:meth:`~atlasfs.tree.base.Tree.members`), a
sample's files adjacent, named by their full key paths without a ``./``
prefix, so ``webdataset`` yields the samples in the dataset's order. Beside
the tars goes ``shards.json``, the same wids index the tar view shows.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Callable

from atlasfs.tree.base import Tree
from atlasfs.tree.tarview import INDEX_NAME, TarLayout, shard_index


def write_shard_tar(tree: Tree, folder: str, out_path: str, on_file: Callable[[], None] | None = None) -> TarLayout:
    """Write every file below ``folder`` into the tar ``out_path``; returns its layout.

    The tar is written beside ``out_path`` under a temporary name and renamed
    when complete, so a failed export leaves no partial shard behind.
    """
    layout = TarLayout(tree, folder)
    partial = out_path + ".partial"
    try:
        with open(partial, "wb") as out:
            layout.write_to(out, on_file)
        os.replace(partial, out_path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    return layout


def write_index(outdir: str, shards: Sequence[tuple[str, int]]) -> str:
    """Write ``shards.json`` (the wids index of ``(tar name, samples)`` pairs) into ``outdir``."""
    path = os.path.join(outdir, INDEX_NAME)
    partial = path + ".partial"
    with open(partial, "wb") as f:
        f.write(shard_index(shards))
    os.replace(partial, path)
    return path


def count_files(tree: Tree, folder: str) -> int:
    """How many files are below ``folder`` (from names only: nothing is sized or read)."""
    total = 0
    for name, is_dir, _ in tree.names(folder):
        total += count_files(tree, f"{folder.rstrip('/')}/{name}") if is_dir else 1
    return total
