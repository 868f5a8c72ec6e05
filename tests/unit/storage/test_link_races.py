"""The symbolic link rule of ``atlasfs.storage.links`` where a path is looked at and then used
again: a folder listed or walked, a dataset's path opened for format detection, a file's size
told by ``stat``, and a block's fingerprint keyed on the file its reads see. The attacker
(uid 12345, a dataset's owner) swaps a link between the look and the use. These tests run as
root (they chown to an unused uid) and are skipped elsewhere, failing in CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import atlasfs.storage as storage
import atlasfs.storage.links as links
from atlasfs.errors import AtlasFormatError
from atlasfs.formats.atlas.spans import fingerprints
from atlasfs.formats.atlas.spans.fingerprints import file_identity
from atlasfs.formats.factory import detect
from atlasfs.storage import LocalStorage, UnfitFileError
from atlasfs.storage.files import walk
from linkattack import OTHER, as_root, link  # noqa: F401 (as_root: autouse)


def folders(tmp_path: Path) -> tuple[Path, Path]:
    """The attacker's own folder and root's private one, each with a file of its own name."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "attackers-name").write_bytes(b"")
    os.chown(mine, OTHER, OTHER)
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "roots-secret-name").write_bytes(b"")
    return mine, private


def swap_after_look(monkeypatch: pytest.MonkeyPatch, path: Path, target: Path) -> None:
    """The rule's look (wherever it is imported from) finds the link as it is, then the link
    is pointed at ``target``: what the caller opens next is no longer what was approved."""
    real = links.approved

    def then_swap(name: str) -> os.stat_result:
        found = real(name)
        if os.path.islink(path) and os.readlink(path) != str(target):
            os.unlink(path)
            link(path, target, OTHER)
        return found

    monkeypatch.setattr(storage, "approved", then_swap)
    monkeypatch.setattr(links, "approved", then_swap)


def test_a_folder_link_swapped_after_its_look_is_not_listed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine, private = folders(tmp_path)
    shard = link(tmp_path / "ds" / "0", mine, OTHER)
    assert LocalStorage().listdir(str(shard)) == [("attackers-name", False)]  # their own: listed
    swap_after_look(monkeypatch, shard, private)
    with pytest.raises(UnfitFileError) as caught:
        LocalStorage().listdir(str(shard))
    assert str(caught.value) == (f"{shard}: replaced while it was opened (a symbolic link on its way changed?); "
                                 "not listed")


def test_a_folder_link_swapped_after_its_look_is_not_walked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine, private = folders(tmp_path)
    top = link(tmp_path / "ds", mine, OTHER)
    swap_after_look(monkeypatch, top, private)
    errors: list[OSError] = []
    assert list(walk(storage.LOCAL, str(top), errors.append)) == []
    assert len(errors) == 1 and "replaced while it was opened" in str(errors[0]) and str(top) in str(errors[0])


def test_a_sub_folder_swapped_for_a_link_during_a_walk_is_not_entered(tmp_path: Path) -> None:
    """The walk lists ds/ (sub/ a folder then), and the attacker makes sub/ a link to root's
    folder before the walk goes down: it is not followed (a sub-folder is opened relative to
    its parent's descriptor, never through a link)."""
    _, private = folders(tmp_path)
    top = tmp_path / "ds"
    (top / "sub").mkdir(parents=True)
    (top / "sub" / "x.tar").write_bytes(b"")
    seen = []
    for here, dirs, files in walk(storage.LOCAL, str(top)):
        seen.append((here, dirs, files))
        if here == str(top):
            (top / "sub" / "x.tar").unlink()
            (top / "sub").rmdir()
            link(top / "sub", private, OTHER)
    assert seen == [(str(top), ["sub"], [])]


def test_a_walk_is_as_os_walk(tmp_path: Path) -> None:
    """Names sorted, sub-folders pruned in place, a link to a folder listed but not entered,
    an unreadable sub-folder to onerror named by its path."""
    top = tmp_path / "ds"
    for sub in ("b/c", "a", "skip"):
        (top / sub).mkdir(parents=True)
    (top / "b" / "c" / "2.tar").write_bytes(b"")
    (top / "b" / "1.tar").write_bytes(b"")
    (top / "a" / "9").write_bytes(b"")
    link(top / "loop", top, 0)
    got = []
    for here, dirs, files in walk(storage.LOCAL, str(top)):
        got.append((here, list(dirs), files))
        if "skip" in dirs:
            dirs.remove("skip")
    assert got == [(str(top), ["a", "b", "loop", "skip"], []), (f"{top}/a", [], ["9"]), (f"{top}/b", ["c"], ["1.tar"]),
                   (f"{top}/b/c", [], ["2.tar"])]
    errors: list[OSError] = []
    assert list(walk(storage.LOCAL, str(tmp_path / "none"), errors.append)) == []
    assert isinstance(errors[0], FileNotFoundError) and errors[0].filename == str(tmp_path / "none")


