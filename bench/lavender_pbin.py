#!/usr/bin/env python3
"""Lavender shardsets and Modalities .pbin through the mount, against parsing their files once.

For one 100,000-row Lavender shard (two shardsets: csv, or parquet) and one .pbin file of
100,000 documents, in one run, prints:

* ``parse``: reading the shard's files once in process, with nothing else: pyarrow's
  ``read_table`` (parquet), Python's ``csv.reader`` (csv), the index pickle (``.pbin``);
* ``first listing``: ``os.listdir`` of the shard's folder on a fresh mount with an empty table
  store (the shard's pass over its files, its blocks named, its table built and stored);
  the issue's target is at most 2x ``parse``;
* ``second listing``: the same on a second mount, which reads the stored table (no parse).

Each figure is the median of ``--repeat`` runs, each on a fresh table store.

Usage: python bench/lavender_pbin.py [--rows N] [--repeat N]
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from atlasfs.sources.lavender import write_csv_shard  # noqa: E402
from atlasfs.sources.pbin import write_pbin  # noqa: E402
from bench.systems import host, is_mounted, stop_on_signals, unmount  # noqa: E402


def make_lavender(root: str, rows: int, kind: str) -> list[str]:
    """A dataset of two shardsets with one shard of ``rows`` rows each; returns its files."""
    uids = [f"{i:08x}" for i in range(rows)]
    files = []
    for name, columns in (("captions", {"caption": [f"a photo of thing number {i}, seen from afar" for i in range(rows)]}),
                          ("meta", {"url": [f"https://example.com/img/{i}.jpg" for i in range(rows)],
                                    "width": [256 + i % 512 for i in range(rows)]})):
        os.makedirs(os.path.join(root, name))
        path = os.path.join(root, name, f"shard.00000.{kind}")
        if kind == "csv":
            write_csv_shard(path, [{"uid": u, **{c: v[i] for c, v in columns.items()}} for i, u in enumerate(uids)])
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.table({"uid": uids, **columns}), path)
        files.append(path)
    return files


def parse_lavender(files: list[str]) -> None:
    """Read every file of the shard once, the plainest way."""
    for path in files:
        if path.endswith(".csv"):
            with open(path, newline="", encoding="utf-8") as f:
                for _ in csv.reader(f):
                    pass
        else:
            import pyarrow.parquet as pq
            pq.read_table(path)


def parse_pbin(path: str) -> None:
    """Read the .pbin file's index once (what any reader of it must do first)."""
    with open(path, "rb") as f:
        data_bytes = int.from_bytes(f.read(8), "little")
        f.seek(12 + data_bytes)
        pickle.loads(f.read())


def timed(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def mount_and_list(dataset: str, folder: str, cache_home: str, *options: str) -> float:
    """Mount ``dataset`` (tables stored under ``cache_home``), list ``folder`` once; seconds of the listing."""
    mountpoint = tempfile.mkdtemp(prefix="atlasfs-bench-mnt-")
    env = {**os.environ, "XDG_CACHE_HOME": cache_home}
    result = subprocess.run([sys.executable, "-m", "atlasfs", "mount", dataset, mountpoint, *options],
                            capture_output=True, text=True, env=env, timeout=300)
    try:
        if result.returncode != 0 or not is_mounted(mountpoint):
            raise SystemExit(f"mount of {dataset} failed: {result.stderr.strip()}")
        seconds = timed(lambda: os.listdir(os.path.join(mountpoint, folder)))
        count = len(os.listdir(os.path.join(mountpoint, folder)))
        if count == 0:
            raise SystemExit(f"{dataset}: {folder} is empty through the mount")
        return seconds
    finally:
        unmount(mountpoint, None)


def measure(name: str, dataset: str, folder: str, parse: Callable[[], None], repeat: int, work: str,
            *options: str) -> None:
    parses, firsts, seconds = [], [], []
    for run in range(repeat):
        parses.append(timed(parse))
        cache_home = os.path.join(work, f"cache-{name}-{run}")
        firsts.append(mount_and_list(dataset, folder, cache_home, *options))
        seconds.append(mount_and_list(dataset, folder, cache_home, *options))
        shutil.rmtree(cache_home, ignore_errors=True)
    p, f, s = (statistics.median(x) for x in (parses, firsts, seconds))
    print(f"{name:<22} {p:>9.3f} {f:>14.3f} {f / p:>7.1f}x {s:>15.3f}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows of the shard / documents of the file")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    stop_on_signals()
    commit = subprocess.run(["git", "-C", os.path.dirname(HERE), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "?"
    print(f"# bench/lavender_pbin.py, commit {commit}, {datetime.date.today()}, {host()}")
    print(f"# {args.rows} rows (documents), median of {args.repeat}; seconds")
    print(f"{'dataset':<22} {'parse':>9} {'first listing':>14} {'ratio':>8} {'second listing':>15}")
    work = tempfile.mkdtemp(prefix="atlasfs-bench-lp-")
    try:
        for kind in ("csv", "parquet"):
            root = os.path.join(work, f"lavender-{kind}")
            files = make_lavender(root, args.rows, kind)
            measure(f"lavender {kind} (2 sets)", root, "shard.00000", lambda: parse_lavender(files), args.repeat,
                    work)
        rng = np.random.default_rng(0)
        docs = [rng.integers(0, 50000, size=int(n)) for n in rng.integers(1, 200, size=args.rows)]
        path = os.path.join(work, "pbin", "tokens.pbin")
        os.makedirs(os.path.dirname(path))
        write_pbin(path, docs, token_width=2)
        measure("pbin (2-byte tokens)", path, "tokens", lambda: parse_pbin(path), args.repeat, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
