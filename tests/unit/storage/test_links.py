"""The symbolic link rule of ``atlasfs.storage.links``, as an attacker would try it: a dataset's
owner (uid 12345 here) links a dataset file to a file only root, or another user, may read,
and root opens the dataset (a mount with ``allow_other`` would serve it to everyone).

A link is followed only if this process runs as its owner, it is root's, or its owner owns
the file it leads to. These tests run as root (they chown to an unused uid) and are skipped
elsewhere, failing in CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import atlasfs.storage as storage
from atlasfs.storage import LOCAL, LocalStorage, UnfitFileError, open_regular
from atlasfs.storage.files import walk
from atlasfs.storage.links import approved
from forged import build, forged_link
from linkattack import OTHER, OTHER2, as_root, link  # noqa: F401 (as_root: autouse)


def secret(tmp_path: Path, owner: int = 0) -> Path:
    path = tmp_path / f"secret-{owner}"
    path.write_bytes(b"root's secret")
    path.chmod(0o600)
    os.chown(path, owner, owner)
    return path


def test_another_users_link_to_a_root_file_is_refused_naming_it(tmp_path: Path) -> None:
    bad = link(tmp_path / "ds" / "0" / "data.bin", secret(tmp_path), OTHER)
    for attempt in (lambda: open_regular(str(bad)), lambda: LOCAL.read(str(bad)),
                    lambda: LocalStorage().pread(str(bad), 0, 4), lambda: LOCAL.open(str(bad))):
        with pytest.raises(UnfitFileError) as caught:
            attempt()
        assert str(caught.value) == (f"{bad}: a symbolic link of uid {OTHER} to a file of uid 0, "
                                     "not followed when atlasfs runs as uid 0")


def test_links_that_may_be_followed_are(tmp_path: Path) -> None:
    """Root's link (the daemon's own user) to root's file; the attacker's link to their own file;
    a chain of the attacker's links ending at their own file; a relative link (Hugging Face's
    snapshots/ -> ../../blobs/)."""
    root_link = link(tmp_path / "a", secret(tmp_path), 0)
    own_link = link(tmp_path / "b", secret(tmp_path, OTHER), OTHER)
    chain = link(tmp_path / "c", own_link, OTHER)
    (tmp_path / "blobs").mkdir()
    blob = tmp_path / "blobs" / "1234"
    blob.write_bytes(b"blob")
    os.chown(blob, OTHER, OTHER)
    relative = link(tmp_path / "snapshots" / "rev" / "x.bin", "../../blobs/1234", OTHER)
    for path, data in ((root_link, b"root's secret"), (own_link, b"root's secret"), (chain, b"root's secret"),
                       (relative, b"blob")):
        assert LOCAL.read(str(path)) == data
        assert approved(str(path)).st_ino == os.stat(path).st_ino


def test_a_folder_link_on_the_way_is_checked_too(tmp_path: Path) -> None:
    """The shard folder, or the dataset's root, a link to root's folder: its files, and its listing."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "data.bin").write_bytes(b"root's")
    shard = link(tmp_path / "ds" / "0", private, OTHER)
    with pytest.raises(UnfitFileError) as caught:
        open_regular(str(shard / "data.bin"))
    assert str(caught.value) == (f"{shard}/data.bin: a file of uid 0 reached through {shard}, a symbolic link "
                                 f"of uid {OTHER}, not followed when atlasfs runs as uid 0")
    with pytest.raises(UnfitFileError, match="a symbolic link of uid 12345 to a folder of uid 0"):
        LOCAL.listdir(str(shard))
    errors: list[OSError] = []
    assert list(walk(LOCAL, str(shard), errors.append)) == [] and "not followed" in str(errors[0])


def test_a_link_of_a_third_user_in_the_chain_is_refused(tmp_path: Path) -> None:
    """The attacker's link to another user's link to that user's private file: the first link's
    owner does not own the file."""
    theirs = link(tmp_path / "theirs", secret(tmp_path, OTHER2), OTHER2)
    mine = link(tmp_path / "mine", theirs, OTHER)
    with pytest.raises(UnfitFileError, match=f"uid {OTHER} to a file of uid {OTHER2}"):
        open_regular(str(mine))


def test_a_link_swapped_between_the_check_and_the_open_is_refused(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacker points their link at their own file, then at root's once it was looked at:
    the descriptor is not the file approved."""
    mine = secret(tmp_path, OTHER)
    path = link(tmp_path / "data.bin", mine, OTHER)
    real = storage.approved

    def then_swap(name: str) -> os.stat_result:
        found = real(name)
        os.unlink(path)
        link(path, secret(tmp_path), OTHER)
        return found

    monkeypatch.setattr(storage, "approved", then_swap)
    with pytest.raises(UnfitFileError, match="replaced while it was opened"):
        open_regular(str(path))


def test_missing_files_and_loops_fail_as_before(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as missing:
        open_regular(str(tmp_path / "no" / "data.bin"))
    assert missing.value.filename == str(tmp_path / "no" / "data.bin")
    loop = link(tmp_path / "loop", tmp_path / "loop", OTHER)
    with pytest.raises(OSError, match="Too many levels"):
        open_regular(str(loop))
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        open_regular(str(tmp_path / "file" / "x"))


def test_a_users_own_dataset_is_unchanged(tmp_path: Path) -> None:
    """Links of the process's own user are followed wherever they lead (it could read the file
    itself): nothing changes for a user mounting their own dataset (here: root's links to
    another user's file)."""
    path = link(tmp_path / "x", secret(tmp_path, OTHER), 0)
    assert LOCAL.read(str(path)) == b"root's secret"


@pytest.fixture(scope="module")
def forgedfs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("forgedfs"))


def test_a_link_a_users_fuse_server_says_is_roots_answers_to_that_user(tmp_path: Path, forgedfs: Path) -> None:
    """The attacker mounts a FUSE file system (``allow_other``: ``user_allow_other`` lets any user
    ask for it) whose server says its link to root's secret is root's. The mount's user answers
    for it: refused, and the message says both. Its link to the attacker's own file is followed."""
    with forged_link(forgedfs, tmp_path / "fuse", "0.tar", secret(tmp_path), OTHER) as forged:
        assert os.lstat(forged).st_uid == 0  # the lie, as every program sees it
        with pytest.raises(UnfitFileError) as caught:
            LOCAL.read(str(forged))
        assert str(caught.value) == (f"{forged}: a symbolic link of uid {OTHER} (the user of its FUSE file system, "
                                     "which says uid 0) to a file of uid 0, not followed when atlasfs runs as uid 0")
    with forged_link(forgedfs, tmp_path / "fuse2", "0.tar", secret(tmp_path, OTHER), OTHER) as own:
        assert LOCAL.read(str(own)) == b"root's secret"


def test_a_root_fuse_servers_links_are_roots(tmp_path: Path, forgedfs: Path) -> None:
    """A FUSE file system root mounted (its user_id 0) answers for its owners as root's would."""
    with forged_link(forgedfs, tmp_path / "fuse", "0.tar", secret(tmp_path, OTHER2), 0) as forged:
        assert LOCAL.read(str(forged)) == b"root's secret"
