"""The contract every format's source answers, as one test suite each format subclasses
(as fsspec's ``tests/abstract/``): adding a format means its module, its fixtures and a
subclass of :class:`FormatContract` (``tests/contract/test_contract_<format>.py``). The fixtures, apart
from the checks: what a subclass says and the ``dataset`` fixture (``formatfixtures.py``).

A subclass says how to write a small dataset of at least two shards (and what files it
must show), how to damage one of its shards, and its format's name; the suite checks:

- detection from the layout, and that a folder of nothing is refused in one line;
- the tree lists every folder's files in the written order with the written bytes;
- a real mount (``ls``/``find``/``cat``), ``atlasfs export`` and the mount's tar view agree
  byte for byte;
- a shard's stored state (its ``prepare()`` result) restores with no pass and gives the same
  samples, and a truncated or garbage state is refused with an error, never taken;
- a damaged shard fails its own files with EIO and nothing else, and ``verify`` names it.
"""

from __future__ import annotations

import errno
import os
import subprocess
import tarfile
from pathlib import Path
from typing import Any

import pytest

from atlasfs.errors import AtlasFormatError
from atlasfs.formats.factory import detect
from atlasfs.tree.blocktree import BlockTree
from formatfixtures import FormatFixtures, samples_of
from fusemount import atlasfs, mounted
from helpers import deep_equal

#: Files per folder each check reads through a mount (all of them for small folders).
MOUNT_READS = 60


class FormatContract(FormatFixtures):
    """The checks every format passes; a format's test subclasses this with its fixtures."""

    def test_detected_from_its_layout(self, dataset: Path) -> None:
        assert detect(str(dataset)) == self.kind

    def test_a_folder_of_nothing_is_refused_in_one_line(self, tmp_path: Path) -> None:
        (tmp_path / "empty").mkdir()
        with pytest.raises(AtlasFormatError) as info:
            detect(str(tmp_path / "empty"))
        assert "\n" not in str(info.value)
        with pytest.raises(AtlasFormatError) as info:
            self.source(tmp_path / "empty").close()
        assert str(tmp_path / "empty") in str(info.value) and "\n" not in str(info.value)

    def test_the_tree_shows_the_written_files_in_order(self, dataset: Path) -> None:
        expected = self.expected(dataset)
        assert len(expected) >= 2
        with self.source(dataset) as source:
            tree = BlockTree(source)
            for folder, files in expected.items():
                listed = tree.listdir(f"/{folder}")
                assert samples_of([name for name, _ in listed]) == samples_of(files)
                assert sorted(name for name, _ in listed) == sorted(files)
                for name, entry in listed:
                    assert entry.size == len(files[name])
                    assert tree.read(entry, 0, entry.size + 1) == files[name], f"{folder}/{name}"

    @pytest.mark.fuse
    def test_mount_export_and_tar_view_agree(self, dataset: Path, tmp_path: Path) -> None:
        expected = self.expected(dataset)
        out = tmp_path / "export"
        result = atlasfs("export", str(dataset), str(out), *self.options)
        assert result.returncode == 0, result.stderr
        with mounted(dataset, "--view", "both", *self.options) as mnt:
            found = subprocess.run(["find", str(mnt), "-type", "f", "-printf", "%P\n"], capture_output=True,
                                   text=True, check=True).stdout.split("\n")
            wanted = {f"{folder}/{name}" for folder, files in expected.items() for name in files}
            assert wanted <= set(found)
            for folder, files in expected.items():
                listed = subprocess.run(["ls", "-U", str(mnt / folder)], capture_output=True, text=True,
                                        check=True).stdout.split("\n")[:-1]
                assert samples_of(listed) == samples_of(files) and sorted(listed) == sorted(files)
                for name in list(files)[:MOUNT_READS]:
                    data = subprocess.run(["cat", str(mnt / folder / name)], capture_output=True, check=True).stdout
                    assert data == files[name], f"{folder}/{name}"
                exported = (out / f"{folder}.tar").read_bytes()
                assert (mnt / f"{folder}.tar").read_bytes() == exported  # the tar view is export's bytes
                with tarfile.open(out / f"{folder}.tar") as archive:
                    members = [(m.name, archive.extractfile(m).read()) for m in archive.getmembers()]
                assert sorted(members) == sorted(files.items())

    def test_a_stored_state_restores_and_a_corrupt_one_is_refused(self, dataset: Path) -> None:
        with self.source(dataset) as source:
            states = [shard.prepare() for shard in source.shards]
            samples = [[shard.decode_block(b)[0] for b in range(shard.num_blocks)] for shard in source.shards]
        for s, state in enumerate(states):
            with self.source(dataset) as fresh:
                shard = fresh.shards[s]
                shard.restore(state)
                assert deep_equal([shard.decode_block(b)[0] for b in range(shard.num_blocks)], samples[s])
            if not state:  # a format that learns nothing in its pass (Atlas) stores nothing to corrupt
                continue
            for bad in (state[:len(state) // 2], state[:-1], b"", bytes(len(state)), state + b"\0junk",
                        bytes(b ^ 0x5A for b in state)):
                with self.source(dataset) as fresh:
                    with pytest.raises((ValueError, AtlasFormatError)):
                        fresh.shards[s].restore(bad)

    def test_a_damaged_shard_fails_alone(self, dataset: Path) -> None:
        expected = self.expected(dataset)
        bad = self.damage(dataset)
        with self.source(dataset) as source:
            tree = BlockTree(source)
            failed = 0
            try:
                listed: list[tuple[str, Any]] = tree.listdir(f"/{bad}")
            except OSError as exc:
                assert exc.errno == errno.EIO
                failed += 1
                listed = []
            for name, entry in listed:
                try:
                    tree.read(tree.lookup(f"/{bad}/{name}"), 0, 1 << 30)
                except OSError as exc:
                    assert exc.errno == errno.EIO
                    failed += 1
            assert failed, f"nothing of {bad} failed"
            for folder, files in expected.items():
                if folder == bad:
                    continue
                for name, data in files.items():
                    assert tree.read(tree.lookup(f"/{folder}/{name}"), 0, 1 << 30) == data
        verify = atlasfs("verify", str(dataset), *[o for o in self.options])
        assert verify.returncode == 1, verify.stdout + verify.stderr
        assert "Traceback" not in verify.stderr
        assert os.path.basename(bad) in verify.stdout, verify.stdout
