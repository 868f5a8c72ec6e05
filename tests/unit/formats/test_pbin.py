"""Modalities .pbin files: both header forms, token widths, a safe index, bad entries named."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

from atlasfs.formats.pbin import PbinError, PbinFile, write_pbin

DOCS = [[1, 2, 3], [], [65535, 0], list(range(300))]


@pytest.mark.parametrize("width, header", [(1, 12), (2, 12), (4, 12), (4, 8)])
def test_both_header_forms_and_every_width(tmp_path: Path, width: int, header: int) -> None:
    path = tmp_path / "d.pbin"
    docs = [[t % (1 << (8 * width)) for t in d] for d in DOCS]
    write_pbin(str(path), docs, token_width=width, header=header)
    pbin = PbinFile(str(path))
    assert (pbin.header_bytes, pbin.token_width, len(pbin)) == (header, width, 4)
    arrays = pbin.read_tokens(0, 4)
    for array, doc in zip(arrays, docs):
        assert isinstance(array, np.ndarray) and array.dtype == np.dtype(f"<u{width}")
        assert array.tolist() == doc
    assert [a.tolist() for a in pbin.read_tokens(2, 5)] == docs[2:]


def _raw(path: Path, data: bytes, index: object, width: int = 2) -> Path:
    path.write_bytes(len(data).to_bytes(8, "little") + width.to_bytes(4, "little") + data + pickle.dumps(index))
    return path


def test_bad_entries_fail_alone_and_are_named(tmp_path: Path) -> None:
    data = bytes(range(20))
    path = _raw(tmp_path / "bad.pbin", data, [(0, 4), (2, 4), (4, 3), (10, 20), (16, 4)])
    pbin = PbinFile(str(path))
    problems = [d.problem for d in pbin.documents]
    assert problems[0] is None and problems[4] is None
    assert "document 1" in problems[1] and "inside the document before it" in problems[1]
    assert "document 2" in problems[2] and "whole number" in problems[2]
    assert "document 3" in problems[3] and "outside the data segment" in problems[3]
    read = pbin.read_tokens(0, 5)
    assert read[0].tolist() == [0x0100, 0x0302] and read[4].tolist() == [0x1110, 0x1312]
    assert all(isinstance(r, PbinError) and str(tmp_path / "bad.pbin") in str(r) for r in read[1:4])


class Evil:
    def __reduce__(self):  # type: ignore[no-untyped-def]
        import os
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("index, message", [
    ([Evil()], "refused"),
    ({"not": "a list"}, "not a list"),
    ([(1, 2, 3)], "not a (start, length) pair"),
])
def test_an_unsafe_or_malformed_index_is_refused_in_one_line(tmp_path: Path, index: object, message: str) -> None:
    path = _raw(tmp_path / "x.pbin", bytes(8), index)
    with pytest.raises(PbinError) as info:
        PbinFile(str(path))
    text = str(info.value)
    assert str(path) in text and "\n" not in text
    assert message in text or "not a .pbin file" in text


def test_truncated_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "t.pbin"
    write_pbin(str(path), DOCS)
    whole = path.read_bytes()
    for cut in (4, 12, 100, len(whole) - 3):
        path.write_bytes(whole[:cut])
        with pytest.raises(PbinError, match=str(path)):
            PbinFile(str(path))
