"""Stored file tables another user can write (issue #35, points 3, 4, 6 and 9): a table is used
only if no one but those who can change the data can change it (opened without following a
link, checked on the descriptor: a regular file of the mounting user, root or the dataset's
owner, writable by its owner alone), else ignored with one log line and built again; another
user's table is read by the size its header states; and a size no block can hold is refused
whoever wrote it. The other user is ``nobody`` (tests/support/otheruser.py): as owner of the files
and folders it could write (chown needs root, as switching users does).
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.formats.atlas.spans.find import inline_check, stored_crc
from atlasfs.tree.blocktree import BlockTree
from atlasfs.tree.table.filetable import FileTable, Limits, Locators
from atlasfs.tree.table.layout import FILE, INLINE, NO_LOCATOR
from atlasfs.tree.table.store import BESIDE_DATASET, TableStore, cache_folder
from fusemount import atlasfs, force_unmount, require_fuse, wait_mounted
from otheruser import NOBODY, require_root

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


def _examples(n: int) -> list[dict[str, Any]]:
    """Every kind of file: raw bytes and text (located runs), small ints and JSON (inline),
    a larger JSON (kept in the table)."""
    rng = np.random.default_rng(7)
    return [{"__key__": f"s{i:03d}", "jpg": rng.bytes(1500 + 10 * i), "txt": f"text {i} " * 40, "cls": i,
             "json": {"id": i}, "values.json": {"id": i, "values": rng.integers(100, 1000, 60).tolist()}}
            for i in range(n)]


def _dataset(path: Path, shards: int = 2) -> Path:
    with AtlasWriter(path, shard_size=12, block_size=4, compression_strategy=1) as writer:
        writer.add_examples(_examples(12 * shards))
    return path


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


def _index(dataset: Path, folder: Path) -> None:
    """Every shard's table, every size known, stored in ``folder`` (what ``atlasfs index`` does)."""
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(folder)))
    for s in range(len(tree.shards)):
        tree.table(s, sizes=True)
    tree.source.close()


def _nobodys(path: Path, mode: int | None = None) -> Path:
    """``path`` (a file, folder or link) given to ``nobody``, as if they had made it."""
    os.lchown(path, NOBODY.pw_uid, NOBODY.pw_gid)
    if mode is not None:
        path.chmod(mode)
    return path


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


# ---------------------------------------------------------------- 3: a symlinked table


def test_a_symlinked_table_repointed_under_a_mount_never_crashes_the_daemon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another user links ``.atlasfs-tables/0.table`` to the mounting user's own cached copy (a
    predictable path); followed, it was mapped in place and its path remembered, and once the
    link pointed at a file of theirs it was mapped again unchecked and cut short: SIGBUS. A
    link is never followed: the table comes from the cache, and the daemon serves on."""
    require_root()
    dataset = _dataset(tmp_path / "ds")
    exported = _export(dataset, tmp_path / "export")
    xdg = tmp_path / "xdg"
    monkeypatch.setenv("XDG_CACHE_HOME", str(xdg))
    cached = Path(cache_folder(str(dataset)))
    _index(dataset, cached)  # the user's own cache holds every table (an earlier mount)
    beside = dataset / BESIDE_DATASET
    beside.mkdir()
    _nobodys(beside)  # theirs: they may put anything in it
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    for shard in exported:
        link = beside / f"{shard}.table"
        link.symlink_to(cached / f"{shard}.table")
        _nobodys(link)
        shutil.copyfile(cached / f"{shard}.table", theirs / f"{shard}.table")  # valid: the same bytes
        _nobodys(theirs / f"{shard}.table", 0o644)
    names = {shard: list(files) for shard, files in exported.items()}
    third = len(names["0"]) // 3
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    daemon = _start(dataset, mnt, log, one_table=True, env={"XDG_CACHE_HOME": str(xdg)})
    try:
        wrong = _read(mnt, "0", names["0"][:third], exported)
        wrong += _read(mnt, "1", names["1"], exported)  # the tree lets shard 0's table go
        repointed = beside / "0.table.new"
        repointed.symlink_to(theirs / "0.table")
        _nobodys(repointed)
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


# ---------------------------------------------------------------- 4: a sparse 2 GiB table


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
    dataset = _dataset(tmp_path / "ds")
    exported = _export(dataset, tmp_path / "export")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # a shared folder, as /tmp
    sparse = shared / "0.table"
    with open(sparse, "wb") as f:
        f.truncate(2 << 30)
    _nobodys(sparse, 0o644)
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


def test_a_grown_table_of_a_trusted_user_is_refused_by_its_header_without_being_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A table of the dataset's owner (trusted, not the user's: copied, not mapped) grown to a
    sparse 2 GiB: its header says how big it is, so only the header is read."""
    require_root()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dataset = _dataset(tmp_path / "ds")
    tables = tmp_path / "tables"
    _index(dataset, tables)
    os.chown(dataset, NOBODY.pw_uid, NOBODY.pw_gid)  # theirs: their tables are used
    table = tables / "0.table"
    with open(table, "r+b") as f:
        f.truncate(2 << 30)
    _nobodys(table, 0o644)
    _nobodys(tables / "1.table", 0o644)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(tables)))
        assert tree.cache.misses == 0
        tree.names("/0")
        tree.names("/1")
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    assert grown - before < 256 << 20, f"{(grown - before) >> 20} MiB more at the peak"
    assert tree.cache.misses == 3  # shard 0's 3 blocks built again; shard 1's table (theirs, valid) used
    lines = [r.getMessage() for r in caplog.records if "ignoring the stored file table" in r.getMessage()]
    assert len(lines) == 1 and str(table) in lines[0] and f"{2 << 30} bytes where its header means" in lines[0], lines


