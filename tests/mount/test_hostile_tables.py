"""Stored file tables another user can write, through a real mount (issue #35): a symlinked
table repointed under a mount never crashes the daemon, another user's sparse 2 GiB table is
ignored without being read, and a forged one is ignored with every byte the data's. The other
user is ``nobody`` (tests/support/otheruser.py); the tables alone:
tests/unit/tree/test_table_trust.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from atlasfs import AtlasDataset
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.filetable import FileTable, Limits
from atlasfs.tree.table.store import BESIDE_DATASET, TableStore, cache_folder
from fusemount import force_unmount, require_fuse, wait_mounted
from otheruser import NOBODY, require_root
from tabletrust import forged_locators, index_into, jpg_row, nobodys, trust_dataset


Exported = dict[str, dict[str, bytes]]


#: A foreground daemon: argv[1] "1" has the tree hold one table at a time and the engine read
#: none from its file (every table let go is mapped again by the tree: TableStore.reopen);
#: the rest is `atlasfs mount -f`'s arguments.
_FOREGROUND = """
import sys
from atlasfs.commands import cli
from atlasfs.fuse import attachments
from atlasfs.tree.table import tables
if sys.argv[1] == "1":
    tables.RESIDENT_TABLE_BYTES = 1
    attachments.FILE_TABLES_MAX = 0
sys.exit(cli.main(["mount", "-f", *sys.argv[2:]]))
"""


def _export(dataset: Path, out: Path) -> Exported:
    """The bytes of every file, as ``atlasfs export`` writes them (a tree without stored tables,
    which export reads through): shard -> name -> bytes. Its raw ``.jpg`` files are checked
    against the library's examples too, so that no table of atlasfs's own is their oracle."""
    tree = BlockTree(AtlasDataset(dataset))
    exported: Exported = {}
    for shard in tree.shard_folders():
        exported[shard] = {}
        for name, _, _ in tree.names(f"/{shard}"):
            entry = tree.lookup(f"/{shard}/{name}")
            exported[shard][name] = tree.read(entry, 0, entry.size)
    tree.source.close()
    library = {example["__key__"]: example for example in AtlasDataset(dataset)}
    jpgs = {name[:-len(".jpg")]: data for files in exported.values() for name, data in files.items()
            if name.endswith(".jpg")}
    assert jpgs == {key: example["jpg"] for key, example in library.items()}
    return exported


def _start(dataset: Path, mnt: Path, log: Path, *args: str, one_table: bool = False,
           env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """A foreground daemon mounting ``dataset`` on ``mnt`` (its log in ``log``)."""
    require_fuse()
    mnt.mkdir(exist_ok=True)
    process = subprocess.Popen([sys.executable, "-c", _FOREGROUND, "1" if one_table else "0", str(dataset), str(mnt),
                                "-o", f"log_file={log}", *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, **(env or {})})
    wait_mounted(process, mnt)
    return process


def _stop(process: subprocess.Popen[str], mnt: Path) -> None:
    force_unmount(mnt)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _read(mnt: Path, shard: str, names: list[str], exported: Exported) -> list[str]:
    """The files among ``names`` of ``shard`` whose bytes through ``mnt`` differ from the export's."""
    wrong = []
    for name in names:
        try:
            data = (mnt / shard / name).read_bytes()
        except OSError as exc:
            wrong.append(f"{shard}/{name}: {exc}")
            continue
        if data != exported[shard][name]:
            wrong.append(f"{shard}/{name}: {len(data)} bytes, not the exported {len(exported[shard][name])}")
    return wrong


def _ignored(log: Path, path: Path, why: str) -> list[str]:
    lines = [line for line in log.read_text().splitlines()
             if f"ignoring the stored file table {path}: it {why}" in line and "building it again" in line]
    return lines


