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

    python bench/lavender_pbin.py [--rows N] [--repeat N]
    python bench/lavender_pbin.py --smoke       # 2,000 rows, one repeat

Report: bench/results/lavender_pbin.md and lavender_pbin.json.
"""

from __future__ import annotations

import csv
import os
import pickle
import shutil
import statistics
import sys
from typing import Callable

import numpy as np

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import harness
from bench._atlasfs import write_csv_shard, write_pbin
from bench.systems import Atlasfs


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


def listing(system: Atlasfs, folder: str) -> float:
    """A fresh mount of ``system``, ``folder`` listed once: seconds of the listing."""
    with system.session() as view:
        path = os.path.join(view.root, folder)
        seconds = harness.timed(lambda: os.listdir(path)).seconds
        if not os.listdir(path):
            raise RuntimeError(f"{system.dataset}: {folder} is empty through the mount")
        return seconds


def measure(name: str, dataset: str, folder: str, parse: Callable[[], None], repeat: int,
            work: str) -> dict[str, list[float]]:
    """Per run, on a fresh table store: the parse, the first listing, the second mount's listing."""
    found: dict[str, list[float]] = {"parse": [], "first": [], "second": []}
    for run in range(repeat):
        found["parse"].append(harness.timed(parse).seconds)
        state = os.path.join(work, f"state-{name}-{run}")
        system = Atlasfs(dataset, [folder], state)
        system.clear_metadata()
        found["first"].append(listing(system, folder))
        found["second"].append(listing(system, folder))
        shutil.rmtree(state, ignore_errors=True)
    return found


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0], repeat=3)
    p.add_argument("--rows", type=int, help="rows of the shard / documents of the file (default 100,000; "
                                            "--smoke 2,000)")
    args = harness.parse(p, argv)
    rows = args.rows or (2_000 if args.smoke else 100_000)
    results: dict[str, dict[str, list[float]]] = {}
    with harness.workspace("lavender-pbin", args) as ws:
        work = ws.workdir
        for kind in ("csv", "parquet"):
            root = os.path.join(work, f"lavender-{kind}")
            shutil.rmtree(root, ignore_errors=True)
            files = make_lavender(root, rows, kind)
            harness.log(f"lavender {kind}: {args.repeat} run(s)")
            results[f"lavender {kind} (2 sets)"] = measure(kind, root, "shard.00000", lambda: parse_lavender(files),
                                                           args.repeat, ws.scratch)
        rng = np.random.default_rng(0)
        docs = [rng.integers(0, 50000, size=int(n)) for n in rng.integers(1, 200, size=rows)]
        path = os.path.join(work, "pbin", "tokens.pbin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_pbin(path, docs, token_width=2)
        harness.log(f"pbin: {args.repeat} run(s)")
        results["pbin (2-byte tokens)"] = measure("pbin", path, "tokens", lambda: parse_pbin(path), args.repeat,
                                                  ws.scratch)
    table = []
    for name, found in results.items():
        parse, first, second = (statistics.median(found[k]) for k in ("parse", "first", "second"))
        table.append([name, f"{parse:.3f}", f"{first:.3f}", f"{first / parse:.1f}x", f"{second:.3f}"])
    body = [f"{rows} rows (documents), median of {args.repeat}; seconds", ""]
    body += harness.table(["dataset", "parse", "first listing", "ratio", "second listing"], table)
    harness.write_report("lavender_pbin", args, "Lavender shardsets and .pbin: a first listing against one parse",
                         body, harness.meta("lavender_pbin.py", args, rows=rows), {"results": results})
    return 0


if __name__ == "__main__":
    harness.run_main(main)
