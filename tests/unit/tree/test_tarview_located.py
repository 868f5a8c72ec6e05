"""A tar read front to back through the tar view (atlasfs/tree/tarstream.py) reads each file of
a block that stores its runs as they are through its locator (``LocatedReads.block_in_pass``):
a block's stored bytes read once for its files, no block decoded; a compressed block keeps the
block path; locators that lie cost a fallback, never wrong bytes; a data.bin changed under a
pass fails what is read after the change.
Through a mount: tests/mount/test_tarview_located_mount.py."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import atlasfs.tree.tarstream as tarstream
from atlasfs.commands import cli
from atlasfs.formats.atlas.spans.read import STORED_PIECE
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.tarview import TarView
from atlasfs.tree.table.layout import NO_LOCATOR
from atlasfs.tree.table.store import table_file_name
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


def _same_sizes(seed: int) -> list[dict[str, Any]]:
    """Incompressible files of sizes fixed whatever the seed: a strategy 0 data.bin of one seed
    has the size of another's, only its bytes differ."""
    rng, sizes = np.random.default_rng(seed), np.random.default_rng(0).integers(3000, 9000, 120)
    return [{"jpg": rng.bytes(int(size)), "cls": i} for i, size in enumerate(sizes)]


def _eio(view: TarView, entry: Any, offset: int) -> None:
    with pytest.raises(OSError) as failed:
        view.read(entry, offset, REQUEST)
    assert failed.value.errno == errno.EIO


def test_a_data_bin_rewritten_between_two_requests_of_a_pass_fails_the_later_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass checks data.bin once a block, after reading it: a request made of blocks read
    after data.bin was rewritten (same size, another dataset's bytes) fails with EIO rather than
    serving some new bytes after the old ones. (Within what the pass made before the change, a
    request is served the old bytes: each checked when read.)"""
    monkeypatch.setattr(tarstream, "LEAD", 0)  # the pass goes only as far as asked: no thread reads ahead
    dataset = write_dataset(tmp_path / "ds", _same_sizes(1), 0, block_size=4)
    other = write_dataset(tmp_path / "other", _same_sizes(2), 0, block_size=4)
    data, new = dataset / "0" / "data.bin", (other / "0" / "data.bin").read_bytes()
    assert len(new) == data.stat().st_size and new != data.read_bytes()
    exported = exported_tars(dataset, tmp_path / "export")["0"]
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    view = TarView(tree)
    entry = view.lookup("/0.tar")
    assert view.read(entry, 0, REQUEST) == exported[:REQUEST]
    assert 0 < tree.located.pass_reads < 120  # the first request read through the pass, not the whole shard
    data.write_bytes(new)  # a new mtime too
    _eio(view, entry, REQUEST)
    assert decoded_blocks(tree) == []


def test_a_data_bin_changed_while_a_block_is_read_fails_that_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.bin's identity is checked after a block's reads, which it covers: changed while a
    block is read (here its mtime alone, its bytes all still right), the block's files are not
    served (a check before the reads alone would pass them)."""
    monkeypatch.setattr(tarstream, "LEAD", 0)
    dataset = write_dataset(tmp_path / "ds", jpeg_like(5, 40), 2, block_size=4)
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    shard = tree.shards[0]
    read_range = shard.read_range
    data = dataset / "0" / "data.bin"

    def read_then_touch(block: int, offset: int, size: int) -> bytes:
        got = read_range(block, offset, size)
        mtime = data.stat().st_mtime_ns
        os.utime(data, ns=(mtime + 1_000_000_000, mtime + 1_000_000_000))  # data.bin "changes" after this read
        return got

    monkeypatch.setattr(shard, "read_range", read_then_touch)
    view = TarView(tree)
    _eio(view, view.lookup("/0.tar"), 0)
    assert tree.located.pass_reads == 0


def test_a_pass_reads_a_block_a_few_preads_at_a_time_and_checks_data_bin_once_a_block_after_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What makes the pass cheap (docs/performance.md, "The tar view"): per block of files stored
    as they are, a read of its stored bytes a piece at a time and two checks of data.bin (one
    for the mapped index, one after the reads), not a read and a check per file."""
    dataset = write_dataset(tmp_path / "ds", jpeg_like(6, 64), 2, block_size=8)
    exported = exported_tars(dataset, tmp_path / "export")["0"]
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    shard = tree.shards[0]
    calls = {"read_range": 0, "check_unchanged": 0}
    for name in calls:
        def counted(*args: Any, _name: str = name, _f: Any = getattr(shard, name)) -> Any:
            calls[_name] += 1
            return _f(*args)
        monkeypatch.setattr(shard, name, counted)
    tree.located.stored_as_is(0, tree.table(0))  # made first: its own checks are not the pass's
    calls.update(read_range=0, check_unchanged=0)
    assert tar_in_order(TarView(tree), "0") == exported
    blocks = shard.num_blocks
    stored = max(shard.stored_block_size(b) for b in range(blocks))
    assert tree.located.pass_reads == 3 * 64 and decoded_blocks(tree) == []
    assert calls["check_unchanged"] == 2 * blocks
    assert calls["read_range"] <= blocks * -(-stored // STORED_PIECE) < 3 * 64


def test_a_file_without_a_locator_takes_the_block_path_alone(tmp_path: Path) -> None:
    """In a block read together, a file the table has no locator for is read through its block;
    the block's other files still through theirs."""
    dataset = write_dataset(tmp_path / "ds", jpeg_like(7, 24), 2, block_size=4)
    exported = exported_tars(dataset, tmp_path / "export")["0"]
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    table = tree.table(0)
    row = next(i for i in table.example_order() if table.block.item(i) == 2)  # block 2's first file
    path = tmp_path / "tables" / table_file_name(tree.shards[0].name)
    none = {"offset": NO_LOCATOR, "length": 0, "check": 0, "prefix": 0}  # what a row without a locator holds
    forged = forged_table(table, **{name: lambda c, v=value: c.__setitem__(row, v) for name, value in none.items()})
    forged.save(str(path), tree.tables.table_key(0))
    tree = located_tree(dataset, tmp_path / "tables")
    assert tree.table(0).locator(row) is None
    assert tar_in_order(TarView(tree), "0") == exported
    assert tree.located.pass_reads == 3 * 24 - 1 and tree.located.fallbacks == 0
    assert decoded_blocks(tree) == [(0, 2)]
