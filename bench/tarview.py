#!/usr/bin/env python3
"""The tar view against its yardsticks, in one run (docs/performance.md, "The tar view").

For shard 0 of each of the benchmark's datasets (bench/datagen.py), with file tables stored
(``atlasfs index``), times:

* ``export``: writing the shard's tar in process (``TarLayout.write_to`` into /dev/null) from a
  fresh tree: what ``atlasfs export`` does for one shard, without its start-up;
* ``cold cat``: ``cat MNT/<shard>.tar > /dev/null`` on a fresh ``atlasfs mount --view tars``;
* ``warm cat``: the same again on that mount;
* ``tmpfs cat``: ``cat`` of the exported tar copied to /dev/shm (page cache warm).

and prints MB/s, the median of ``--repeat`` runs, with the issue's ratios: cold cat / export
(target >= 0.8) and warm cat / tmpfs cat (target >= 0.7).

Usage: python bench/tarview.py [--smoke] [--repeat N] [--datasets image,text,tiny]
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import datagen  # noqa: E402
from bench.systems import unmount, _wait  # noqa: E402


def _cat(path: str) -> float:
    start = time.perf_counter()
    subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)
    return time.perf_counter() - start


def _export_seconds(atlas: str, shard: str) -> tuple[float, int]:
    """In a fresh process: open with stored tables and write the shard's tar to /dev/null."""
    script = f"""
import time
from atlasfs import AtlasDataset
from atlasfs.blocktree import BlockTree
from atlasfs.tablestore import TableStore
from atlasfs.tarview import TarLayout
tree = BlockTree(AtlasDataset({atlas!r}), store=TableStore({atlas!r}))
start = time.perf_counter()
layout = TarLayout(tree, "/{shard}")
with open("/dev/null", "wb") as out:
    layout.write_to(out)
print(time.perf_counter() - start, layout.size)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), int(out[1])


def _mount(atlas: str, workdir: str) -> tuple[str, subprocess.Popen[bytes]]:
    mountpoint = tempfile.mkdtemp(prefix="tarview-", dir=workdir)
    log = open(mountpoint + ".log", "ab")
    process = subprocess.Popen([sys.executable, "-m", "atlasfs", "mount", "-f", "--view", "tars", atlas, mountpoint],
                               stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    _wait(process, lambda: os.path.ismount(mountpoint), "atlasfs mount -f --view tars", mountpoint + ".log")
    return mountpoint, process


def run(name: str, args: argparse.Namespace, workdir: str, shm: str) -> dict[str, float]:
    spec = datagen.spec_for(name, smoke=args.smoke)
    prepared = datagen.prepare(spec, workdir, lambda m: print(f"  {m}", file=sys.stderr))
    shard = prepared.shards[0]
    subprocess.run([sys.executable, "-m", "atlasfs", "index", prepared.atlas], capture_output=True, check=True)
    tmpfs_tar = os.path.join(shm, f"{name}-{shard}.tar")
    shutil.copyfile(os.path.join(prepared.tars, f"{shard}.tar"), tmpfs_tar)
    figures: dict[str, list[float]] = {"export": [], "cold cat": [], "warm cat": [], "tmpfs cat": []}
    size = os.path.getsize(tmpfs_tar)
    for _ in range(args.repeat):
        seconds, exported = _export_seconds(prepared.atlas, shard)
        assert exported == size, (exported, size)
        figures["export"].append(size / seconds)
        mountpoint, process = _mount(prepared.atlas, workdir)
        try:
            tar = os.path.join(mountpoint, f"{shard}.tar")
            figures["cold cat"].append(size / _cat(tar))
            figures["warm cat"].append(size / _cat(tar))
            if subprocess.run(["cmp", tar, tmpfs_tar]).returncode != 0:
                raise SystemExit(f"{name}: the mounted tar differs from the export")
        finally:
            unmount(mountpoint, process)
        _cat(tmpfs_tar)
        figures["tmpfs cat"].append(size / _cat(tmpfs_tar))
    result = {key: statistics.median(values) / 1e6 for key, values in figures.items()}
    result["tar MB"] = size / 1e6
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default="image,text,tiny")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat")
    args = p.parse_args()
    if args.smoke:
        args.repeat = 1
    shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else None
    workdir = tempfile.mkdtemp(prefix="atlasfs-bench-tarview-", dir=shm_parent)
    shm = tempfile.mkdtemp(prefix="atlasfs-bench-tarview-tmpfs-", dir=shm_parent)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "?"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"tar view, shard 0, commit {commit}, {date}, median of {args.repeat}, MB/s",
             "| set | tar MB | export | cold cat | cold / export (>= 0.8) | warm cat | tmpfs cat | warm / tmpfs (>= 0.7) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    try:
        for name in args.datasets.split(","):
            r = run(name, args, workdir, shm)
            lines.append(f"| {name} | {r['tar MB']:.1f} | {r['export']:.0f} | {r['cold cat']:.0f} | "
                         f"{r['cold cat'] / r['export']:.2f} | {r['warm cat']:.0f} | {r['tmpfs cat']:.0f} | "
                         f"{r['warm cat'] / r['tmpfs cat']:.2f} |")
            print(lines[-1], file=sys.stderr)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
