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
against the files extracted from the tars. Prints a markdown table (medians, with
the min-max over repeats) and, with ``--json``, the raw figures.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` and `atlasfs` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import datagen, systems, workloads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START = time.monotonic()


def log(message: str) -> None:
    print(f"[{time.monotonic() - START:6.1f}s] {message}", file=sys.stderr, flush=True)


def _figures(reads: workloads.Reads, count: int) -> dict[str, float]:
    return {"fps": count / reads.seconds, "p50_ms": reads.percentile(50) * 1e3, "p99_ms": reads.percentile(99) * 1e3}


def run_dataset(name: str, args: argparse.Namespace, workdir: str, shm: str, ratarmount: str) -> dict[str, Any]:
    spec = datagen.spec_for(name, smoke=args.smoke)
    prepared = datagen.prepare(spec, workdir, log)
    folder = os.path.join(shm, name)
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
    chosen = [systems.Atlasfs(prepared.atlas, prepared.shards, state),
              systems.Ratarmount(ratarmount, prepared.tars, prepared.shards, state)]
    for system in chosen:
        system.clear_metadata()  # type: ignore[attr-defined]
        system.prepare_metadata()
    raw: dict[str, dict[str, list[float]]] = {s.name: {} for s in chosen}
    wrong = 0
    for i in range(args.repeat):
        log(f"{name}: repeat {i + 1}/{args.repeat}")
        for system in chosen if i % 2 == 0 else chosen[::-1]:
            with system.session() as view:
                for kind in ("cold", "warm"):
                    got = workloads.random_reads(view, reads)
                    if (got.nbytes, got.checksum) != (expected.nbytes, expected.checksum):
                        wrong += 1
                        log(f"{name}: {system.name} {kind}: WRONG BYTES")
                    for figure, value in _figures(got, len(reads)).items():
                        raw[system.name].setdefault(f"{kind}_{figure}", []).append(value)
    return {"files": prepared.files, "reads": len(reads), "raw": raw, "wrong_passes": wrong}


def _cell(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


def markdown(meta: dict[str, Any], results: dict[str, dict[str, Any]]) -> str:
    lines = [f"# cold random reads: atlasfs vs ratarmount ({meta['date']}, commit {meta['commit']})", "",
             f"{meta['host']}; {meta['repeat']} repeats, {meta['reads']} reads a pass; load average before: "
             f"{meta['load']}; command: `{meta['command']}`", "",
             "| set | figure | atlasfs | ratarmount | ratio (medians) |", "| --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        a, b = r["raw"]["atlasfs"], r["raw"]["ratarmount"]
        for figure, unit, digits in (("cold_fps", "files/s", 0), ("cold_p50_ms", "ms", 3), ("cold_p99_ms", "ms", 3),
                                     ("warm_fps", "files/s", 0), ("warm_p99_ms", "ms", 3)):
            ratio = statistics.median(a[figure]) / statistics.median(b[figure])
            lines.append(f"| {name} | {figure.replace('_', ' ')} ({unit}) | {_cell(a[figure], digits)} | "
                         f"{_cell(b[figure], digits)} | {ratio:.2f} |")
        if r["wrong_passes"]:
            lines.append(f"| {name} | **passes with wrong bytes** | {r['wrong_passes']} | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default="image,text,tiny")
    p.add_argument("--repeat", type=int, help="fresh mounts per system (default 5, --smoke 1)")
    p.add_argument("--reads", type=int, help="random reads a pass (default 1000, --smoke 200)")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--workdir", help="keep the generated data here and reuse it (default: a temporary folder on /dev/shm)")
    p.add_argument("--ratarmount-venv", default=os.path.join(REPO, "bench", ".venv-ratarmount"))
    p.add_argument("--json", help="also write the raw figures here")
    args = p.parse_args(argv)
    args.repeat = args.repeat or (1 if args.smoke else 5)
    args.reads = args.reads or (200 if args.smoke else 1000)
    systems.stop_on_signals()
    ratarmount, _ = systems.ensure_ratarmount(args.ratarmount_venv, log)
    load = os.getloadavg()
    shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else None
    workdir = args.workdir or tempfile.mkdtemp(prefix="atlasfs-cold-random-", dir=shm_parent)
    os.makedirs(workdir, exist_ok=True)
    shm = tempfile.mkdtemp(prefix="atlasfs-cold-random-x-", dir=shm_parent)
    results = {}
    try:
        for name in [d.strip() for d in args.datasets.split(",") if d.strip()]:
            results[name] = run_dataset(name, args, workdir, shm, ratarmount)
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    git = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "commit": git.strip() + (" with uncommitted changes" if dirty.strip() else ""),
            "host": systems.host(), "repeat": args.repeat, "reads": args.reads,
            "load": " ".join(f"{x:.2f}" for x in load),
            "command": "python bench/cold_random.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    print(markdown(meta, results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 1 if any(r["wrong_passes"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
