"""A tar read front to back through the tar view (atlasfs/tree/tarstream.py) reads each file of
a block that stores its runs as they are through its locator (``LocatedReads.in_pass``): a
pread a file, no block decoded; a compressed block keeps the block path; locators that lie
cost a fallback, never wrong bytes. Through a mount: tests/mount/test_tarview_located_mount.py."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlasfs.commands import cli
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.tarview import TarView
from locateddata import forged_table, index_tables, located_tree, stored_table, write_dataset

REQUEST = 128 << 10  # the kernel's read requests on a mount with the default read-ahead


def jpeg_like(seed: int, n: int) -> list[dict[str, Any]]:
    """Examples as the benchmark's image set has them: incompressible bytes, a class, a small JSON."""
    rng = np.random.default_rng(seed)
    return [{"jpg": rng.bytes(int(rng.integers(3000, 9000))), "cls": i, "json": {"id": i}} for i in range(n)]


def exported_tars(dataset: Path, out: Path) -> dict[str, bytes]:
    """``atlasfs export``'s tars: shard name -> bytes."""
    assert cli.main(["export", str(dataset), str(out)]) == 0
    return {tar.name[:-len(".tar")]: tar.read_bytes() for tar in sorted(out.glob("*.tar"))}


def tar_in_order(view: TarView, shard: str) -> bytes:
    """The shard's tar read front to back a request at a time, as ``cat`` through a mount."""
    entry = view.lookup(f"/{shard}.tar")
    return b"".join(view.read(entry, offset, REQUEST) for offset in range(0, entry.size, REQUEST))


def decoded_blocks(tree: BlockTree) -> list[tuple[int, int]]:
    """The blocks the tree decoded (in its cache)."""
    return [(s, b) for s, shard in enumerate(tree.shards) for b in range(shard.num_blocks) if (s, b) in tree.blocks.cache]


@pytest.mark.parametrize("strategy", [0, 1, 2])
def test_a_tar_of_incompressible_files_is_read_without_decoding_its_blocks(tmp_path: Path, strategy: int) -> None:
    dataset = write_dataset(tmp_path / "ds", jpeg_like(1, 60), strategy, block_size=4, shard_size=20)
    exported = exported_tars(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    view = TarView(tree)
    for shard in exported:
        assert tar_in_order(view, shard) == exported[shard], shard
    assert tree.located.pass_reads == 3 * 60  # every file: the JPEGs' runs, the class and JSON from the table
    assert tree.located.fallbacks == 0
    assert decoded_blocks(tree) == []


def test_a_tar_of_compressible_files_keeps_the_block_path(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    examples = [{"txt": "".join(rng.choice(list("ab "), 4000)), "json": {"id": i}} for i in range(40)]
    dataset = write_dataset(tmp_path / "ds", examples, 1, block_size=4, shard_size=20)
    exported = exported_tars(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    view = TarView(tree)
    for shard in exported:
        assert tar_in_order(view, shard) == exported[shard], shard
    assert tree.located.pass_reads == 0
    assert decoded_blocks(tree)  # the blocks were decoded, as export decodes them


def test_a_tar_read_twice_at_once_and_out_of_order_gives_the_export(tmp_path: Path) -> None:
    """Requests as the kernel's read-ahead sends them from several threads: a pass serves them
    in any order within its window; each file is still read once."""
    dataset = write_dataset(tmp_path / "ds", jpeg_like(3, 80), 2, block_size=4, shard_size=80)
    exported = exported_tars(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    view = TarView(tree)
    entry = view.lookup("/0.tar")
    offsets = list(range(0, entry.size, 16 << 10))
    for i in range(1, len(offsets) - 1, 2):  # pairs swapped: the second thread's request first
        offsets[i], offsets[i + 1] = offsets[i + 1], offsets[i]
    got = {offset: view.read(entry, offset, 16 << 10) for offset in offsets}
    assert b"".join(got[offset] for offset in sorted(got)) == exported["0"]
    assert tree.located.pass_reads == 3 * 80 and decoded_blocks(tree) == []


def test_a_shard_in_a_bucket_keeps_the_block_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From an object store a pass reads whole blocks: a request a file would wait for each."""
    dataset = write_dataset(tmp_path / "ds", jpeg_like(4, 20), 2, block_size=4, shard_size=20)
    exported = exported_tars(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    monkeypatch.setattr(tree.shards[0].storage, "remote", True)  # the local store standing for a bucket's
    assert tar_in_order(TarView(tree), "0") == exported["0"]
    assert tree.located.pass_reads == 0 and decoded_blocks(tree)


def test_locators_that_lie_cost_a_fallback_not_wrong_bytes(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, key, _, table = stored_table(tmp_path)  # a one-shard dataset at tmp_path/ds, its table stored
    forged_table(table, check=lambda c: c.__setitem__(slice(None), c ^ 0x5A5A5A5A)).save(str(path), key)
    exported = exported_tars(tmp_path / "ds", tmp_path / "export")
    tree = located_tree(tmp_path / "ds", tmp_path / "tables")
    view = TarView(tree)
    as_is = tree.located.stored_as_is(0, tree.table(0))
    with caplog.at_level(logging.WARNING, logger="atlasfs"):
        assert tar_in_order(view, "0") == exported["0"]
    if not as_is.any():
        pytest.fail("the dataset has no block whose runs are stored as they are: the test tests nothing")
    assert tree.located.pass_reads == 0 and tree.located.fallbacks > 0
    warned = [r for r in caplog.records if "read through the block from now on" in r.getMessage()]
    assert 0 < len(warned) <= tree.shards[0].num_blocks  # once a block at most