def test_a_symlinked_table_repointed_under_a_mount_never_crashes_the_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user links ``.atlasfs-tables/0.table`` to the mounting user's own cached copy (a
    predictable path); followed, it was mapped in place and its path remembered, and once the
    link pointed at a file of theirs it was mapped again unchecked and cut short: SIGBUS. A
    link is never followed: the table comes from the cache, and the daemon serves on."""
    require_root()
    dataset = trust_dataset(tmp_path / "ds")
    exported = _export(dataset, tmp_path / "export")
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    cached = Path(cache_folder(str(dataset)))
    index_into(dataset, cached)  # the user's own cache holds every table (an earlier mount)
    beside = dataset / BESIDE_DATASET
    beside.mkdir()
    nobodys(beside)  # theirs: they may put anything in it
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for shard in exported:
        link = beside / f"{shard}.table"
        link.symlink_to(cached / f"{shard}.table")
        nobodys(link)
        shutil.copyfile(cached / f"{shard}.table", theirs / f"{shard}.table")  # valid: the same bytes
        nobodys(theirs / f"{shard}.table", 0o644)
    names = {shard: list(files) for shard, files in exported.items()}
    third = len(names["0"]) // 3
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    daemon = _start(dataset, mnt, log, one_table=True, env={"XDG_CACHE_HOME": str(xdg)})
    try:
        wrong = _read(mnt, "0", names["0"][:third], exported)
        wrong += _read(mnt, "1", names["1"], exported)  # the tree lets shard 0's table go
        repointed = beside / "0.table.new"
        repointed.symlink_to(theirs / "0.table")
        nobodys(repointed)
        os.rename(repointed, beside / "0.table")
        wrong += _read(mnt, "0", names["0"][third:2 * third], exported)  # shard 0's table again
        with open(theirs / "0.table", "r+b") as f:
            f.truncate(0)  # in place, as its owner may
        wrong += _read(mnt, "0", names["0"][2 * third:], exported)
        assert sorted(os.listdir(mnt / "0")) == sorted(names["0"])
        assert daemon.poll() is None, f"the daemon died: {daemon.returncode}"
        assert wrong == [], wrong
    finally:
        _stop(daemon, mnt)
    assert _ignored(log, beside / "0.table", "is a symbolic link"), log.read_text()


def _vm_hwm(pid: int) -> int:
    """The peak resident memory of process ``pid``, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_a_sparse_2_gib_table_of_another_user_is_ignored_without_being_read(tmp_path: Path) -> None:
    """A 2 GiB sparse file put in a shared --index-dir by another user was read whole before any
    check (the daemon went to 2,075 MiB). It is ignored, by its owner, with one log line; the
    daemon's peak memory stays far below the file's size."""
    require_root()
    dataset = trust_dataset(tmp_path / "ds")
    exported = _export(dataset, tmp_path / "export")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # a shared folder, as /tmp
    sparse = shared / "0.table"
    with open(sparse, "wb") as f:
        f.truncate(2 << 30)
    nobodys(sparse, 0o644)
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    daemon = _start(dataset, mnt, log, "--index-dir", str(shared), env={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    try:
        wrong = _read(mnt, "0", list(exported["0"]), exported)
        peak = _vm_hwm(daemon.pid)
        assert daemon.poll() is None
    finally:
        _stop(daemon, mnt)
    assert wrong == [], wrong
    assert peak < 512 << 20, f"the daemon peaked at {peak >> 20} MiB"
    assert len(_ignored(log, sparse, f"is owned by uid {NOBODY.pw_uid}, who cannot change the dataset")) == 1, \
        log.read_text()


@pytest.mark.parametrize("where", ["index-dir", "beside"])
def test_a_forged_table_of_another_user_is_ignored_and_every_byte_is_the_datas(tmp_path: Path, where: str) -> None:
    """A table with right checksums that lies (an inline file's bytes, a file said to be empty),
    written by another user where more people can write than the data: a shared --index-dir,
    or a ``.atlasfs-tables/`` of theirs. It is ignored with one log line saying why, and every
    byte read is the data's."""
    require_root()
    dataset = trust_dataset(tmp_path / "ds")
    exported = _export(dataset, tmp_path / "export")
    built = tmp_path / "built"
    index_into(dataset, built)
    if where == "beside":
        folder = dataset / BESIDE_DATASET
        folder.mkdir()
        nobodys(folder)
        args: list[str] = []
    else:
        folder = tmp_path / "shared"
        folder.mkdir()
        folder.chmod(0o1777)
        args = ["--index-dir", str(folder)]
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(built)))
    table, key = tree.table(0), tree.tables.table_key(0)
    forged = folder / "0.table"
    forged_locators(table, key, forged, dataset / "0", size_of=jpg_row(table), size=0)
    loaded = FileTable.load(str(forged), key, Limits(tree.shards[0].num_blocks, tree.shards[0].block_size,
                                                     tree.shards[0].max_block_bytes))
    assert loaded is not None  # valid as a table: only its owner tells it from the data's
    nobodys(forged, 0o644)
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    daemon = _start(dataset, mnt, log, *args, env={"XDG_CACHE_HOME": str(tmp_path / "xdg")})
    try:
        wrong = [f"{shard}/{name}" for shard, files in exported.items() for name in files
                 if (mnt / shard / name).stat().st_size != len(files[name])]
        for shard, files in exported.items():
            wrong += _read(mnt, shard, list(files), exported)
    finally:
        _stop(daemon, mnt)
    assert wrong == [], wrong
    assert len(_ignored(log, forged, f"is owned by uid {NOBODY.pw_uid}, who cannot change the dataset")) == 1, \
        log.read_text()
