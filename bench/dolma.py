#!/usr/bin/env python3
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

    python bench/dolma.py [--lines N] [--keep DIR]
    python bench/dolma.py --smoke            # 2,000 lines

The daemons run in the foreground under this process (their pids are ours), with a private
table cache. Report: bench/results/dolma.md and dolma.json.
"""

from __future__ import annotations

import gzip
import json
import os
import random
import subprocess
import sys

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import harness
from bench._atlasfs import DolmaSource
from bench.systems import Atlasfs

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


def plain_parse(path: str) -> None:
    """gzip + json.loads of every line."""
    with gzip.open(path, "rb") as f:
        for line in f:
            json.loads(line)


def ls(folder: str) -> harness.Timed:
    """``ls FOLDER``, timed; answers the number of entries."""
    run = harness.timed(lambda: subprocess.run(["ls", folder], capture_output=True, check=True).stdout)
    return harness.Timed(run.seconds, run.answer.count(b"\n"))


def rchar(pid: int) -> int:
    """Bytes process ``pid`` has read (``/proc/PID/io``, page-cache hits included)."""
    with open(f"/proc/{pid}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=None)
    p.add_argument("--lines", type=int, help="lines of the documents file (default 100,000; --smoke 2,000)")
    args = harness.parse(p, argv)
    lines = args.lines or (2_000 if args.smoke else 100_000)
    with harness.workspace("dolma", args) as ws:
        dataset = os.path.join(ws.workdir, "dataset")
        os.makedirs(os.path.join(dataset, "documents"), exist_ok=True)
        path = os.path.join(dataset, "documents", "cc_en.jsonl.gz")
        text_bytes = write_documents(path, lines)
        size = os.path.getsize(path)
        plain_parse(path)  # warm the page cache: both sides then read the file from memory
        parse = min(harness.timed(lambda: plain_parse(path)).seconds, harness.timed(lambda: plain_parse(path)).seconds)
        # the pass alone, in this process: what the first listing adds for Dolma
        prepare = harness.timed(lambda: DolmaSource(dataset).shards[0].prepare()).seconds
        system = Atlasfs(dataset, ["cc_en"], os.path.join(ws.scratch, "state"))
        system.clear_metadata()  # the table cache is the state folder's: empty
        with system.session() as view:
            first = ls(view.shard_dirs["cc_en"])
        with system.session() as view:
            second = ls(view.shard_dirs["cc_en"])
            index = random.Random(7).randrange(lines)
            assert view.pid is not None
            before = rchar(view.pid)
            with open(os.path.join(view.shard_dirs["cc_en"], f"cc-{index:06d}.text"), "rb") as f:
                read = harness.timed(f.read)
            daemon_read = rchar(view.pid) - before
    body = [
        f"file: {lines} lines, {text_bytes / 2**20:.1f} MiB of text, {size / 2**20:.1f} MiB gzip",
        f"plain parse (gzip + json.loads every line): {parse:.3f} s",
        f"first listing through the mount (ls, {first.answer} files): {first.seconds:.3f} s = "
        f"{first.seconds / parse:.2f}x the plain parse (target <= 2x)",
        f"  of which the pass (prepare: inflate, split, json.loads, seek points; in this process): "
        f"{prepare:.3f} s = {prepare / parse:.2f}x; the rest is the tree naming and listing the files",
        f"second mount's listing (stored table, no pass): {second.seconds:.3f} s",
        f"random cat of document {index} ({len(read.answer)} bytes): {read.seconds * 1000:.1f} ms, daemon read "
        f"{daemon_read / 2**20:.2f} MiB = {daemon_read / size:.1%} of the {size / 2**20:.1f} MiB file "
        f"(one block of 512 lines from the seek point before it, not the file)",
    ]
    data = {"lines": lines, "text_bytes": text_bytes, "gzip_bytes": size, "parse_s": parse, "prepare_s": prepare,
            "first_listing_s": first.seconds, "files": first.answer, "second_listing_s": second.seconds,
            "cat_document": index, "cat_s": read.seconds, "cat_bytes": len(read.answer),
            "daemon_read_bytes": daemon_read}
    harness.write_report("dolma", args, "Dolma: a first listing against one parse",
                         [f"- {line}" if not line.startswith("  ") else f"  - {line.strip()}" for line in body],
                         harness.meta("dolma.py", args), data)
    return 0


if __name__ == "__main__":
    harness.run_main(main)