# ---------------------------------------------------------------- 6: a forged table, checksums right


def _fingerprints(shard: Path, block: int) -> list[int]:
    """What a block's fingerprint may be (spans/read.py): its frame's checksum, or the CRC-32
    of its stored bytes."""
    index = np.load(shard / "index.npy")
    stored = (shard / "data.bin").read_bytes()[int(index[block]):int(index[block + 1])]
    return [int.from_bytes(stored[-4:], "little"), stored_crc(stored)]


def _forged(table: FileTable, key: dict[str, Any], path: Path, shard: Path, size_of: int | None = None,
            size: int = 0, inline: bool = True) -> None:
    """``table`` (of the shard folder ``shard``) stored at ``path`` with every checksum right,
    lying: its first inline file's bytes changed (``inline``; its check made to match), and the
    file of row ``size_of`` (its locator dropped) said to be ``size`` bytes."""
    locators = table.locators
    assert locators is not None
    columns = {name: getattr(locators, name).copy() for name in ("offset", "length", "check", "prefix")}
    inline_bytes = bytearray(bytes(locators.inline))
    if inline:  # its check recomputed as a forger would: from the block's fingerprint, read from the data
        row = int(np.flatnonzero(columns["prefix"] == INLINE)[0])
        at, length = int(columns["offset"][row]), int(columns["length"][row])
        original = bytes(inline_bytes[at:at + length])
        fingerprint = next(f for f in _fingerprints(shard, int(table.block[row]))
                           if inline_check(original, f) == int(columns["check"][row]))
        inline_bytes[at:at + length] = b"X" * length
        columns["check"][row] = inline_check(b"X" * length, fingerprint)
    sizes = np.array(table.size, dtype=np.uint64)
    if size_of is not None:
        sizes[size_of] = size
        columns["offset"][size_of], columns["length"][size_of], columns["prefix"][size_of] = NO_LOCATOR, 0, 0
    forged = FileTable(bytes(table._names), np.array(table._offsets), {
        "kind": np.array(table.kind), "size": sizes, "block": np.array(table.block), "pos": np.array(table.pos),
        "file": np.array(table.file), "by_path": np.array(table.by_path)})
    forged.state = table.state
    forged.locators = Locators(columns["offset"], columns["length"], columns["check"], columns["prefix"],
                               list(locators.prefixes), bytes(inline_bytes), bytes(locators.kept),
                               np.array(locators.kept_ends))
    forged.save(str(path), key)


def _jpg_row(table: FileTable) -> int:
    return next(i for i in range(len(table)) if table.kind[i] == FILE and table.entry_path(i).endswith(".jpg"))


@pytest.mark.parametrize("where", ["index-dir", "beside"])
def test_a_forged_table_of_another_user_is_ignored_and_every_byte_is_the_datas(tmp_path: Path, where: str) -> None:
    """A table with right checksums that lies (an inline file's bytes, a file said to be empty),
    written by another user where more people can write than the data: a shared --index-dir,
    or a ``.atlasfs-tables/`` of theirs. It is ignored with one log line saying why, and every
    byte read is the data's."""
    require_root()
    dataset = _dataset(tmp_path / "ds")
    exported = _export(dataset, tmp_path / "export")
    built = tmp_path / "built"
    _index(dataset, built)
    if where == "beside":
        folder = dataset / BESIDE_DATASET
        folder.mkdir()
        _nobodys(folder)
        args: list[str] = []
    else:
        folder = tmp_path / "shared"
        folder.mkdir()
        folder.chmod(0o1777)
        args = ["--index-dir", str(folder)]
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(built)))
    table, key = tree.table(0), tree.tables.table_key(0)
    forged = folder / "0.table"
    _forged(table, key, forged, dataset / "0", size_of=_jpg_row(table), size=0)
    loaded = FileTable.load(str(forged), key, Limits(tree.shards[0].num_blocks, tree.shards[0].block_size,
                                                     tree.shards[0].max_block_bytes))
    assert loaded is not None  # valid as a table: only its owner tells it from the data's
    _nobodys(forged, 0o644)
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


