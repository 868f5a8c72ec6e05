"""Small files of strategy-0 blocks past 256 KiB through a mount: the engine answers them in C
with exact bytes (each block's stored CRC-32 read once and remembered), and a block changed
afterwards, data.bin's size and mtime kept, is never served from the table: its files read
as the block now is, or fail with EIO (the control plane alone:
tests/unit/tree/test_located_big_blocks.py)."""

from __future__ import annotations

import random
from pathlib import Path

from bigblocks import CHANGED_URL, URL, block_of, damage, small_files, wait_unchanged_for, write_big_blocks
from fusemount import engine_answered_in_log, mounted
from helpers import in_threads
from locateddata import export_shards, index_tables

#: Blocks :func:`damage` changes (1: read at once, 3: read once data.bin's ctime is old enough
#: for a fingerprint to be remembered again) and breaks.
CHANGED_NOW, CHANGED_LATER, BROKEN = 1, 3, 2


def test_small_files_of_big_blocks_are_answered_in_c_and_never_stale(tmp_path: Path) -> None:
    dataset = write_big_blocks(tmp_path / "ds", n=40)
    data_bin = dataset / "0" / "data.bin"
    exported = export_shards(dataset, tmp_path / "export")["0"]
    tables = tmp_path / "tables"
    index_tables(dataset, tables)
    names = small_files(exported)
    wait_unchanged_for(data_bin, 2.1)  # the engine remembers fingerprints now
    log = tmp_path / "mount.log"
    errors: list[str] = []

    def expected(name: str) -> bytes | None:
        block = block_of(name)
        if block == BROKEN:
            return None  # EIO: the block no longer decodes
        return exported[name].replace(URL, CHANGED_URL) if block in (CHANGED_NOW, CHANGED_LATER) else exported[name]

    def read(mnt: Path, name: str) -> None:
        try:
            got: bytes | None = (mnt / "0" / name).read_bytes()
        except OSError:
            got = None
        if got != expected(name):
            errors.append(f"{name}: {got!r}, not {expected(name)!r}")

    with mounted(dataset, "-o", f"log_file={log}", "-o", f"index_dir={tables}") as mnt:
        # Every .cls, by 3 readers at once each in its own order: each block's fingerprint read
        # and remembered (threads racing to make the shard's array of them).
        def reader(seed: int) -> None:
            order = [name for name in names if name.endswith(".cls")]
            random.Random(seed).shuffle(order)
            for name in order:
                try:
                    if (mnt / "0" / name).read_bytes() != exported[name]:
                        errors.append(name)
                except OSError as exc:
                    errors.append(f"{name}: {exc}")

        in_threads(reader, 3)
        assert errors == []
        damage(dataset, changed=(CHANGED_NOW, CHANGED_LATER), broken=BROKEN)
        # The .json files now (none read before: nothing of them in the kernel's page cache).
        json = [name for name in names if name.endswith(".json")]
        random.Random(4).shuffle(json)
        for name in json:
            if block_of(name) == CHANGED_NOW:  # data.bin changed a moment ago: nothing remembered
                read(mnt, name)
        wait_unchanged_for(data_bin, 2.1)  # remembered again, under data.bin's new identity
        for name in json:
            if block_of(name) != CHANGED_NOW:
                read(mnt, name)
    assert errors == []
    answered = engine_answered_in_log(log)
    unchanged = sum(1 for name in names if block_of(name) not in (CHANGED_NOW, CHANGED_LATER, BROKEN))
    cls = sum(1 for name in names if name.endswith(".cls"))
    # Every small file of an unchanged block answered in C (a .cls read again may come from the
    # kernel's page cache), and C gave up once on each changed block.
    assert answered["located"][0] >= cls + unchanged // 2 and answered["located"][1] == 3, answered
