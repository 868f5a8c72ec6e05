"""Modalities' own files (tests/fixtures/modalities/): what its packer and its merge wrote,
mounted with no option, every document equal to what Modalities' reader returns (widths) or
to what the merged parts held (the merge's shifted offsets corrected, and said once)."""

from __future__ import annotations

import io
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest

from atlasfs.formats.pbin import MERGE_SHIFT, PbinFile, unshift_merge, write_pbin
from corpus import FIXTURES, expected
from fusemount import atlasfs, mounted

MODALITIES = FIXTURES / "modalities"
#: What the finding says, whatever the file: the writer and that its offsets were shifted.
FINDING = "offsets shifted by Modalities' merge (join_embedded_stream_data)"


def _copy(fixture: str, tmp_path: Path) -> Path:
    """The fixture's data/ folder, copied (the tests never touch the corpus)."""
    return Path(shutil.copytree(MODALITIES / fixture / "data", tmp_path / fixture))


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
    dataset = _copy("widths", tmp_path)
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
    dataset = _copy("merged", tmp_path)
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
    dataset = _copy("merged", tmp_path)
    tables = tmp_path / "tables"
    for turn in range(2):  # the second mount restores the stored table: no pass over the index
        log = tmp_path / f"mount{turn}.log"
        with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tables}") as mnt:
            files = _mounted_files(mnt)
        assert [d.tolist() for d in _documents(files, "merged")] == \
            expected("modalities", "merged")["merged"]["parts_documents"]
        assert sum(FINDING in line for line in log.read_text().splitlines()) == 1, turn
        assert any(tables.iterdir())


def test_verify_names_the_shifted_offsets_in_one_line_and_info_works(tmp_path: Path) -> None:
    dataset = _copy("merged", tmp_path)
    result = atlasfs("verify", str(dataset))
    assert result.returncode == 1, result  # corrected, and still a finding
    lines = result.stdout.splitlines() + result.stderr.splitlines()
    [finding] = [line for line in lines if FINDING in line]
    assert str(dataset / "merged.pbin") in finding
    assert "documents 2..5" in finding and "12..24 bytes" in finding and "Traceback" not in result.stderr
    info = atlasfs("info", str(dataset))
    assert info.returncode == 0, info.stderr
    assert "examples     6" in info.stdout
    widths = atlasfs("verify", str(_copy("widths", tmp_path)))
    assert widths.returncode == 0 and FINDING not in widths.stdout + widths.stderr, widths


# -- the signature, on indexes the tests write the way the merge does


def _merge(parts: list[list[list[int]]], path: Path, width: int = 2) -> list[list[int]]:
    """Write ``parts`` (each a list of documents) as one file the way Modalities 0.5.0's
    ``join_embedded_stream_data`` does (part k's offsets + earlier data bytes - 12 k);
    returns every document in order."""
    dtype = np.dtype(f"<u{width}")
    data, index, offset = bytearray(), [], 0
    for k, part in enumerate(parts):
        start = len(data)
        for doc in part:
            encoded = np.asarray(doc, dtype=dtype).tobytes()
            index.append((len(data) - start + offset, len(encoded)))
            data += encoded
        offset += len(data) - start - MERGE_SHIFT
    import pickle
    path.write_bytes(len(data).to_bytes(8, "little") + width.to_bytes(4, "little") + bytes(data)
                     + pickle.dumps(index))
    return [doc for part in parts for doc in part]


@pytest.mark.parametrize("parts", [
    [[[1, 2], [3]], [[4, 5, 6]], [[7], [8, 9]]],
    [[], [[1, 2]], [[3]]],  # an empty first part: the first offset is -12
    [[[1, 2]], [], [], [[3, 4, 5]], [[6]]],  # empty parts between: a step back of 36
    [[[1]], [[2, 3, 4, 5, 6, 7, 8, 9]]],  # the step back reaches past the document before
    [[[i] * (i % 7 + 1) for i in range(40)] for _ in range(30)],
])
def test_written_merges_are_read_as_their_parts(tmp_path: Path, parts: list[list[list[int]]]) -> None:
    docs = _merge(parts, tmp_path / "m.pbin")
    pbin = PbinFile(str(tmp_path / "m.pbin"))
    assert pbin.merge_note is not None and FINDING in pbin.merge_note and not pbin.problems
    assert [a.tolist() for a in pbin.read_tokens(0, len(docs))] == docs
    pbin.close()


def test_indexes_without_the_signature_are_judged_as_written(tmp_path: Path) -> None:
    # a packer's file: contiguous, untouched
    write_pbin(str(tmp_path / "p.pbin"), [[1, 2], [3]], token_width=2)
    assert PbinFile(str(tmp_path / "p.pbin")).merge_note is None
    assert unshift_merge([(0, 4), (4, 2)], 6, 2) is None
    # steps back by other than a multiple of 12, or a correction that leaves a gap, runs
    # past the data or is no whole token: no correction, the bad documents fail alone
    assert unshift_merge([(0, 8), (2, 4)], 12, 2) is None
    assert unshift_merge([(0, 24), (12, 4)], 30, 2) is None  # would end at 40, not 30
    assert unshift_merge([(0, 24), (12, 4)], 44, 2) is None  # would leave 4 bytes after it
    assert unshift_merge([(0, 24), (12, 3)], 39, 2) is None
    assert unshift_merge([(0, 24), (12, 4), (30, 2)], 40, 2) is None  # a gap after the part boundary
    corrected = unshift_merge([(0, 24), (12, 4)], 28, 2)
    assert corrected is not None and corrected[0] == [(0, 24), (24, 4)]
    merged = _merge([[[1, 2, 3, 4, 5, 6, 7, 8]], [[9, 10]]], tmp_path / "m.pbin")
    assert len(merged) == 2
    raw = (tmp_path / "m.pbin").read_bytes()
    # one byte more of data than the parts had: the corrected index no longer tiles it
    longer = (22).to_bytes(8, "little") + raw[8:32] + b"\0\0" + raw[32:]
    (tmp_path / "x.pbin").write_bytes(longer)
    pbin = PbinFile(str(tmp_path / "x.pbin"))
    assert pbin.merge_note is None and list(pbin.problems) == [1]
    assert "inside the document before it" in pbin.problems[1]
    assert pbin.read_tokens(0, 1)[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
