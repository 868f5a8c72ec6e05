"""Modalities' own files (tests/fixtures/modalities/): what its packer and its merge wrote,
mounted with no option, every document equal to what Modalities' reader returns (widths) or
to what the merged parts held (the merge's shifted offsets corrected, and said once)."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

import numpy as np

from corpus import expected
from fusemount import atlasfs, mounted
from pbindata import FINDING, copy_modalities


def _mounted_files(mnt: Path) -> dict[str, bytes]:
    """Every file of the mount, found by ``find`` and read by ``cat``."""
    found = subprocess.run(["find", str(mnt), "-type", "f", "-printf", "%P\n"], capture_output=True, text=True,
                           check=True).stdout.split()
    return {name: subprocess.run(["cat", str(mnt / name)], capture_output=True, check=True).stdout
            for name in found}


def _documents(files: dict[str, bytes], folder: str) -> list[np.ndarray]:
    """The ``.npy`` files of ``folder`` in name (= document) order, loaded."""
    names = sorted(n for n in files if n.startswith(f"{folder}/"))
    assert names and all(n.endswith(".npy") for n in names), names
    return [np.load(io.BytesIO(files[n]), allow_pickle=False) for n in names]


def _exported(dataset: Path, out: Path) -> dict[str, bytes]:
    """``atlasfs export``'s tars, as ``{folder/member: bytes}``."""
    result = atlasfs("export", str(dataset), str(out))
    assert result.returncode == 0, result.stderr
    members = {}
    for tar in sorted(out.glob("*.tar")):
        with tarfile.open(tar) as archive:
            for member in archive.getmembers():
                members[f"{tar.stem}/{member.name}"] = archive.extractfile(member).read()  # type: ignore[union-attr]
    return members


def test_the_packers_widths_read_as_modalities_reads_them(tmp_path: Path) -> None:
    want = expected("modalities", "widths")["files"]
    dataset = copy_modalities("widths", tmp_path)
    with mounted(dataset) as mnt:
        files = _mounted_files(mnt)
    assert sorted({n.split("/")[0] for n in files}) == sorted(want) == ["w1", "w2", "w4"]
    for stem, reading in want.items():
        width = reading["header"]["token_size_in_bytes"]
        docs = _documents(files, stem)
        # Modalities' reader widens in memory (int32 for 2-byte tokens, int64 for 4); the file's
        # own width is served, and the values are the reader's.
        assert all(d.dtype == np.dtype(f"<u{width}") for d in docs), stem
        assert [d.tolist() for d in docs] == reading["documents"], stem
    assert _exported(dataset, tmp_path / "out") == files


def test_the_merged_file_serves_its_parts_documents_and_says_so_once(tmp_path: Path) -> None:
    want = expected("modalities", "merged")
    dataset = copy_modalities("merged", tmp_path)
    log = tmp_path / "mount.log"
    with mounted(dataset, "-o", f"log_file={log}") as mnt:
        files = _mounted_files(mnt)
    docs = [d.tolist() for d in _documents(files, "merged")]
    assert docs == want["merged"]["parts_documents"]
    assert docs != want["merged"]["documents"]  # Modalities' reader returns the shifted tokens
    named = [line for line in log.read_text().splitlines() if "merged.pbin" in line]
    assert len(named) == 1 and FINDING in named[0], named  # the finding, once; no document failed
    assert _exported(dataset, tmp_path / "out") == files


def test_a_mount_from_a_stored_table_still_says_it(tmp_path: Path) -> None:
    dataset = copy_modalities("merged", tmp_path)
    tables = tmp_path / "tables"
    for turn in range(2):  # the second mount restores the stored table: no pass over the index
        log = tmp_path / f"mount{turn}.log"
        with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tables}") as mnt:
            files = _mounted_files(mnt)
        assert [d.tolist() for d in _documents(files, "merged")] == \
            expected("modalities", "merged")["merged"]["parts_documents"]
        assert sum(FINDING in line for line in log.read_text().splitlines()) == 1, turn
        assert any(tables.iterdir())
