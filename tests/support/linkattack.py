"""What the symbolic-link attack tests share: another user (a uid no one on the machine has),
links made as theirs, and the rule that these tests run as root (they chown files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fusemount import IN_CI

#: No user of the machine: the dataset's owner, an attacker.
OTHER = 12345
#: A third user.
OTHER2 = 12346


@pytest.fixture(autouse=True)
def as_root() -> None:
    """Each test of a module importing this runs as root: in CI it fails otherwise, never skips."""
    if os.geteuid() != 0:
        if IN_CI:
            pytest.fail("the link attack tests chown files: they run as root in CI")
        pytest.skip("needs root (chown)")


def link(path: Path, target: Path | str, owner: int) -> Path:
    """A symbolic link at ``path`` to ``target``, owned by ``owner``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)
    os.lchown(path, owner, owner)
    return path
