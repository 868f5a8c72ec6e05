"""Stored file tables another user can write (issue #35, points 3, 4, 6 and 9): a table is used
only if no one but those who can change the data can change it (opened without following a
link, checked on the descriptor: a regular file of the mounting user, root or the dataset's
owner, writable by its owner alone), else ignored with one log line and built again; another
user's table is read by the size its header states; and a size no block can hold is refused
whoever wrote it. The other user is ``nobody`` (tests/support/otheruser.py): as owner of the files
and folders it could write (chown needs root, as switching users does). Through a mount:
tests/mount/test_hostile_tables.py.
"""

from __future__ import annotations

import logging
import os
import resource
import stat
import time
from pathlib import Path

import pytest

from atlasfs import AtlasDataset
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.store import BESIDE_DATASET, TableStore
from fusemount import atlasfs
from otheruser import NOBODY, require_root
from tabletrust import forged_locators, index_into, jpg_row, nobodys, trust_dataset


def test_a_grown_table_of_a_trusted_user_is_refused_by_its_header_without_being_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A table of the dataset's owner (trusted, not the user's: copied, not mapped) grown to a
    sparse 2 GiB: its header says how big it is, so only the header is read."""
    require_root()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dataset = trust_dataset(tmp_path / "ds")
    tables = tmp_path / "tables"
    index_into(dataset, tables)
    os.chown(dataset, NOBODY.pw_uid, NOBODY.pw_gid)  # theirs: their tables are used
    table = tables / "0.table"
    with open(table, "r+b") as f:
        f.truncate(2 << 30)
    nobodys(table, 0o644)
    nobodys(tables / "1.table", 0o644)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(tables)))
        assert tree.cache.misses == 0
        tree.names("/0")
        tree.names("/1")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    assert grown - before < 256 << 20, f"{(grown - before) >> 20} MiB more at the peak"
    assert tree.cache.misses == 3  # shard 0's 3 blocks built again; shard 1's table (theirs, valid) used
    lines = [r.getMessage() for r in caplog.records if "ignoring the stored file table" in r.getMessage()]
    assert len(lines) == 1 and str(table) in lines[0] and f"{2 << 30} bytes where its header means" in lines[0], lines


def test_a_table_group_writable_is_ignored_whoever_owns_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Writable by a group or by everyone: more people can change it than its owner."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dataset = trust_dataset(tmp_path / "ds")
    tables = tmp_path / "tables"
    index_into(dataset, tables)
    (tables / "0.table").chmod(0o664)
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(tables)))
        tree.names("/0")
    lines = [r.getMessage() for r in caplog.records if "ignoring the stored file table" in r.getMessage()]
    assert len(lines) == 1 and "can be changed by users other than its owner (mode 0664)" in lines[0], lines
    assert tree.cache.misses == 3


def test_a_size_no_block_can_hold_is_refused_even_from_the_datas_owner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A table of the mounting user's own (trusted) saying a file is 2^62 bytes (tar would pad it
    with zeros without end): refused by validation, built again; every size is the data's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dataset = trust_dataset(tmp_path / "ds")
    tables = tmp_path / "tables"
    index_into(dataset, tables)
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(tables)))
    table, key = tree.table(0), tree.tables.table_key(0)
    row = jpg_row(table)
    name, real = table.entry_path(row), int(table.size[row])
    forged_locators(table, key, tables / "0.table", dataset / "0", size_of=row, size=1 << 62, inline=False)
    assert os.stat(tables / "0.table").st_uid == os.geteuid()
    library = AtlasDataset(dataset)
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        tree = BlockTree(library, store=TableStore(str(dataset), index_dir=str(tables)))
        entry = tree.lookup(f"/0/{name}")
    assert entry is not None and entry.size == real == len(library[0]["jpg"])
    lines = [r.getMessage() for r in caplog.records if "ignoring the stored file table" in r.getMessage()]
    assert len(lines) == 1 and "a file size past the" in lines[0] and str(tables / "0.table") in lines[0], lines


def test_atlasfs_index_never_changes_the_mode_of_a_file_a_table_links_to(tmp_path: Path) -> None:
    """``.atlasfs-tables/0.table -> secret`` (and ``1.table`` a hard link to another): `atlasfs
    index` as root made the secret 0644 (its chmod followed the link). A link is refused with a
    log line and replaced by the table; a file that is not a valid table keeps its mode."""
    require_root()
    dataset = trust_dataset(tmp_path / "ds")
    secret, hard = tmp_path / "secret", tmp_path / "secret2"
    for path in (secret, hard):
        path.write_bytes(b"password\n")
        path.chmod(0o600)
    beside = dataset / BESIDE_DATASET
    beside.mkdir()
    nobodys(beside, 0o755)
    (beside / "0.table").symlink_to(secret)
    nobodys(beside / "0.table")
    os.link(hard, beside / "1.table")
    result = atlasfs("index", str(dataset), env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert result.returncode == 0, result.stderr
    for path in (secret, hard):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == b"password\n", path
    assert not (beside / "0.table").is_symlink()
    assert stat.S_IMODE((beside / "0.table").stat().st_mode) == 0o644
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    tree.names("/0")
    tree.names("/1")
    assert tree.cache.misses == 0  # the tables stored are used


def test_atlasfs_index_never_writes_through_a_linked_table_folder(tmp_path: Path) -> None:
    """``.atlasfs-tables -> elsewhere`` (made by whoever owns the dataset): `atlasfs index`, run
    by root, wrote its tables into the folder the link names. The link is never followed: each
    table is one line naming the folder, exit 1, and nothing is written there."""
    require_root()
    dataset = trust_dataset(tmp_path / "ds")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dataset / BESIDE_DATASET).symlink_to(elsewhere)
    result = atlasfs("index", str(dataset), env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert result.returncode == 1, result.stderr
    assert list(elsewhere.iterdir()) == []
    assert "Traceback" not in result.stderr
    assert "is a symbolic link (never followed)" in result.stderr, result.stderr


def test_a_mount_waits_for_no_fifo_put_in_place_of_a_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A FIFO in place of a table: opened without blocking, refused as no regular file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dataset = trust_dataset(tmp_path / "ds")
    tables = tmp_path / "tables"
    tables.mkdir()
    os.mkfifo(tables / "0.table")
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(tables)))
        tree.names("/0")
    assert time.monotonic() - started < 30
    lines = [r.getMessage() for r in caplog.records if "ignoring the stored file table" in r.getMessage()]
    assert len(lines) == 1 and "is not a regular file" in lines[0], lines
