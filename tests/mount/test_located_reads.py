"""Located reads through a real mount (issue #18): the mount serves the exported bytes to
random readers, the engine reads located files in C, locators and kept files that lie are left
to the control plane, a byte changed in place is never served stale, and tables read from
their files answer over more tables than the tree holds (the tree alone:
tests/unit/tree/test_located.py)."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlasfs.tree.table.layout import INLINE, KEPT, NO_LOCATOR
from fusemount import atlasfs, engine_answered_in_log, mounted, wait_mounted
from helpers import REFERENCE, in_threads
from locateddata import (
    export_shards,
    forged_table,
    index_tables,
    random_examples,
    read_through,
    stored_table,
    write_dataset,
)


def test_a_byte_changed_in_place_is_never_served_stale_through_a_mount(tmp_path: Path) -> None:
    """Strategy 0, a byte of an image flipped in data.bin with its size and mtime kept: the
    stored table still matches the shard's signature, the mount must serve the new bytes."""
    dataset = write_dataset(tmp_path / "ds", random_examples(3), 0, shard_size=12)
    assert atlasfs("index", str(dataset)).returncode == 0
    data_bin = dataset / "0" / "data.bin" if (dataset / "0").is_dir() else next(dataset.glob("*/data.bin"))
    stat = os.stat(data_bin)
    blob = bytearray(data_bin.read_bytes())
    jpg = random_examples(3)[5]["jpg"]
    at = bytes(blob).find(jpg)
    assert at > 0
    blob[at + 100] ^= 0xFF
    data_bin.write_bytes(bytes(blob))
    os.utime(data_bin, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    exported = export_shards(dataset, tmp_path / "export")  # the bytes the dataset holds now
    names = [(shard, name) for shard, files in exported.items() for name in files]
    random.Random(1).shuffle(names)
    with mounted(dataset) as mnt:
        for shard, name in names:
            assert (mnt / shard / name).read_bytes() == exported[shard][name], name


def test_a_mount_serves_the_exported_bytes_to_random_readers(tmp_path: Path) -> None:
    dataset = Path(shutil.copytree(REFERENCE / "s2_shared_dict" / "dataset", tmp_path / "s2"))
    exported = export_shards(dataset, tmp_path / "export")
    assert atlasfs("index", str(dataset)).returncode == 0  # tables with locators, beside the dataset
    files = [(shard, name) for shard, names in exported.items() for name in names]
    errors: list[str] = []
    with mounted(dataset) as mnt:
        def reader(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(150):
                shard, name = rng.choice(files)
                with open(mnt / shard / name, "rb", buffering=0) as f:
                    got = f.read()
                if got != exported[shard][name]:
                    errors.append(f"{shard}/{name}")

        in_threads(reader, 6)
    assert errors == []


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
@pytest.mark.parametrize("images", [False, True])
def test_the_engine_reads_located_files_in_c_with_the_exported_bytes(tmp_path: Path, strategy: int,
                                                                      images: bool) -> None:
    """Every kind of locator (runs with and without a prefix, inline and kept files) of every
    compression strategy, read by parallel readers: C answers them where their bytes lie.
    With images (300 KB of random bytes: zstd stores them raw), each read whole takes its
    run alone, without decompressing its block."""
    examples = random_examples(7, 48)
    if images:
        rng = np.random.default_rng(8)
        examples = [{**example, "jpg": rng.bytes(300_000)} for example in examples[:12]]
    dataset = write_dataset(tmp_path / "ds", examples, strategy, block_size=4, shard_size=24 if not images else 6)
    exported = export_shards(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    log = tmp_path / "daemon.log"
    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        assert read_through(mnt, exported) == []
    answered = engine_answered_in_log(log)
    assert answered["located"][1] == 0, answered  # no located read failed its checks
    if images:
        # The images whole, each in one request: the run alone (stored raw by zstd, or with no
        # compression). Strategy 0's small files have no locator here (blocks of 1.2 MB have no
        # fingerprint): random readers have them read by the control plane, from the block.
        assert answered["stored"][0] >= 12, answered
    else:
        files = sum(len(names) for names in exported.values())  # every one located: its json is small, inline
        assert answered["located"][0] >= files and answered["read"][1] == 0, answered  # none asked Python


def test_locators_that_lie_are_left_to_the_control_plane_which_serves_the_right_bytes(tmp_path: Path) -> None:
    """A stored table whose runs point one byte off, with checks that do not match: C serves
    none of them (its CRC-32 check), the control plane reads each through its block."""
    path, key, _, table = stored_table(tmp_path)
    assert table.locators is not None
    runs = (table.locators.offset != NO_LOCATOR) & (table.locators.prefix != INLINE)

    def shift(offsets: np.ndarray) -> None:
        offsets[runs] = offsets[runs] + 1

    forged_table(table, offset=shift).save(str(path), key)  # the checks are the true runs': they fail one byte off
    dataset = tmp_path / "ds"
    exported = export_shards(dataset, tmp_path / "export")
    log = tmp_path / "daemon.log"
    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        assert read_through(mnt, {"0": exported["0"]}, readers=2) == []
    located_in_c, left_to_python = engine_answered_in_log(log)["located"]
    assert left_to_python > 0
    small = int(np.isin(table.locators.prefix, [INLINE, KEPT]).sum())
    assert located_in_c <= 2 * small  # only the inline and kept files, untouched, may still be read in C


@pytest.mark.parametrize("lie", ["frames", "offsets"])
def test_kept_files_that_lie_are_left_to_the_control_plane_which_serves_the_right_bytes(tmp_path: Path,
                                                                                       lie: str) -> None:
    """A stored table whose kept frames are damaged (a byte flipped in each), or whose kept
    files point one byte off: C serves none that does not check out, the control plane reads
    those through their block, with the exported bytes."""
    path, key, _, table = stored_table(tmp_path)
    assert table.locators is not None
    kept = table.locators.prefix == KEPT
    ends = table.locators.kept_ends.tolist()
    assert kept.any() and ends

    def flip(frames: bytes) -> bytes:
        damaged = bytearray(frames)
        for start, end in zip([0] + ends, ends):
            damaged[(start + end) // 2] ^= 0x55
        return bytes(damaged)

    def shift(offsets: np.ndarray) -> None:
        offsets[kept] = offsets[kept] + 1

    forged_table(table, **({"kept": flip} if lie == "frames" else {"offset": shift})).save(str(path), key)
    dataset = tmp_path / "ds"
    exported = export_shards(dataset, tmp_path / "export")
    names = {name for i, name in enumerate(map(table.entry_path, range(len(table)))) if kept[i]}
    log = tmp_path / "daemon.log"
    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        assert read_through(mnt, {"0": {name: exported["0"][name] for name in names}}, readers=2) == []
    located_in_c, left_to_python = engine_answered_in_log(log)["located"]
    assert left_to_python > 0
    if lie == "offsets":
        assert located_in_c == 0  # a flipped byte may spare a frame's other file: that one still checks out


@pytest.mark.parametrize("strategy", [0, 2])
def test_files_read_in_pieces_from_their_middle_are_read_alone_and_kept(tmp_path: Path, strategy: int) -> None:
    """A read that is not the whole file (the kernel's read-ahead pieces) takes the file's run
    alone, checks it whole and keeps it for the next pieces: bytes as exported, none asked
    Python, no block decompressed for it."""
    rng = np.random.default_rng(9)
    examples = [{"jpg": rng.bytes(700_000 + 1000 * i), "cls": i} for i in range(8)]
    dataset = write_dataset(tmp_path / "ds", examples, strategy, block_size=4)
    exported = export_shards(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    log = tmp_path / "daemon.log"
    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        for shard, names in exported.items():
            for name, data in names.items():
                if not name.endswith(".jpg"):
                    continue
                fd = os.open(mnt / shard / name, os.O_RDONLY)
                try:
                    middle = len(data) // 2
                    assert os.pread(fd, 4096, middle) == data[middle:middle + 4096], name
                    got = b"".join(iter(lambda: os.read(fd, 65536), b""))
                finally:
                    os.close(fd)
                assert got == data, name
    answered = engine_answered_in_log(log)
    assert answered["read"][1] == 0 and answered["located"][1] == 0, answered
    assert answered["stored"][0] >= 8 and answered["stored"][1] == 0, answered


_FOREGROUND = """
import sys
from atlasfs.commands import cli
from atlasfs.fuse import attachments
from atlasfs.tree.table import tables
tables.RESIDENT_TABLE_BYTES = 1  # the tree holds one table at a time
attachments.FILE_TABLES_MAX = int(sys.argv[1])
sys.exit(cli.main(["mount", "-f", sys.argv[2], sys.argv[3], "-o", "log_file=" + sys.argv[4]]))
"""


def _mount_holding_one_table(dataset: Path, mnt: Path, log: Path, file_tables: int) -> Any:
    """A foreground daemon whose tree holds one table at a time, and whose engine reads at most
    ``file_tables`` tables from their files."""
    process = subprocess.Popen([sys.executable, "-c", _FOREGROUND, str(file_tables), str(dataset), str(mnt), str(log)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_mounted(process, mnt)
    return process


@pytest.mark.parametrize("file_tables", [0, 64])
def test_tables_read_from_their_files_answer_random_readers_over_more_tables_than_the_tree_holds(
        tmp_path: Path, file_tables: int) -> None:
    """The tree holds one table at a time here, and random readers go through 6 shards: a
    table attached from its mapped columns is let go with its map, so lookups and reads of
    the other shards are the control plane's (file_tables 0: the test can fail); a table
    read from its file (pread: no memory held) stays attached, and C answers nearly all."""
    dataset = write_dataset(tmp_path / "ds", random_examples(6, 144), 2, block_size=3, shard_size=24)  # listings of 144; 8 blocks a shard: a dictionary
    exported = export_shards(dataset, tmp_path / "export")
    index_tables(dataset, dataset / ".atlasfs-tables")  # where a mount finds them
    mnt, log = tmp_path / "mnt", tmp_path / "daemon.log"
    mnt.mkdir()
    process = _mount_holding_one_table(dataset, mnt, log, file_tables)
    try:
        assert read_through(mnt, exported, readers=4) == []
        for shard, names in exported.items():  # listed from the tables (in windows of rows, read from the files)
            assert os.listdir(mnt / shard) == list(names)
            assert {p.name: p.stat().st_size for p in (mnt / shard).iterdir()} == {n: len(d) for n, d in names.items()}
    finally:
        subprocess.run(["fusermount3", "-u", str(mnt)], check=False)
        process.wait(timeout=30)
    answered = engine_answered_in_log(log)
    files = sum(len(names) for names in exported.values())
    if file_tables:
        # Python: each shard's folder, and what the 4 readers asked of a shard before its table
        # was attached (at most one request each).
        shards = len(exported)
        assert answered["lookup"][1] <= 5 * shards and answered["read"][1] <= 4 * shards, answered
        assert answered["located"][0] >= files - 4 * shards
        # The 6 shards' located reads share the dataset's one zstd dictionary.
        assert "zstd dictionaries held: 1" in log.read_text()
    else:
        # Python answers each shard's requests whenever its table is not the one held: more than
        # the file-table case above allows (5 a shard). How many more depends on how the 4
        # readers interleave (42-80 in runs of 2026-11-28; 10 a shard failed now and then).
        assert answered["lookup"][1] > 5 * len(exported) and answered["read"][1] > 0, answered