def test_a_table_group_writable_is_ignored_whoever_owns_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """Writable by a group or by everyone: more people can change it than its owner."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dataset = _dataset(tmp_path / "ds")
    tables = tmp_path / "tables"
    _index(dataset, tables)
    (tables / "0.table").chmod(0o664)
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(tables)))
        tree.names("/0")
    lines = [r.getMessage() for r in caplog.records if "ignoring the stored file table" in r.getMessage()]
    assert len(lines) == 1 and "can be changed by users other than its owner (mode 0664)" in lines[0], lines
    assert tree.cache.misses == 3


def test_a_size_no_block_can_hold_is_refused_even_from_the_datas_owner(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A table of the mounting user's own (trusted) saying a file is 2^62 bytes (tar would pad it
    with zeros without end): refused by validation, built again; every size is the data's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dataset = _dataset(tmp_path / "ds")
    tables = tmp_path / "tables"
    _index(dataset, tables)
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(tables)))
    table, key = tree.table(0), tree.tables.table_key(0)
    row = _jpg_row(table)
    name, real = table.entry_path(row), int(table.size[row])
    _forged(table, key, tables / "0.table", dataset / "0", size_of=row, size=1 << 62, inline=False)
    assert os.stat(tables / "0.table").st_uid == os.geteuid()
    library = AtlasDataset(dataset)
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        tree = BlockTree(library, store=TableStore(str(dataset), index_dir=str(tables)))
        entry = tree.lookup(f"/0/{name}")
    assert entry is not None and entry.size == real == len(library[0]["jpg"])
    lines = [r.getMessage() for r in caplog.records if "ignoring the stored file table" in r.getMessage()]
    assert len(lines) == 1 and "a file size past the" in lines[0] and str(tables / "0.table") in lines[0], lines


# ---------------------------------------------------------------- 9: atlasfs index and a linked table


def test_atlasfs_index_never_changes_the_mode_of_a_file_a_table_links_to(tmp_path: Path) -> None:
    """``.atlasfs-tables/0.table -> secret`` (and ``1.table`` a hard link to another): `atlasfs
    index` as root made the secret 0644 (its chmod followed the link). A link is refused with a
    log line and replaced by the table; a file that is not a valid table keeps its mode."""
    require_root()
    dataset = _dataset(tmp_path / "ds")
    secret, hard = tmp_path / "secret", tmp_path / "secret2"
    for path in (secret, hard):
        path.write_bytes(b"password\n")
        path.chmod(0o600)
    beside = dataset / BESIDE_DATASET
    beside.mkdir()
    _nobodys(beside, 0o755)
    (beside / "0.table").symlink_to(secret)
    _nobodys(beside / "0.table")
    os.link(hard, beside / "1.table")
    result = atlasfs("index", str(dataset), env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert result.returncode == 0, result.stderr
    for path in (secret, hard):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.read_bytes() == b"password\n", path
    assert not (beside / "0.table").is_symlink()
    assert stat.S_IMODE((beside / "0.table").stat().st_mode) == 0o644
    tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset)))
    tree.names("/0")
    tree.names("/1")
    assert tree.cache.misses == 0  # the tables stored are used


def test_atlasfs_index_never_writes_through_a_linked_table_folder(tmp_path: Path) -> None:
    """``.atlasfs-tables -> elsewhere`` (made by whoever owns the dataset): `atlasfs index`, run
    by root, wrote its tables into the folder the link names. The link is never followed: each
    table is one line naming the folder, exit 1, and nothing is written there."""
    require_root()
    dataset = _dataset(tmp_path / "ds")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (dataset / BESIDE_DATASET).symlink_to(elsewhere)
    result = atlasfs("index", str(dataset), env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")})
    assert result.returncode == 1, result.stderr
    assert list(elsewhere.iterdir()) == []
    assert "Traceback" not in result.stderr
    assert "is a symbolic link (never followed)" in result.stderr, result.stderr


def test_a_mount_waits_for_no_fifo_put_in_place_of_a_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A FIFO in place of a table: opened without blocking, refused as no regular file."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    dataset = _dataset(tmp_path / "ds")
    tables = tmp_path / "tables"
    tables.mkdir()
    os.mkfifo(tables / "0.table")
    started = time.monotonic()
    with caplog.at_level(logging.INFO, logger="atlasfs"):
        tree = BlockTree(AtlasDataset(dataset), store=TableStore(str(dataset), index_dir=str(tables)))
        tree.names("/0")
    assert time.monotonic() - started < 30
    lines = [r.getMessage() for r in caplog.records if "ignoring the stored file table" in r.getMessage()]
    assert len(lines) == 1 and "is not a regular file" in lines[0], lines
