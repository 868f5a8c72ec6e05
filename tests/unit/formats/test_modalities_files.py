"""Modalities' merged files without a mount: ``verify`` names the shifted offsets in one line
and ``info`` works, merges written here read as their parts, and indexes without the merge's
signature are judged as written (through a mount, Modalities' own files:
tests/mount/test_corpus_modalities.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from atlasfs.formats.pbin import MERGE_SHIFT, PbinFile, unshift_merge, write_pbin
from fusemount import atlasfs
from pbindata import FINDING, copy_modalities


def test_verify_names_the_shifted_offsets_in_one_line_and_info_works(tmp_path: Path) -> None:
    dataset = copy_modalities("merged", tmp_path)
    result = atlasfs("verify", str(dataset))
    assert result.returncode == 1, result  # corrected, and still a finding
    lines = result.stdout.splitlines() + result.stderr.splitlines()
    [finding] = [line for line in lines if FINDING in line]
    assert str(dataset / "merged.pbin") in finding
    assert "documents 2..5" in finding and "12..24 bytes" in finding and "Traceback" not in result.stderr
    info = atlasfs("info", str(dataset))
    assert info.returncode == 0, info.stderr
    assert "examples     6" in info.stdout
    widths = atlasfs("verify", str(copy_modalities("widths", tmp_path)))
    assert widths.returncode == 0 and FINDING not in widths.stdout + widths.stderr, widths


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
