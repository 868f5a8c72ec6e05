"""atlasfs.formats.atlas.spans.fingerprints: a block's stored CRC-32 is remembered only with the
identity of the file it was read from, and never when that file changed a moment ago."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from atlasfs.formats.atlas.spans import fingerprints
from atlasfs.formats.atlas.spans.fingerprints import StoredFingerprints, file_identity
from atlasfs.storage import LOCAL


class _Counted:
    """A fingerprint computation that counts its calls."""

    def __init__(self, value: int | None) -> None:
        self.value = value
        self.calls = 0

    def __call__(self) -> int | None:
        self.calls += 1
        return self.value


def test_a_fingerprint_is_remembered_under_its_identity_only() -> None:
    memo = StoredFingerprints(4)
    first = _Counted(0xDEADBEEF)
    assert memo.get(2, 77, first) == 0xDEADBEEF and memo.get(2, 77, first) == 0xDEADBEEF
    assert first.calls == 1  # read once
    other = _Counted(5)
    assert memo.get(2, 79, other) == 5 and other.calls == 1  # another file now: read again
    assert memo.get(2, 77, first) == 0xDEADBEEF and first.calls == 2  # 79's replaced 77's
    assert memo.get(1, 79, other) == 5 and other.calls == 2  # other blocks are their own
    unsure = _Counted(9)
    assert memo.get(3, None, unsure) == 9 and memo.get(3, None, unsure) == 9 and unsure.calls == 2
    failed = _Counted(None)
    assert memo.get(0, 77, failed) is None and memo.get(0, 77, failed) is None and failed.calls == 2
    assert memo.get(4, 77, _Counted(1)) == 1 and memo.get(-1, 77, _Counted(2)) == 2  # no such block: not kept


def test_no_memory_is_taken_until_a_fingerprint_is_remembered() -> None:
    memo = StoredFingerprints(1 << 20)
    memo.get(0, None, _Counted(1))
    assert memo._entries is None
    memo.get(0, 3, _Counted(1))
    assert memo._entries is not None and memo._entries.nbytes == 8 << 20  # 8 bytes a block


def test_a_file_changed_a_moment_ago_gives_no_identity(tmp_path: Path) -> None:
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * 100)
    assert file_identity(str(path), LOCAL) is None  # its ctime is now: a change could follow in the same tick
    assert file_identity(str(tmp_path / "missing"), LOCAL) is None


def test_an_identity_changes_with_the_bytes_even_when_size_and_mtime_are_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fingerprints, "RACY_NS", 0)  # no waiting: the clock's ticks are apart below
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * 100)
    st = path.stat()
    first = file_identity(str(path), LOCAL)
    assert first is not None and first & 1 and first == file_identity(str(path), LOCAL)
    time.sleep(0.05)  # past any coarse clock tick (HZ >= 100)
    path.write_bytes(b"y" * 100)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
    assert file_identity(str(path), LOCAL) not in (None, first)
