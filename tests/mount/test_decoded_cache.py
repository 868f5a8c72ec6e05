"""The decoded-block cache on local disk (``atlasfs mount --decoded-cache DIR``, issue #39 point 2):
a block's frame decompressed once is written to a file in DIR, and later reads of its files, in
the same mount or a later one, ``pread`` it instead of decompressing again. Real mounts, real
readers: the bytes are ``atlasfs export``'s, the decompressions are the engine's own counts (its
last log lines), a corrupt or truncated file is never served, a DIR that is not the user's own
is refused, and the files stay within the bound."""

from __future__ import annotations

import os
import random
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fusemount import DAEMON_OVERHEAD, atlasfs, engine_answered_in_log, mounted, proc_status
from locateddata import Exported, export_shards, index_tables, write_dataset

EXAMPLES_PER_BLOCK = 4
MIB = 1 << 20


def random_examples(seed: int, n: int) -> list[dict[str, Any]]:
    """Random bytes (stored raw by zstd) between compressible text (compressed zstd blocks):
    a block of 4 is ~1.7 MB decompressed, and a file of it needs its frame decompressed."""
    rng = np.random.default_rng(seed)
    return [{"pad": rng.bytes(140_000), "bin": rng.bytes(100_000 + 100 * i), "pad2": rng.bytes(140_000),
             "txt": "".join(rng.choice(list("abcd "), 64_000)) + str(i)} for i in range(n)]


def _dataset(tmp_path: Path, blocks: int, strategy: int = 2) -> tuple[Path, Exported]:
    dataset = write_dataset(tmp_path / "ds", random_examples(3, EXAMPLES_PER_BLOCK * blocks), strategy,
                     block_size=EXAMPLES_PER_BLOCK)
    exported = export_shards(dataset, tmp_path / "export")
    index_tables(dataset, tmp_path / "tables")
    return dataset, exported


def _mount_args(tmp_path: Path, log: Path, folder: Path, *more: str) -> list[str]:
    # A byte cache too small to keep a block (C's half: 512 KiB): without the decoded cache every
    # read of a block's compressed part decompresses its frame again.
    return ["--cache-size", "1M", "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}",
            "--decoded-cache", str(folder), *more]


