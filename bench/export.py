#!/usr/bin/env python3
"""``atlasfs export`` against GNU ``tar cf``, in one run (issue #26: export at the speed of tar).

The ``tiny`` dataset of bench/datagen.py (three ~1 KiB files an example; ``--examples``
sets how many, default 66,667: 200,000 files), written as Atlas and exported once; the
same files extracted on tmpfs with GNU tar. Then, each ``--repeat`` times, timed:

* ``tar cf``: one ``tar cf`` per shard folder of the extracted files, one after the other
  (the tars on tmpfs; page cache warm);
* ``tar cf, 2 at once``: the same, two ``tar`` processes at a time;
* ``export -j 1`` and ``export -j 2``: ``atlasfs export -j N ATLAS OUT`` from the Atlas
  dataset (the whole command: start-up, naming every shard's files, writing every tar; no
  stored tables), OUT on tmpfs.

* with ``--ray``, ``export --ray ADDRESS``: a Ray task per shard on one local cluster of two
  CPUs started for the run (bench/raycluster.py); its ratio to ``export -j 2`` is Ray's
  overhead on one node (issue #38: at most 1.15).

Prints files/s (medians) and export's ratio to ``tar cf``. Every export's tars must equal
the first export's, byte for byte.

    python bench/export.py [--smoke] [--repeat N] [--examples N] [--ray]

Report: bench/results/export.md and export.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import datagen, harness

#: Examples of ``--smoke`` (three files each).
SMOKE_EXAMPLES = 3000
DEFAULT_EXAMPLES = 66_667


def tar_seconds(files: str, shards: list[str], out: str, at_once: int) -> float:
    """Seconds of ``tar cf OUT/<shard>.tar -C FILES/<shard> .`` for every shard, ``at_once`` at a time."""
    os.makedirs(out, exist_ok=True)

    def one(shard: str) -> None:
        subprocess.run(["tar", "cf", os.path.join(out, f"{shard}.tar"), "-C", os.path.join(files, shard), "."],
                       check=True)

    def every() -> None:
        with ThreadPoolExecutor(at_once) as pool:
            list(pool.map(one, shards))
    seconds = harness.timed(every).seconds
    shutil.rmtree(out)
    return seconds


def export_seconds(atlas: str, out: str, jobs: int | str, shards: list[str] | None = None) -> float:
    """Seconds of ``atlasfs export -j JOBS ATLAS OUT [--shards SHARDS]`` (OUT removed first);
    ``jobs`` a Ray cluster's address: ``--ray ADDRESS`` instead of ``-j``."""
    shutil.rmtree(out, ignore_errors=True)
    executor = ["--ray", jobs] if isinstance(jobs, str) else ["-j", str(jobs)]
    command = [sys.executable, "-m", "atlasfs", "export", *executor, atlas, out]
    if shards is not None:
        command += ["--shards", *shards]
    return harness.timed(lambda: subprocess.run(command, check=True, stdout=subprocess.DEVNULL)).seconds


def same_tars(a: str, b: str) -> bool:
    """True if folders ``a`` and ``b`` hold the same files with the same bytes."""
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(
        subprocess.run(["cmp", "-s", os.path.join(a, n), os.path.join(b, n)]).returncode == 0 for n in names)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=3)
    p.add_argument("--examples", type=int, help=f"examples of the tiny set (default {DEFAULT_EXAMPLES}, "
                                                f"--smoke {SMOKE_EXAMPLES})")
    p.add_argument("--ray", action="store_true", help="also export --ray on a local Ray cluster")
    args = harness.parse(p, argv)
    if args.ray:
        from bench import raycluster
        with raycluster.cluster() as address:
            return _report(args, address)
    return _report(args, None)


def _report(args: argparse.Namespace, ray: str | None) -> int:
    """Time every column and write the report (``ray``: the cluster of the --ray column)."""
    examples = args.examples or (SMOKE_EXAMPLES if args.smoke else DEFAULT_EXAMPLES)
    with harness.workspace("export", args) as ws:
        prepared = datagen.prepare(datagen.spec_for("tiny", examples), ws.workdir, harness.log)
        files_dir = os.path.join(ws.scratch, "files")
        harness.log(f"extracting {prepared.files} files of {len(prepared.shards)} shards on tmpfs")
        datagen.materialize(prepared, files_dir)
        figures: dict[str, list[float]] = {"tar cf": [], "tar cf, 2 at once": [], "export -j 1": [],
                                           "export -j 2": [], **({"export --ray": []} if ray else {})}
        first = os.path.join(ws.scratch, "export-first")
        shutil.rmtree(first, ignore_errors=True)
        shutil.copytree(prepared.tars, first)  # datagen's export: what every run below must write again
        for turn in range(args.repeat):
            figures["tar cf"].append(tar_seconds(files_dir, prepared.shards, os.path.join(ws.scratch, "tar"), 1))
            figures["tar cf, 2 at once"].append(
                tar_seconds(files_dir, prepared.shards, os.path.join(ws.scratch, "tar"), 2))
            for jobs in (1, 2, *([ray] if ray else [])):
                column = "export --ray" if isinstance(jobs, str) else f"export -j {jobs}"
                out = os.path.join(ws.scratch, "export-" + column.split()[-1])
                figures[column].append(export_seconds(prepared.atlas, out, jobs))
                if not same_tars(first, out):
                    raise RuntimeError(f"{column} wrote other bytes than the first export")
                shutil.rmtree(out)
            harness.log(f"run {turn + 1}/{args.repeat}: " + ", ".join(
                f"{name} {prepared.files / values[-1]:,.0f} files/s" for name, values in figures.items()))
        rates = {name: prepared.files / statistics.median(values) for name, values in figures.items()}
    rows = [[name, f"{statistics.median(figures[name]):.2f}", f"{rate:,.0f}", f"{rate / rates['tar cf']:.2f}"]
            for name, rate in rates.items()]
    body = [f"{prepared.files} files ({prepared.file_bytes / prepared.files:.0f} bytes on average) in "
            f"{len(prepared.shards)} shards; seconds and files/s are medians of {args.repeat}; tar cf reads the "
            "files extracted on tmpfs, export the Atlas dataset (no stored tables); every tar on tmpfs.", ""]
    body += harness.table(["", "seconds", "files/s", "of tar cf"], rows)
    if ray:
        overhead = statistics.median(figures["export --ray"]) / statistics.median(figures["export -j 2"])
        body += ["", f"export --ray ÷ export -j 2 (seconds): {overhead:.2f} (Ray on this machine, a local cluster of "
                 f"2 CPUs started once for the run; {len(prepared.shards)} shards, a task each)"]
    harness.write_report("export", args, "atlasfs export against GNU tar cf", body,
                         harness.meta("export.py", args, cpus=os.cpu_count()),
                         {"files": prepared.files, "shards": len(prepared.shards), "files_per_second": rates,
                          "seconds": figures})
    return 0


if __name__ == "__main__":
    harness.run_main(main)
