"""The record of table files found valid (atlasfs/tree/table/validated.py): what it takes from
its file, and what it refuses (the mount's side: tests/mount/test_table_checks_mount.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from atlasfs.tree.table import ondisk, validated
from atlasfs.tree.table.filetable import Limits


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """ondisk's files found valid, and the folders read, as in a new process."""
    monkeypatch.setattr(ondisk, "_VALIDATED", {})
    monkeypatch.setattr(ondisk, "on_validated", None)
    monkeypatch.setattr(validated, "_loaded", set())


def test_well_formed_lines_are_taken_and_others_skipped(tmp_path: Path, fresh: None) -> None:
    record = tmp_path / validated.RECORD_NAME
    record.write_text("1 2 3 4 0 5 6 7\nnot a line\n1 2 3\n1 2 3 4 5 6 7\n-1 2 3 4 0 5 6 7\n8 9 10 11 0 12 13 14\n")
    record.chmod(0o600)
    assert validated.load(str(tmp_path), lambda: str(tmp_path)) == 2
    assert ondisk._VALIDATED == {(1, 2, 3, 4, 0): Limits(5, 6, 7), (8, 9, 10, 11, 0): Limits(12, 13, 14)}
    assert validated.load(str(tmp_path), lambda: str(tmp_path)) == 0  # read once a process


def test_a_record_others_can_write_or_a_link_is_not_used(tmp_path: Path, fresh: None) -> None:
    record = tmp_path / validated.RECORD_NAME
    record.write_text("1 2 3 4 0 5 6 7\n")
    record.chmod(0o622)
    assert validated.load(str(tmp_path), lambda: str(tmp_path)) == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "real").write_text("1 2 3 4 0 5 6 7\n")
    os.symlink(other / "real", other / validated.RECORD_NAME)
    assert validated.load(str(other), lambda: str(other)) == 0
    assert ondisk._VALIDATED == {}


def test_files_checked_are_appended_and_the_record_kept_bounded(tmp_path: Path, fresh: None,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "made"
    assert validated.load(str(root), lambda: str(root)) == 0
    assert ondisk.on_validated is not None
    ondisk.on_validated((1, 2, 3, 4, 0), Limits(5, 6, 7))
    assert (root / validated.RECORD_NAME).read_text() == "1 2 3 4 0 5 6 7\n"
    assert (root / validated.RECORD_NAME).stat().st_mode & 0o077 == 0
    # a record of twice KEPT lines is cut to the last KEPT as it is read
    monkeypatch.setattr(validated, "KEPT", 2)
    monkeypatch.setattr(validated, "_loaded", set())
    (root / validated.RECORD_NAME).write_text("".join(f"{i} 0 0 0 0 1 1 1\n" for i in range(5)))
    assert validated.load(str(root), lambda: "/elsewhere") == 2
    assert (root / validated.RECORD_NAME).read_text() == "3 0 0 0 0 1 1 1\n4 0 0 0 0 1 1 1\n"
    ondisk.on_validated((7, 7, 7, 7, 7), Limits(1, 1, 1))  # the user's folder is elsewhere now
    assert "7 7 7 7 7" not in (root / validated.RECORD_NAME).read_text()


def test_a_table_changed_in_place_with_its_size_and_mtime_put_back_is_another_file(tmp_path: Path) -> None:
    """A file found valid is known by an identity its owner cannot put back (ctime)."""
    path = tmp_path / "0.table"
    path.write_bytes(b"a" * 4096)
    before = os.stat(path)
    time.sleep(0.01)
    with open(path, "r+b") as f:
        f.write(b"b")
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert ondisk._identity(after) != ondisk._identity(before)
