"""A shard's tar laid out from its file table's columns (tarview._shard_members) is the tar laid
out from its entries one file at a time (Tree.members): same names, sizes, offsets and bytes."""

from __future__ import annotations

from pathlib import Path

import pytest

import atlasfs.tree.tarview as tarview
from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.tarview import TarLayout


def _write(path: Path, folders: bool) -> None:
    with AtlasWriter(path, shard_size=40, block_size=8, compression_strategy=1) as writer:
        for i in range(80):
            key = ("é" if i % 5 == 0 else "") + f"{i:03d}" + ("x" * 120 if i % 7 == 0 else "")  # pax headers
            if folders:
                key = f"d{i % 3}/{key}"
            writer.add_example({"__key__": key, "bin": bytes(i), "json": {"i": i}, "txt": "t" * (i % 9)})


@pytest.mark.parametrize("folders", [False, True])
def test_a_shard_laid_out_from_its_table_is_laid_out_from_its_entries(tmp_path: Path, folders: bool,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    dataset = tmp_path / "ds"
    _write(dataset, folders)
    layouts = []
    for columns in (True, False):
        if not columns:
            monkeypatch.setattr(tarview, "_shard_members", lambda tree, folder: None)
        tree = BlockTree(AtlasDataset(dataset))  # fresh: sizes not known yet, filled in by the layout
        if columns:
            assert tarview._shard_members(tree, "/0") is not None
        layouts.append([TarLayout(tree, f"/{shard}") for shard in tree.shard_folders()])
    for fast, slow in zip(*layouts):
        assert fast.names() == slow.names() and len(fast) == 40 * 3
        assert fast.digest() == slow.digest() and fast.samples() == slow.samples() == 40
        assert fast.read(0, fast.size) == slow.read(0, slow.size)
