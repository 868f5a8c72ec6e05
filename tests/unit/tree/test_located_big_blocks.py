"""Small files of strategy-0 blocks past 256 KiB are kept inline and read in Python (the control
plane's located reads) without their block: the block's stored CRC-32 is read once and
remembered, and a block changed since, its size and mtime kept, is never served stale
(through a mount: tests/mount/test_located_big_blocks_mount.py)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from atlasfs.formats.atlas.spans import fingerprints, located
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.layout import LOCATOR_RULES
from atlasfs.tree.table.store import table_file_name
from bigblocks import CHANGED_URL, URL, block_of, damage, small_files, write_big_blocks
from locateddata import export_shards, index_tables, located_tree


def _counted_fingerprints(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every whole-block fingerprint read from now on (a list its length counts)."""
    reads: list[int] = []
    real = located.stored_fingerprint

    @functools.wraps(real)
    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        reads.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(located, "stored_fingerprint", counted)
    return reads


def _read(tree: BlockTree, name: str) -> bytes:
    """A random reader's read of a whole file (a reader in order gets the block path)."""
    tree.blocks.last_block[0] = (-10, 1)
    entry = tree.lookup(f"/0/{name}")
    return tree.read(entry, 0, entry.size + 10)


def test_small_files_of_big_blocks_are_inline_and_read_once_a_block(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprints, "RACY_NS", 0)  # remembered though just written
    dataset = write_big_blocks(tmp_path / "ds")
    exported = export_shards(dataset, tmp_path / "export")["0"]
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    table = tree.table(0)
    names = small_files(exported)
    inline = {table.entry_path(i) for i in range(len(table))
              if (locator := table.locator(i)) is not None and locator.inline}
    assert inline == set(names)
    reads = _counted_fingerprints(monkeypatch)
    for _ in range(2):
        for name in names:
            assert _read(tree, name) == exported[name], name
    assert tree.cache.misses == 0 and tree.located.fallbacks == 0  # no block decoded
    assert tree.located.reads == 2 * len(names)
    assert len(reads) == tree.shards[0].num_blocks  # each block's bytes read once in all


def test_a_block_changed_after_its_fingerprint_was_remembered_is_not_served_stale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprints, "RACY_NS", 0)
    dataset = write_big_blocks(tmp_path / "ds")
    exported = export_shards(dataset, tmp_path / "export")["0"]
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    for name in small_files(exported):
        if name.endswith(".cls"):
            assert _read(tree, name) == exported[name]  # every block's fingerprint remembered
    assert tree.located.reads == len(exported) // 3
    damage(dataset, changed=(1,), broken=2)
    for name in small_files(exported):
        if not name.endswith(".json"):
            continue
        block = block_of(name)
        if block == 2:
            with pytest.raises(OSError):  # its block no longer decodes: EIO, not the table's bytes
                _read(tree, name)
        elif block == 1:
            assert _read(tree, name) == exported[name].replace(URL, CHANGED_URL), name  # the block's bytes now
        else:
            assert _read(tree, name) == exported[name], name
    assert tree.located.fallbacks == 2  # one a damaged block: its files are read through it since


def test_tables_stored_under_the_old_locator_rules_are_built_again(tmp_path: Path) -> None:
    """A table stored before big blocks got inline files (its key has no ``locators``) is not
    used: built again, it gains them."""
    dataset = write_big_blocks(tmp_path / "ds")
    index_tables(dataset, tmp_path / "tables")
    tree = located_tree(dataset, tmp_path / "tables")
    key = tree.tables.table_key(0)
    assert key["locators"] == LOCATOR_RULES
    assert tree.tables.stored(0, key) is not None
    table = tree.table(0)
    table.save(str(tmp_path / "tables" / table_file_name(tree.shards[0].name)),
               {name: value for name, value in key.items() if name != "locators"})
    assert tree.tables.stored(0, key) is None
