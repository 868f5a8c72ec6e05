"""The engine reads a shard's data.bin only if its own open finds the file the control plane
approved by the link rule (atlasfs.storage.links): a symbolic link on the path swapped between
the two opens, to a file of the same size and mtime, is refused (found by an attack on the
rule: the engine opened data.bin by its path and compared size and mtime only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.fuse.attachments import _located_args, _locate
from atlasfs.fuse.engine import NativeBridge, native_module
from atlasfs.tree.blocktree import BlockTree


def _tree_and_session(root: Path) -> tuple[BlockTree, object]:
    with AtlasWriter(root, shard_size=64, block_size=16, compression_strategy=1) as writer:
        for i in range(64):
            writer.add_example({"__key__": f"k{i:03d}", "bin": os.urandom(3000), "cls": i})
    tree = BlockTree(AtlasDataset(str(root)), cache_bytes=1 << 20)
    return tree, native_module().Session(NativeBridge(tree), shards=1, cache_bytes=1 << 20)


def _attach(tree: BlockTree, session: object) -> tuple[object, object]:
    tree.listdir("/0")
    table = tree.tables.tables.get(0)
    assert table is not None and table.flat
    session.attach(shard=0, mtime=0.0, names=table.names, offsets=table.offsets, kind=table.kind,  # type: ignore[attr-defined]
                   size=table.size, by_path=table.by_path, block=table.block)
    found = tree.native_spans(0)
    assert found is not None
    return table, found


def test_the_approved_file_is_located(tmp_path: Path) -> None:
    tree, session = _tree_and_session(tmp_path / "ds")
    table, (locators, spans) = _attach(tree, session)
    st = os.stat(tmp_path / "ds" / "0" / "data.bin")
    assert spans.data_identity == (st.st_dev, st.st_ino)
    columns = _located_args(table, (locators, spans), by_file=False)
    session.locate(shard=0, **columns, data_path=os.fsencode(spans.data_path),  # type: ignore[attr-defined]
                   index_path=os.fsencode(spans.index_path), signatures=spans.signatures, starts=spans.starts,
                   compressed=spans.compressed, dictionary=spans.dictionary, max_block_bytes=spans.max_block_bytes,
                   data_identity=spans.data_identity)


def test_another_file_behind_the_path_is_refused(tmp_path: Path) -> None:
    """The path now leads to a copy: same size and mtime, another inode."""
    tree, session = _tree_and_session(tmp_path / "ds")
    table, (locators, spans) = _attach(tree, session)
    data = tmp_path / "ds" / "0" / "data.bin"
    st = data.stat()
    copy = tmp_path / "copy.bin"
    copy.write_bytes(data.read_bytes())
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(copy, data)  # what a link swapped on the path gives the engine's open
    columns = _located_args(table, (locators, spans), by_file=False)
    with pytest.raises(ValueError, match="not the file approved"):
        session.locate(shard=0, **columns, data_path=os.fsencode(spans.data_path),  # type: ignore[attr-defined]
                       index_path=os.fsencode(spans.index_path), signatures=spans.signatures, starts=spans.starts,
                       compressed=spans.compressed, dictionary=spans.dictionary,
                       max_block_bytes=spans.max_block_bytes, data_identity=spans.data_identity)
    _locate(session, 0, spans, columns)  # the FUSE layer's call: Python reads them, no exception
