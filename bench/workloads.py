"""The workloads: the same commands on every system's view of a dataset, timed from outside.

Shell workloads run GNU tools in a subprocess (``tar``, ``find``, ``ls``, ``du``), as a user
would. Random reads run in this process with ``open().read()``: a subprocess ``cat`` per file
would add about a millisecond of fork and exec to every figure and hide the file system.
In-process workloads (``atlasfs export``, a loop over ``AtlasDataset``, one shard's decode) are
the limits atlasfs itself can reach without FUSE.
"""

from __future__ import annotations

import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass

from .harness import Timed, timed
from .systems import View


class WorkloadError(Exception):
    """A command failed or gave a wrong answer: its figure is not reported."""


def _shell(script: str, *args: str) -> Timed:
    run = timed(lambda: subprocess.run(["bash", "-c", "set -o pipefail\n" + script, "bench", *args],
                                       capture_output=True, text=True))
    result = run.answer
    if result.returncode != 0:
        raise WorkloadError(f"{script.strip().splitlines()[0]} ... exited {result.returncode}: "
                            f"{result.stderr.strip()[-300:]}")
    return Timed(run.seconds, result.stdout.strip())


def tar_all(view: View, shards: list[str]) -> Timed:
    """``tar cf - -C <shard> . | wc -c`` for every shard in turn; answers the total tar bytes."""
    timed = _shell('for d in "$@"; do tar cf - -C "$d" . | wc -c || exit 1; done',
                   *(view.shard_dirs[s] for s in shards))
    timed.answer = sum(int(line) for line in str(timed.answer).split())
    return timed


def find_files(view: View) -> Timed:
    """``find <root> -type f | wc -l``; answers the count."""
    timed = _shell('find "$1" -type f | wc -l', view.root)
    timed.answer = int(str(timed.answer))
    return timed


def ls_recursive(view: View) -> Timed:
    """``ls -lR <root> | wc -l``; answers the line count."""
    timed = _shell('ls -lR "$1" | wc -l', view.root)
    timed.answer = int(str(timed.answer))
    return timed


def du_bytes(view: View) -> Timed:
    """``du -sb <root>``; answers the byte count (which includes folders' own sizes, so it differs
    between systems by a few KiB)."""
    timed = _shell('du -sb "$1"', view.root)
    timed.answer = int(str(timed.answer).split()[0])
    return timed


def list_shard(view: View, shard: str) -> Timed:
    """``ls <shard folder> | wc -l``: the first listing of a shard right after mounting."""
    timed = _shell('ls "$1" | wc -l', view.shard_dirs[shard])
    timed.answer = int(str(timed.answer))
    return timed


@dataclass
class Reads:
    """Per-file latencies of a random-read pass, and a checksum of everything read."""

    latencies: list[float]
    seconds: float
    nbytes: int
    checksum: int

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile of the latencies, in seconds (nearest rank)."""
        ordered = sorted(self.latencies)
        rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
        return ordered[rank]


def random_reads(view: View, relative_paths: list[str]) -> Reads:
    """Open, read to the end and close each file in turn, in this process; time each file."""
    latencies = []
    checksum = 0
    nbytes = 0
    clock = time.perf_counter
    paths = [view.path(p) for p in relative_paths]
    start = clock()
    for path in paths:
        t0 = clock()
        with open(path, "rb", buffering=0) as f:
            chunks = []
            while True:
                chunk = f.read(1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        latencies.append(clock() - t0)
        data = b"".join(chunks)
        nbytes += len(data)
        checksum = zlib.crc32(data, checksum)
    return Reads(latencies, clock() - start, nbytes, checksum)


def parallel_reads(view: View, relative_paths: list[str], readers: int) -> Timed:
    """``readers`` processes at once (``xargs cat``), each reading its share of the files (every
    ``readers``-th, in the order given) to the end; answers each reader's ``cksum`` of what it
    read (the same files in the same order must give the same answer on every system)."""
    with tempfile.TemporaryDirectory(prefix="atlasfs-bench-readers-") as lists:
        commands = []
        for i in range(readers):
            listing = os.path.join(lists, f"{i}.list")
            with open(listing, "wb") as f:
                f.write(b"\0".join(os.fsencode(view.path(p)) for p in relative_paths[i::readers]))
            commands.append(["bash", "-c", 'set -o pipefail; xargs -0 -a "$1" cat | cksum', "reader", listing])

        def run() -> list[subprocess.CompletedProcess[bytes]]:
            processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                         for command in commands]
            done = []
            for process in processes:
                out, err = process.communicate()
                done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
            return done

        result = timed(run)
    failed = [r for r in result.answer if r.returncode]
    if failed:
        raise WorkloadError(f"parallel reads: a reader exited {failed[0].returncode}: "
                            f"{failed[0].stderr.decode(errors='replace').strip()[-300:]}")
    return Timed(result.seconds, [r.stdout.decode().strip() for r in result.answer])


def pick_files(files: list[str], count: int, seed: int) -> list[str]:
    """``count`` files drawn at random (with replacement when there are fewer), the same for every system."""
    rng = random.Random(seed)
    if count <= len(files):
        return rng.sample(files, count)
    return [rng.choice(files) for _ in range(count)]


# -- in-process limits of atlasfs


def export_tars(dataset: str, scratch_parent: str) -> Timed:
    """``atlasfs export DATASET OUT`` (a subprocess, as a user runs it; tars written to tmpfs and
    removed); answers the total tar bytes."""
    out = tempfile.mkdtemp(prefix="export-", dir=scratch_parent)
    try:
        run = timed(lambda: subprocess.run([sys.executable, "-m", "atlasfs", "export", dataset, out],
                                           capture_output=True, text=True))
        if run.answer.returncode != 0:
            raise WorkloadError(f"atlasfs export failed: {run.answer.stderr.strip()[-300:]}")
        total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
        return Timed(run.seconds, total)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def command_startup() -> Timed:
    """``atlasfs --version``: the Python start-up and imports that every ``atlasfs`` command pays."""
    run = timed(lambda: subprocess.run([sys.executable, "-m", "atlasfs", "--version"], capture_output=True,
                                       check=False, text=True))
    if run.answer.returncode != 0:
        raise WorkloadError(f"atlasfs --version failed: {run.answer.stderr.strip()[-300:]}")
    return Timed(run.seconds, run.answer.stdout.strip())


def library_loop(dataset: str) -> Timed:
    """``for example in AtlasDataset(path)``: decode every example in this process; answers the count."""
    from atlasfs import AtlasDataset

    def loop() -> int:
        with AtlasDataset(dataset) as ds:
            return sum(1 for _ in ds)
    return timed(loop)


def decode_shard(dataset: str, shard_position: int = 0) -> Timed:
    """Read and decode (decompress and unpickle) every block of one shard once, bypassing caches;
    the yardstick of the first listing of that shard. Answers the example count."""
    from atlasfs import AtlasDataset
    with AtlasDataset(dataset, cache_bytes=0) as ds:
        shard = ds.shards[shard_position]
        return timed(lambda: sum(len(shard.decode_block(block)[0]) for block in range(shard.num_blocks)))
