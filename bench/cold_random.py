#!/usr/bin/env python3
"""Cold random reads alone (issue #18): atlasfs against ratarmount, the suite's figure
without the rest of the suite, so that it can be run with more repeats when the
machine is quiet.

    python bench/cold_random.py                          # image, text, tiny; 5 repeats
    python bench/cold_random.py --datasets tiny --repeat 9 --workdir /dev/shm/cr
    python bench/cold_random.py --smoke                  # small sizes, 1 repeat

Exactly the suite's session (bench/run.py, "random reads cold, warm"): the datasets
of bench/datagen.py, tables and indexes stored ahead (``atlasfs index``, a first
ratarmount mount), then per repeat and system one fresh mount (a new daemon) in
which the same seeded files are read once (cold) and again (warm) by
``open().read()`` in this process. The two systems take turns within each repeat,
so a slow minute of this shared VM hits both. Every pass's bytes are checked (CRC)
against the files extracted from the tars. Report: bench/results/cold_random.md
(medians, with the min-max over repeats) and cold_random.json (the raw figures).
With ``--no-ratarmount`` (or if it cannot be installed) its column and the ratios
are "missing"; the exit code is then 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import datagen, harness, systems, workloads

SYSTEMS = ("atlasfs", "ratarmount")


def _figures(reads: workloads.Reads, count: int) -> dict[str, float]:
    return {"fps": count / reads.seconds, "p50_ms": reads.percentile(50) * 1e3, "p99_ms": reads.percentile(99) * 1e3}


def block_decompression(atlas: str) -> dict[str, float]:
    """Milliseconds to decompress each block of the dataset whole, once, in this process with
    its shard's own codec (zstandard, the dataset's dictionary): p50 and p90 over the blocks.
    The first read of a file in a compressible block needs its block decompressed from the
    start (a zstd frame is not decoded from its middle), on any server that keeps the data as
    it is: with few reads a block, these first reads are the cold p99's (docs/performance.md)."""
    from atlasfs import AtlasDataset

    times = []
    clock = time.perf_counter
    with AtlasDataset(atlas) as ds:
        for shard in ds.shards:
            for block in range(shard.num_blocks):
                raw = shard.read_raw(block)
                t0 = clock()
                shard.codec.decompress(raw, shard.block_where(block))
                times.append(clock() - t0)
    times.sort()
    return {"p50_ms": times[len(times) // 2] * 1e3, "p90_ms": times[int(len(times) * 0.9)] * 1e3,
            "blocks": len(times)}


def run_dataset(name: str, args: argparse.Namespace, workdir: str, scratch: str, ratarmount: str | None) -> dict[str, Any]:
    spec = datagen.spec_for(name, smoke=args.smoke)
    prepared = datagen.prepare(spec, workdir, harness.log)
    folder = os.path.join(scratch, name)
    datagen.materialize(prepared, folder)
    try:
        files = datagen.file_list(folder)
        reads = workloads.pick_files(files, args.reads, seed=spec.seed)
        with systems.Tmpfs(folder, prepared.shards).session() as extracted:
            expected = workloads.random_reads(extracted, reads)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    state = os.path.join(workdir, name, "cold-random-state")
    shutil.rmtree(state, ignore_errors=True)
    os.makedirs(state)
    chosen: list[systems.Atlasfs | systems.Ratarmount] = [systems.Atlasfs(prepared.atlas, prepared.shards, state)]
    if ratarmount:
        chosen.append(systems.Ratarmount(ratarmount, prepared.tars, prepared.shards, state))
    for system in chosen:
        system.clear_metadata()
        system.prepare_metadata()
    raw: dict[str, dict[str, list[float]]] = {s.name: {} for s in chosen}
    wrong = 0
    for i in range(args.repeat):
        harness.log(f"{name}: repeat {i + 1}/{args.repeat}")
        for system in chosen if i % 2 == 0 else chosen[::-1]:
            with system.session() as view:
                for kind in ("cold", "warm"):
                    got = workloads.random_reads(view, reads)
                    if (got.nbytes, got.checksum) != (expected.nbytes, expected.checksum):
                        wrong += 1
                        harness.log(f"{name}: {system.name} {kind}: WRONG BYTES")
                    for figure, value in _figures(got, len(reads)).items():
                        raw[system.name].setdefault(f"{kind}_{figure}", []).append(value)
    return {"files": prepared.files, "reads": len(reads), "raw": raw, "wrong_passes": wrong,
            "block_decompression": block_decompression(prepared.atlas)}


def _cell(values: list[float] | None, digits: int) -> str:
    if not values:
        return "missing"
    return f"{statistics.median(values):,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def body(results: dict[str, dict[str, Any]]) -> list[str]:
    """The table: medians (min-max) of both systems, and the ratio of the medians."""
    rows = []
    for name, r in results.items():
        a, b = (r["raw"].get(s, {}) for s in SYSTEMS)
        for figure, unit, digits in (("cold_fps", "files/s", 0), ("cold_p50_ms", "ms", 3), ("cold_p99_ms", "ms", 3),
                                     ("warm_fps", "files/s", 0), ("warm_p99_ms", "ms", 3)):
            ratio = (f"{statistics.median(a[figure]) / statistics.median(b[figure]):.2f}" if b.get(figure)
                     else "missing")
            rows.append([name, f"{figure.replace('_', ' ')} ({unit})", _cell(a.get(figure), digits),
                         _cell(b.get(figure), digits), ratio])
        if "block_decompression" in r:  # against ratarmount's cold p99: how much of it one such decompression takes
            d = r["block_decompression"]
            cold_p99 = b.get("cold_p99_ms")
            for figure in ("p50_ms", "p90_ms"):
                ratio = f"{d[figure] / statistics.median(cold_p99):.2f}" if cold_p99 else "missing"
                rows.append([name, f"a block decompressed whole, in process, {figure[:3]} of {d['blocks']} (ms; "
                             "ratio: of ratarmount's cold p99)", f"{d[figure]:.3f}", "none", ratio])
        if r["wrong_passes"]:
            rows.append([name, "**passes with wrong bytes**", str(r["wrong_passes"]), "", ""])
    return harness.table(["set", "figure", "atlasfs", "ratarmount", "ratio (medians)"], rows)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=5)
    p.add_argument("--datasets", default="image,text,tiny")
    p.add_argument("--reads", type=int, help="random reads a pass (default 1000, --smoke 200)")
    harness.add_ratarmount_args(p)
    args = harness.parse(p, argv)
    args.reads = args.reads or (200 if args.smoke else 1000)
    ratarmount, version, reason = harness.ratarmount(args)
    results = {}
    with harness.workspace("cold-random", args) as ws:
        for name in [d.strip() for d in args.datasets.split(",") if d.strip()]:
            results[name] = run_dataset(name, args, ws.workdir, ws.scratch, ratarmount)
    notes = [f"{args.repeat} repeats, {args.reads} reads a pass; ratarmount: {version}"]
    if reason:
        notes.append(f"ratarmount figures are MISSING: {reason}")
    meta = harness.meta("cold_random.py", args, repeat=args.repeat, reads=args.reads, notes=notes)
    harness.write_report("cold_random", args, "cold random reads: atlasfs vs ratarmount", body(results), meta,
                         {"results": results})
    if any(r["wrong_passes"] for r in results.values()):
        return 1
    return 2 if reason else 0


if __name__ == "__main__":
    harness.run_main(main)