def test_detection_never_opens_a_device_through_a_link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacker's dataset is a link to a device: refused by the rule (root's device), and
    even through root's own link (allowed) the device is not opened, only named."""
    opened: list[str] = []
    real_open = os.open

    def recording(path: object, *args: object, **kwargs: object) -> int:
        if isinstance(path, str) and "dir_fd" not in kwargs and os.path.realpath(path) == "/dev/null":
            opened.append(path)
        return real_open(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", recording)
    theirs = link(tmp_path / "theirs", "/dev/null", OTHER)
    with pytest.raises(AtlasFormatError) as caught:
        detect(str(theirs))
    assert str(caught.value) == (f"{theirs}: a symbolic link of uid {OTHER} to a file of uid 0, "
                                 "not followed when atlasfs runs as uid 0")
    roots = link(tmp_path / "roots", "/dev/null", 0)
    with pytest.raises(AtlasFormatError) as caught:
        detect(str(roots))
    assert str(caught.value) == f"{roots}: not a regular file (a character device)"
    assert opened == []


def test_detection_refuses_a_folder_link_of_another_user(tmp_path: Path) -> None:
    _, private = folders(tmp_path)
    theirs = link(tmp_path / "ds", private, OTHER)
    with pytest.raises(AtlasFormatError, match=f"{theirs}: a symbolic link of uid {OTHER} to a folder of uid 0"):
        detect(str(theirs))


def test_stat_and_its_kin_tell_nothing_through_a_refused_link(tmp_path: Path) -> None:
    """A size, mtime or kind is not told through another user's link either; the attacker's
    link to their own file is (and pointed at root's file afterwards: refused, not remembered)."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"root's secret")
    secret.chmod(0o600)
    own = tmp_path / "own"
    own.write_bytes(b"x")
    os.chown(own, OTHER, OTHER)
    bad = link(tmp_path / "ds" / "data.bin", own, OTHER)
    local = LocalStorage()
    assert local.stat(str(bad)) == (1, own.stat().st_mtime_ns) and local.isfile(str(bad))
    os.unlink(bad)
    link(bad, secret, OTHER)
    # told as an empty file (it exists: a dataset's listing keeps it, and fails only it)...
    assert local.stat(str(bad)) == (0, 0) and local.isfile(str(bad)) and not local.isdir(str(bad))
    with pytest.raises(UnfitFileError, match=f"{bad}: a symbolic link of uid {OTHER} to a file of uid 0"):
        local.check_file(str(bad))  # ...which fails whatever checks or reads it, in one line
    _, private = folders(tmp_path)
    shard = link(tmp_path / "ds" / "0", private, OTHER)
    assert local.stat(str(shard / "roots-secret-name")) == (0, 0) and not local.isdir(str(shard))
    assert local.stat(str(tmp_path / "missing")) is None and not local.isdir(str(tmp_path / "missing"))


def test_a_fingerprint_identity_is_of_the_file_the_reads_see(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """data.bin renamed over by a file of the same size and mtime while a reader holds the old
    one open: the identity is the held descriptor's (as located.c fstats its own), not the
    new file's, so a CRC remembered from the old bytes is never taken for the new file's."""
    monkeypatch.setattr(fingerprints, "RACY_NS", 0)
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * 100)
    reader = LocalStorage()
    assert reader.pread(str(path), 0, 4) == b"xxxx"  # a descriptor held, as a shard's reads hold it
    new = tmp_path / "new"
    new.write_bytes(b"y" * 100)
    st = path.stat()
    os.utime(new, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(new, path)
    held = file_identity(str(path), reader)
    assert reader.pread(str(path), 0, 4) == b"xxxx"  # the reads see the old file
    assert held is not None and held != file_identity(str(path), LocalStorage())  # a new reader sees the new one
    reader.close_file(str(path))
    assert reader.pread(str(path), 0, 4) == b"yyyy" and file_identity(str(path), reader) != held
