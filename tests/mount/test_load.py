"""Load: 16 concurrent readers (tar of shards, random reads, find, ls -lR) on a mount whose
dataset is larger than its block cache. 0 wrong bytes, 0 errors, bounded daemon memory.

Runs ATLASFS_LOAD_SECONDS (default 10; the reliability figures in docs/reliability.md come
from a 60-second run: ``ATLASFS_LOAD_SECONDS=60 make test PYTEST_ARGS=tests/mount/test_load.py``).
"""

from __future__ import annotations

import io
import os
import random
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.tree.blocktree import BlockTree
from fusemount import force_unmount, is_mounted, require_fuse

SECONDS = float(os.environ.get("ATLASFS_LOAD_SECONDS", "10"))
CACHE = 4 << 20
#: What the daemon may use beyond its cache: the interpreter, numpy, zstd, file
#: tables of a few thousand files, and blocks being decoded by its threads.
OVERHEAD = 100 << 20


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_sixteen_readers_get_correct_bytes_within_the_memory_bound(tmp_path: Path) -> None:
    require_fuse()
    rng = random.Random(7)
    dataset = tmp_path / "ds"
    with AtlasWriter(dataset, shard_size=500, block_size=8, compression_strategy=1) as writer:
        for i in range(2000):  # ~32 MB of incompressible bytes: 8x the cache
            writer.add_example({"__key__": f"d{i % 7}/s{i:05d}", "bin": rng.randbytes(16 << 10), "cls": i,
                                "json": {"i": i, "tag": "x" * (i % 30)}})
    expected: dict[str, bytes] = {}
    tree = BlockTree(AtlasDataset(dataset))
    for path, entry in tree.walk("/"):
        expected[path] = tree.read(entry, 0, entry.size)
    shards = sorted({p.split("/")[0] for p in expected})
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    daemon = subprocess.Popen([sys.executable, "-m", "atlasfs", "mount", "-f", str(dataset), str(mnt),
                               "-o", f"cache_size={CACHE}"], stderr=subprocess.PIPE, text=True)
    errors: list[str] = []
    wrong: list[str] = []
    counts = {"tar": 0, "cat": 0, "find": 0, "ls": 0}
    lock = threading.Lock()
    deadline = time.monotonic() + SECONDS

    def note(kind: str) -> None:
        with lock:
            counts[kind] += 1

    def tar_worker(n: int) -> None:
        while time.monotonic() < deadline:
            shard = shards[n % len(shards)]
            result = subprocess.run(["tar", "cf", "-", "-C", str(mnt / shard), "."], capture_output=True)
            if result.returncode != 0:
                errors.append(f"tar {shard}: {result.stderr[-200:]!r}")
                continue
            with tarfile.open(fileobj=io.BytesIO(result.stdout)) as archive:
                for member in archive:
                    if member.isfile():
                        path = f"{shard}/{member.name.removeprefix('./')}"
                        if archive.extractfile(member).read() != expected.get(path):
                            wrong.append(path)
            note("tar")

    def cat_worker(n: int) -> None:
        local = random.Random(n)
        paths = list(expected)
        while time.monotonic() < deadline:
            path = local.choice(paths)
            try:
                with open(mnt / path, "rb") as f:
                    if f.read() != expected[path]:
                        wrong.append(path)
            except OSError as exc:
                errors.append(f"read {path}: {exc}")
            note("cat")

    def find_worker(n: int) -> None:
        while time.monotonic() < deadline:
            result = subprocess.run(["find", str(mnt), "-type", "f"], capture_output=True, text=True)
            if result.returncode != 0 or len(result.stdout.splitlines()) != len(expected):
                errors.append(f"find: {result.returncode} {result.stderr[-200:]}")
            note("find")

    def ls_worker(n: int) -> None:
        while time.monotonic() < deadline:
            result = subprocess.run(["ls", "-lR", str(mnt)], capture_output=True, text=True)
            if result.returncode != 0 or sum(line.startswith("-") for line in result.stdout.splitlines()) != len(expected):
                errors.append(f"ls: {result.returncode} {result.stderr[-200:]}")
            note("ls")

    try:
        start = time.monotonic() + 30
        while not (is_mounted(mnt) and os.listdir(mnt)):
            assert daemon.poll() is None and time.monotonic() < start, daemon.stderr.read()
            time.sleep(0.05)
        deadline = time.monotonic() + SECONDS
        workers = ([threading.Thread(target=tar_worker, args=(i,)) for i in range(4)]
                   + [threading.Thread(target=cat_worker, args=(i,)) for i in range(8)]
                   + [threading.Thread(target=find_worker, args=(i,)) for i in range(2)]
                   + [threading.Thread(target=ls_worker, args=(i,)) for i in range(2)])
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        peak = _peak_rss(daemon.pid)
        print(f"\nload {SECONDS:.0f}s: {counts}, daemon peak RSS {peak / 2**20:.1f} MiB "
              f"(cache bound {CACHE / 2**20:.0f} MiB)")
        assert errors == []
        assert wrong == []
        assert all(counts.values()), counts
        assert peak <= CACHE + OVERHEAD, peak
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=20)
        finally:
            if daemon.poll() is None:
                daemon.kill()
            force_unmount(mnt)
            if errors or wrong:  # the daemon's log says why (shown with the failure)
                print("daemon log (end):\n" + daemon.stderr.read()[-6000:])