def _read_pass(mnt: Path, exported: Exported, readers: int, seed: int) -> list[str]:
    """Every file read whole by ``readers`` threads, each in its own shuffled order, its pages
    dropped from the kernel's cache after each read (so that the next pass asks the daemon
    again); the files whose bytes differ."""
    files = [(shard, name) for shard, names in exported.items() for name in names]
    errors: list[str] = []

    def reader(k: int) -> None:
        order = files[:]
        random.Random(seed * 100 + k).shuffle(order)
        for shard, name in order:
            fd = os.open(mnt / shard / name, os.O_RDONLY)
            try:
                data = b""
                while chunk := os.read(fd, 1 << 20):
                    data += chunk
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            if data != exported[shard][name]:
                errors.append(f"{shard}/{name}")

    threads = [threading.Thread(target=reader, args=(k,)) for k in range(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return errors


def _counts(log: Path) -> tuple[dict[str, int], dict[str, int]]:
    """The last mount's frames decompressed (whole, in part) and its decoded cache's counts."""
    answered = engine_answered_in_log(log)  # waits for the engine's line; the decoded cache's comes after it
    assert answered["read"][1] == 0 and answered["located"][1] == 0, answered
    deadline = time.monotonic() + 20
    while True:
        text = log.read_text()
        found = re.findall(r"decoded cache: (\d+) hits, (\d+) misses, (\d+) written, (\d+) failed to write, "
                           r"(\d+) bad, (\d+) evicted, (\d+) found at start, (\d+) ignored; (\d+) bytes of (\d+)", text)
        if found or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert found, text
    frames = re.findall(r"frames decompressed: (\d+) whole, (\d+) in part", text)[-1]
    names = ("hits", "misses", "written", "write_failed", "bad", "evicted", "found", "ignored", "bytes", "bound")
    counts = dict(zip(("whole", "partial"), map(int, frames))), dict(zip(names, map(int, found[-1])))
    print(log.name, *counts)
    return counts


def _filled(tmp_path: Path, blocks: int = 3) -> tuple[Path, Exported, Path]:
    """A dataset of ``blocks`` blocks and a decoded cache folder one pass wrote each block to."""
    dataset, exported = _dataset(tmp_path, blocks)
    folder = tmp_path / "decoded"
    with mounted(dataset, *_mount_args(tmp_path, tmp_path / "daemon.log", folder)) as mnt:
        assert _read_pass(mnt, exported, 1, 1) == []
    return dataset, exported, folder


def _mounted_again(tmp_path: Path, dataset: Path, exported: Exported, folder: Path) -> tuple[dict[str, int],
                                                                                               dict[str, int]]:
    """A second mount over ``folder``, a pass by 2 readers with exact bytes: its counts (:func:`_counts`)."""
    log = tmp_path / "daemon2.log"
    with mounted(dataset, *_mount_args(tmp_path, log, folder)) as mnt:
        assert _read_pass(mnt, exported, 2, 2) == []
    return _counts(log)


def _block_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(".blk"))


@pytest.mark.parametrize("strategy", [1, 2])
def test_a_block_is_decompressed_once_over_two_shuffled_passes_and_mounts(tmp_path: Path, strategy: int) -> None:
    """4 readers, two shuffled passes in one mount whose byte cache keeps no block: each frame
    decompressed once in all (without the decoded cache, once for nearly every compressed file
    read); then a new mount over the same folder decompresses nothing."""
    blocks = 3
    dataset, exported = _dataset(tmp_path, blocks, strategy)
    folder = tmp_path / "decoded"
    log = tmp_path / "daemon.log"
    with mounted(dataset, *_mount_args(tmp_path, log, folder)) as mnt:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # made, the user's alone
        assert _read_pass(mnt, exported, 4, 1) == []
        assert _read_pass(mnt, exported, 4, 2) == []
    frames, decoded = _counts(log)
    assert frames == {"whole": blocks, "partial": 0}, (frames, decoded)
    assert decoded["written"] == blocks and decoded["hits"] > 0 and decoded["bad"] == 0, decoded
    files = _block_files(folder)
    assert len(files) == blocks and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    assert not [p for p in folder.iterdir() if p.name.startswith(".tmp-")]

    log2 = tmp_path / "daemon2.log"
    with mounted(dataset, *_mount_args(tmp_path, log2, folder)) as mnt:
        assert _read_pass(mnt, exported, 2, 3) == []
    frames, decoded = _counts(log2)
    assert frames == {"whole": 0, "partial": 0}, (frames, decoded)
    assert decoded["found"] == blocks and decoded["written"] == 0 and decoded["hits"] > 0, decoded


def test_without_the_decoded_cache_the_same_passes_decompress_again(tmp_path: Path) -> None:
    """The control: the same two passes with no decoded cache decompress frames again (the test
    above would pass vacuously otherwise)."""
    dataset, exported = _dataset(tmp_path, 3)
    log = tmp_path / "daemon.log"
    with mounted(dataset, "--cache-size", "1M", "-o", f"log_file={log}",
                 "-o", f"index_dir={tmp_path / 'tables'}") as mnt:
        assert _read_pass(mnt, exported, 4, 1) == []
        assert _read_pass(mnt, exported, 4, 2) == []
    engine_answered_in_log(log)
    frames = re.findall(r"frames decompressed: (\d+) whole, (\d+) in part", log.read_text())[-1]
    assert int(frames[0]) + int(frames[1]) > 2 * 3, frames


def test_corrupt_and_truncated_files_are_never_served(tmp_path: Path) -> None:
    """A file with bytes flipped throughout and one cut short: detected (the size, the CRC-32
    of every run read), dropped, the block decompressed and written again; every byte served
    is the data's."""
    dataset, exported, folder = _filled(tmp_path)
    flipped, cut, kept = _block_files(folder)
    sizes = [p.stat().st_size for p in (flipped, cut, kept)]
    data = bytearray(flipped.read_bytes())
    for i in range(0, len(data), 1000):  # every run of the block covers a flipped byte
        data[i] ^= 0xFF
    flipped.write_bytes(bytes(data))
    with open(cut, "r+b") as f:
        f.truncate(cut.stat().st_size // 2)
    frames, decoded = _mounted_again(tmp_path, dataset, exported, folder)
    assert decoded["bad"] == 2 and decoded["written"] == 2, decoded
    assert frames["whole"] == 2, frames  # the two dropped blocks, once each; the third read from disk
    assert [p.stat().st_size for p in (flipped, cut, kept)] == sizes  # written whole again
    assert flipped.read_bytes() != bytes(data)


def test_a_pass_over_more_than_the_bound_stays_within_it(tmp_path: Path) -> None:
    """6 blocks of ~1.7 MB through a bound of 8 MiB (fstab's -o names): the least recently
    used go, the files under DIR never total more than the bound, the bytes stay right, and the
    daemon stays within its memory bound (the files are the page cache's, not its heap)."""
    blocks = 6
    dataset, exported = _dataset(tmp_path, blocks)
    folder = tmp_path / "decoded"
    (folder).mkdir(mode=0o700)
    (folder / "notes.txt").write_text("mine")  # not the cache's: never touched
    log = tmp_path / "daemon.log"
    with mounted(dataset, "--cache-size", "1M", "-o", f"log_file={log}", "-o", f"index_dir={tmp_path / 'tables'}",
                 "-o", f"decoded_cache={folder},decoded_cache_size=8M") as mnt:
        assert _read_pass(mnt, exported, 2, 1) == []
        total = sum(p.stat().st_size for p in folder.iterdir())
        pid = int(re.search(r"atlasfs\[(\d+)\]: mounted", log.read_text()).group(1))  # type: ignore[union-attr]
        peak = proc_status(pid, "VmHWM")
    frames, decoded = _counts(log)
    assert decoded["bound"] == 8 * MIB and decoded["evicted"] >= 1, decoded
    assert total <= 8 * MIB and decoded["bytes"] <= 8 * MIB, (total, decoded)
    assert sum(p.stat().st_size for p in _block_files(folder)) <= 8 * MIB
    assert (folder / "notes.txt").read_text() == "mine"
    if not os.environ.get("ATLASFS_TEST_SANITIZED"):  # ASan's shadow memory is no measure of the engine's
        assert peak <= 1 * MIB + DAEMON_OVERHEAD, f"peak RSS {peak / MIB:.0f} MiB"
    # A later mount with a smaller bound trims what it finds at start.
    log2 = tmp_path / "daemon2.log"
    with mounted(dataset, *_mount_args(tmp_path, log2, folder, "--decoded-cache-size", "4M")):
        pass
    _, decoded = _counts(log2)
    assert sum(p.stat().st_size for p in _block_files(folder)) <= 4 * MIB, decoded
    assert (folder / "notes.txt").read_text() == "mine"


def _refused(tmp_path: Path, folder: Path) -> str:
    dataset = tmp_path / "ds"
    mnt = tmp_path / "mnt"
    mnt.mkdir(exist_ok=True)
    result = atlasfs("mount", str(dataset), str(mnt), "--decoded-cache", str(folder))
    assert result.returncode != 0, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_a_folder_that_is_not_the_users_own_is_refused(tmp_path: Path) -> None:
    """A symbolic link, a file, another user's folder, a folder others can write: the mount is
    refused in one line naming the folder and why; nothing is written there."""
    write_dataset(tmp_path / "ds", random_examples(3, 4), 2, block_size=4)
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    assert "is a symbolic link" in _refused(tmp_path, link)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert "is not a folder" in _refused(tmp_path, a_file)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert "can be written by other users (mode 0777)" in _refused(tmp_path, shared)
    if os.geteuid() == 0:  # root can give a folder away
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
        assert "is owned by uid 65534" in _refused(tmp_path, theirs)
    assert os.listdir(real) == [] and os.listdir(shared) == []
    assert "decoded_cache_size= bounds decoded_cache=DIR" in \
        atlasfs("mount", str(tmp_path / "ds"), str(tmp_path / "mnt"), "--decoded-cache-size", "1G").stderr


def test_a_fifo_or_link_named_as_a_cache_file_is_ignored(tmp_path: Path) -> None:
    """A FIFO and a symbolic link (to a file of the user's) put in place of two cache files:
    never opened, waited on or counted; their blocks decompressed again and written in their
    place; the link's target untouched."""
    dataset, exported, folder = _filled(tmp_path)
    fifo, link, _ = _block_files(folder)
    fifo.unlink()
    os.mkfifo(fifo)
    secret = tmp_path / "secret"
    secret.write_bytes(link.read_bytes())  # the right bytes even: a link is still never followed
    link.unlink()
    link.symlink_to(secret)
    frames, decoded = _mounted_again(tmp_path, dataset, exported, folder)
    assert decoded["ignored"] == 2 and decoded["found"] == 1 and decoded["written"] == 2, decoded
    assert frames["whole"] == 2, frames
    assert stat.S_ISREG(fifo.lstat().st_mode) and stat.S_ISREG(link.lstat().st_mode)
    assert secret.read_bytes() == link.read_bytes()
