"""``atlasfs export``: a tree's shard folders as WebDataset tar files, without FUSE.

It reads the same :class:`~atlasfs.tree.Tree` the mount serves. Members are
the shard's files in example order (:meth:`~atlasfs.tree.Tree.members`), a
sample's files adjacent, named by their full key paths without a ``./``
prefix, so ``webdataset`` yields the samples in the dataset's order.
"""

from __future__ import annotations

import io
import os
import tarfile
from typing import Callable

from .tree import Entry, Tree

MEMBER_MODE = 0o444


def write_shard_tar(tree: Tree, folder: str, out_path: str, on_file: Callable[[], None] | None = None) -> int:
    """Write every file below ``folder`` into the tar ``out_path``; returns the member count.

    The tar is written beside ``out_path`` under a temporary name and renamed
    when complete, so a failed export leaves no partial shard behind.
    """
    partial = out_path + ".partial"
    count = 0
    try:
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as archive:
            for name, entry in tree.members(folder):
                archive.addfile(_member(name, entry), io.BytesIO(tree.read(entry, 0, entry.size)))
                count += 1
                if on_file is not None:
                    on_file()
        os.replace(partial, out_path)
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise
    return count


def count_files(tree: Tree, folder: str) -> int:
    """How many files are below ``folder`` (from names only: nothing is sized or read)."""
    total = 0
    for name, is_dir, _ in tree.names(folder):
        total += count_files(tree, f"{folder.rstrip('/')}/{name}") if is_dir else 1
    return total


def _member(name: str, entry: Entry) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = entry.size
    info.mtime = int(entry.mtime)
    info.mode = MEMBER_MODE
    info.uname = info.gname = ""
    return info
