"""``atlasfs pack`` through a real mount: a packed dataset shows the same files as its source
(the command alone: tests/unit/commands/test_pack.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from corpus import copy_data
from fusemount import atlasfs, mounted


def test_mounted_packed_dataset_shows_the_same_files(tmp_path: Path) -> None:
    source = copy_data("webdataset", "tiny", tmp_path)
    out = tmp_path / "packed"
    assert atlasfs("pack", str(source), str(out), "-j", "1").returncode == 0

    def listing(mnt: Path) -> list[tuple[str, bytes]]:
        found = subprocess.run(["find", str(mnt), "-type", "f", "-printf", "%P\\n"], capture_output=True,
                               text=True, check=True).stdout.split()
        return [(path.split("/", 1)[1], (mnt / path).read_bytes()) for path in found]

    with mounted(source) as a, mounted(out) as b:
        theirs, ours = listing(a), listing(b)
    assert ours == theirs and len(ours) == 12
