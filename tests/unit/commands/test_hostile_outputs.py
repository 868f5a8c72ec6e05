"""What ``atlasfs pack`` and ``export`` write, in a folder another user can write (issue #35:
another local user must not make atlasfs act on a symbolic link's target or on their files).

``pack`` writes into ``.<OUTDIR>.pack-partial`` beside OUTDIR (a name anyone can foresee, often
in a shared /tmp) and renames it to OUTDIR; ``export`` writes ``<shard>.tar.partial`` and
``shards.json.partial`` into OUTDIR, which may exist already and be another user's. Another
user's link or folder there is never followed nor used. The other user is ``nobody``
(tests/support/otheruser.py), as owner of what it could have made there (chown needs root).
"""

from __future__ import annotations

import os
import stat
import tarfile
from pathlib import Path

from atlasfs import AtlasWriter
from fusemount import atlasfs
from otheruser import NOBODY, require_root


def _dataset(path: Path) -> Path:
    with AtlasWriter(path, shard_size=8, block_size=2, compression_strategy=1) as writer:
        writer.add_examples([{"__key__": f"s{i:03d}", "txt": f"text {i}", "cls": i} for i in range(16)])
    return path


def _nobodys(path: Path) -> Path:
    os.lchown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    return path


def _victim(tmp_path: Path) -> Path:
    """A folder of the user's, with a file and a sub-folder in it."""
    victim = tmp_path / "victim"
    (victim / "sub").mkdir(parents=True)
    (victim / "file.txt").write_text("precious")
    return victim


def test_pack_never_follows_nor_uses_another_users_temporary_folder(tmp_path: Path) -> None:
    """A link put at ``.out.pack-partial`` had pack remove everything in the folder it points to
    (taken for leftovers of another pack) and write the dataset there, OUTDIR becoming that
    user's link; another user's folder there became OUTDIR, theirs to change. Now each is one
    line, exit 1, nothing removed, nothing written."""
    require_root()
    dataset = _dataset(tmp_path / "ds")
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    out = shared / "out"
    partial = shared / ".out.pack-partial"
    victim = _victim(tmp_path)

    _nobodys(partial.symlink_to(victim) or partial)
    result = atlasfs("pack", str(dataset), str(out), timeout=60)
    assert result.returncode == 1 and result.stderr == (
        f"atlasfs: pack stopped, {out} not written: {partial}: is a symbolic link (never followed); "
        "remove it, or pack elsewhere\n"), result.stderr
    assert sorted(p.name for p in victim.iterdir()) == ["file.txt", "sub"]
    assert (victim / "file.txt").read_text() == "precious"
    assert not os.path.lexists(out) and partial.is_symlink()

    partial.unlink()
    partial.mkdir()
    partial.chmod(0o777)
    (partial / "planted").write_text("theirs")
    _nobodys(partial)
    result = atlasfs("pack", str(dataset), str(out), timeout=60)
    assert result.returncode == 1 and result.stderr == (
        f"atlasfs: pack stopped, {out} not written: {partial}: not used: it is owned by uid {NOBODY.pw_uid}, "
        "not by this user; remove it, or pack elsewhere\n"), result.stderr
    assert not os.path.lexists(out) and (partial / "planted").read_text() == "theirs"

    (partial / "planted").unlink()
    partial.rmdir()
    result = atlasfs("pack", str(dataset), str(out), timeout=60)
    assert result.returncode == 0, result.stderr
    st = os.lstat(out)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid()


def test_export_never_writes_through_a_link_in_its_outdir(tmp_path: Path) -> None:
    """OUTDIR another user's folder, holding ``0.tar.partial`` and ``shards.json.partial`` as links
    to the user's files: export opened them with open(..., "wb"), writing a tar over one and
    the wids index into the other. Now the links are replaced, never followed."""
    require_root()
    dataset = _dataset(tmp_path / "ds")
    out = tmp_path / "out"
    out.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (out / "0.tar.partial").symlink_to(victim)
    (out / "shards.json.partial").symlink_to(tmp_path / "made.txt")
    for path in (out / "0.tar.partial", out / "shards.json.partial", out):
        _nobodys(path)
    result = atlasfs("export", str(dataset), str(out), timeout=60)
    assert result.returncode == 0, result.stderr
    assert victim.read_text() == "precious"
    assert not os.path.lexists(tmp_path / "made.txt")
    assert sorted(p.name for p in out.iterdir()) == ["0.tar", "1.tar", "shards.json"]
    for name in ("0.tar", "1.tar"):
        assert not (out / name).is_symlink()
        with tarfile.open(out / name) as tar:
            assert len(tar.getnames()) == 16
