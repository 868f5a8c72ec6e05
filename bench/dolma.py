"""Dolma through a mount against a plain parse (issue #14's speed targets), in one run.

Writes a 100,000-line ``.jsonl.gz`` Dolma documents file (Common Crawl-like lines of
50-400 words, fixed seed), then measures:

- a plain parse: ``gzip`` + ``json.loads`` of every line, in this process (the better of two);
- the first listing through a fresh mount (``ls`` of the file's folder: the one pass that
  finds blocks, ids and sizes and builds the gzip seek points), and its ratio to the plain
  parse (target: at most 2x);
- the second mount's listing (the stored file table and state: no pass over the file);
- a random ``cat`` of one document on that second mount: the bytes the daemon read
  (``/proc/<pid>/io`` ``rchar``, which counts page-cache hits too) against the file's size,
  and the span from the gzip seek point before its block to the block's end.

Usage: ``.venv/bin/python bench/dolma.py [--lines N] [--keep DIR]``. The daemons run in the
foreground under this process (their pids are ours), with a private table cache.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from atlasfs.sources.dolma import DolmaSource  # noqa: E402
from bench.systems import _wait, host, is_mounted, unmount  # noqa: E402

WORDS = ("the of and to in is was for on that with as by at from it his an were are which this be or "
         "data model city river north energy people history music school system water between").split()


def write_documents(path: str, lines: int, seed: int = 0) -> int:
    """The documents file; returns its text bytes."""
    rng = random.Random(seed)
    text_bytes = 0
    with gzip.open(path, "wb", compresslevel=6) as f:
        for i in range(lines):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(50, 400)))
            line = json.dumps({"id": f"cc-{i:06d}", "text": text, "source": "bench", "added": "2024-01-01",
                               "metadata": {"url": f"https://example.org/{i}", "lang": "en"}}).encode() + b"\n"
            f.write(line)
            text_bytes += len(line)
    return text_bytes


def plain_parse(path: str) -> float:
    """Seconds for gzip + json.loads of every line."""
    start = time.perf_counter()
    with gzip.open(path, "rb") as f:
        for line in f:
            json.loads(line)
    return time.perf_counter() - start


def mount(dataset: str, env: dict[str, str], log_path: str) -> tuple[str, subprocess.Popen[bytes]]:
    """A fresh foreground daemon on a new mount point, once the mount is live."""
    mountpoint = tempfile.mkdtemp(prefix="atlasfs-bench-dolma-")
    log = open(log_path, "ab")
    process = subprocess.Popen([sys.executable, "-m", "atlasfs", "mount", dataset, mountpoint, "-f"],
                               stdout=log, stderr=log, env=env)
    log.close()
    _wait(process, lambda: is_mounted(mountpoint), "atlasfs mount", log_path)
    return mountpoint, process


def timed_ls(folder: str) -> tuple[float, int]:
    start = time.perf_counter()
    out = subprocess.run(["ls", folder], capture_output=True, check=True).stdout
    return time.perf_counter() - start, out.count(b"\n")


def rchar(pid: int) -> int:
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--keep", help="write the dataset here and keep it")
    args = parser.parse_args()
    work = args.keep or tempfile.mkdtemp(prefix="atlasfs-bench-dolma-data-")
    dataset = os.path.join(work, "dataset")
    os.makedirs(os.path.join(dataset, "documents"), exist_ok=True)
    path = os.path.join(dataset, "documents", "cc_en.jsonl.gz")
    cache = tempfile.mkdtemp(prefix="atlasfs-bench-dolma-cache-")
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    log_path = os.path.join(cache, "daemon.log")
    try:
        text_bytes = write_documents(path, args.lines)
        size = os.path.getsize(path)
        plain_parse(path)  # warm the page cache: both sides then read the file from memory
        parse = min(plain_parse(path), plain_parse(path))
        git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
        print(f"# Dolma bench, {time.strftime('%Y-%m-%d')}, commit {git or '?'}, {host()}")
        print(f"file: {args.lines} lines, {text_bytes / 2**20:.1f} MiB of text, {size / 2**20:.1f} MiB gzip")
        print(f"plain parse (gzip + json.loads every line): {parse:.3f} s")

        start = time.perf_counter()  # the pass alone, in this process: what the first listing adds for Dolma
        DolmaSource(dataset).shards[0].prepare()
        prepare = time.perf_counter() - start

        mountpoint, process = mount(dataset, env, log_path)
        try:
            first, entries = timed_ls(os.path.join(mountpoint, "cc_en"))
        finally:
            unmount(mountpoint, process)
        print(f"first listing through the mount (ls, {entries} files): {first:.3f} s = "
              f"{first / parse:.2f}x the plain parse (target <= 2x)")
        print(f"  of which the pass (prepare: inflate, split, json.loads, seek points; in this process): "
              f"{prepare:.3f} s = {prepare / parse:.2f}x; the rest is the tree naming and listing the files")

        mountpoint, process = mount(dataset, env, log_path)
        try:
            second, _ = timed_ls(os.path.join(mountpoint, "cc_en"))
            print(f"second mount's listing (stored table, no pass): {second:.3f} s")
            index = random.Random(7).randrange(args.lines)
            before = rchar(process.pid)
            start = time.perf_counter()
            with open(os.path.join(mountpoint, "cc_en", f"cc-{index:06d}.text"), "rb") as f:
                got = f.read()
            took = time.perf_counter() - start
            read = rchar(process.pid) - before
            print(f"random cat of document {index} ({len(got)} bytes): {took * 1000:.1f} ms, daemon read "
                  f"{read / 2**20:.2f} MiB = {read / size:.1%} of the {size / 2**20:.1f} MiB file "
                  f"(one block of 512 lines from the seek point before it, not the file)")
        finally:
            unmount(mountpoint, process)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
