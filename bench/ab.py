"""A/B: the suite's main workloads through atlasfs at a baseline revision and at the working
tree, interleaved in one run, so that a change that should change nothing (a restructuring)
shows it changed nothing: each figure's ratio, working tree ÷ baseline, near 1. With
``--views``, the working tree's two views of the same dataset instead (issue #36: the
per-sample files of ``--view both`` as fast as those of ``--view files``).

    python bench/ab.py --baseline 094d208 --datasets image,tiny --repeat 5
    python bench/ab.py --views files,both --datasets image,text,tiny --repeat 9

The baseline's package is taken with ``git archive`` into the work folder and run from there
(``PYTHONPATH``); the same dataset, made once by the working tree's writer, is mounted by each
in turn (``atlasfs index`` first: tables stored, as a user's second mount), alternating which
goes first. Figures: cold ``tar`` of every shard through a fresh mount, the same ``tar`` again
(warm), cold and warm random reads (files/s and p99), and the daemon's CPU time in each mount
(user and system, from /proc: less moved by other load than the wall clock). Reads must give
the same bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import datagen, harness, systems, workloads  # noqa: E402

#: Random reads a pass (the suite's default).
READS = 1000


class Checkout(systems.Atlasfs):
    """``atlasfs mount -f`` of the package at ``package_root`` (its ``atlasfs/`` folder), on a
    copy of the dataset of its own (hard links: ``atlasfs index`` stores its tables beside it,
    and the two revisions' tables must not meet)."""

    def __init__(self, label: str, package_root: str, dataset: str, shards: list[str], workdir: str,
                 extra_args: list[str] | None = None) -> None:
        copy = os.path.join(workdir, "dataset")
        if not os.path.isdir(copy):
            os.makedirs(workdir, exist_ok=True)
            subprocess.run(["cp", "-al", dataset, copy], check=True)
        super().__init__(copy, shards, workdir, extra_args)
        self.name = label
        self.env["PYTHONPATH"] = package_root


def baseline_checkout(revision: str, folder: str) -> str:
    """The package at ``revision``, unpacked into ``folder``; returns ``folder``."""
    os.makedirs(folder, exist_ok=True)
    archive = subprocess.run(["git", "-C", harness.REPO, "archive", revision, "atlasfs"], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "x", "-C", folder], input=archive, check=True)
    return folder


def measure(system: systems.Atlasfs, prepared: datagen.Prepared, picked: list[str]) -> dict[str, float]:
    """One round of every figure through fresh mounts of ``system``."""
    figures: dict[str, float] = {}
    with system.session() as view:
        started = _cpu_seconds(view.pid)
        figures["cold tar s"] = workloads.tar_all(view, prepared.shards).seconds
        figures["warm tar s"] = workloads.tar_all(view, prepared.shards).seconds
        figures["daemon CPU s, tars"] = _cpu_seconds(view.pid) - started
    with system.session() as view:
        started = _cpu_seconds(view.pid)
        cold = workloads.random_reads(view, picked)
        warm = workloads.random_reads(view, picked)
        figures["daemon CPU s, reads"] = _cpu_seconds(view.pid) - started
    figures.update({"cold reads files/s": len(picked) / cold.seconds, "cold p99 ms": cold.percentile(99) * 1e3,
                    "warm reads files/s": len(picked) / warm.seconds, "warm p99 ms": warm.percentile(99) * 1e3,
                    "checksum": float(cold.checksum ^ warm.checksum)})
    return figures


def _cpu_seconds(pid: int | None) -> float:
    """User and system CPU seconds process ``pid`` has used (its threads included; in ticks of
    10 ms: a figure of a smoke run may be 0)."""
    if pid is None:
        return float("nan")
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _pair(args: argparse.Namespace, base: str | None, name: str, prepared: datagen.Prepared, scratch: str) -> list[Checkout]:
    """The two mounts compared: the baseline's and the working tree's, or two views."""
    if args.views:
        return [Checkout(f"--view {v}", harness.REPO, prepared.atlas, prepared.shards,
                         os.path.join(scratch, f"{name}-{v}"), ["--view", v]) for v in args.views]
    return [Checkout(f"baseline {args.baseline}", base, prepared.atlas, prepared.shards,
                     os.path.join(scratch, f"{name}-a")),
            Checkout("working tree", harness.REPO, prepared.atlas, prepared.shards, os.path.join(scratch, f"{name}-b"))]


def _keys(args: argparse.Namespace) -> list[str]:
    """The two sides' names in the JSON report."""
    return [f"--view {v}" for v in args.views] if args.views else ["baseline", "working tree"]


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=5)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--baseline", metavar="REV", help="the revision to compare with")
    which.add_argument("--views", metavar="A,B", help="compare two views of the working tree (files,both)")
    p.add_argument("--datasets", default="image,tiny", help="of bench/datagen.py (default image,tiny)")
    p.add_argument("--reads", type=int, help=f"random reads a pass (default {READS}, --smoke 100)")
    args = harness.parse(p, argv)
    if args.views:
        args.views = args.views.split(",")
        if len(args.views) != 2 or not set(args.views) <= {"files", "tars", "both"}:
            p.error("--views: two of files, tars, both (files,both)")
    reads = args.reads or (100 if args.smoke else READS)
    rows, data = [], {}
    with harness.workspace("ab", args) as ws:
        base = None if args.views else baseline_checkout(args.baseline, os.path.join(ws.scratch, "baseline"))
        for name in args.datasets.split(","):
            prepared = datagen.prepare(datagen.spec_for(name, smoke=args.smoke), ws.workdir, harness.log)
            picked = workloads.pick_files(datagen.file_list(_files(prepared, ws.scratch)), reads, 7)
            pair = _pair(args, base, name, prepared, ws.scratch)
            for system in pair:
                system.prepare_metadata()
            runs: dict[str, list[dict[str, float]]] = {s.name: [] for s in pair}
            for r in range(args.repeat):
                for system in (pair if r % 2 == 0 else pair[::-1]):  # neither always goes first
                    harness.log(f"{name}: round {r + 1} of {args.repeat}, {system.name}")
                    runs[system.name].append(measure(system, prepared, picked))
            checksums = {run["checksum"] for runs_ in runs.values() for run in runs_}
            if len(checksums) != 1:
                raise SystemExit(f"ab: {name}: {pair[0].name} and {pair[1].name} read different bytes")
            medians = {s: {k: statistics.median(run[k] for run in runs[s]) for k in runs[s][0] if k != "checksum"}
                       for s in runs}
            a, b = (medians[s.name] for s in pair)
            data[name] = dict(zip(_keys(args), (a, b)))
            for figure in a:
                ratio = f"{b[figure] / a[figure]:.2f}" if a[figure] else "n/a"
                rows.append([name, figure, f"{a[figure]:.3f}", f"{b[figure]:.3f}", ratio])
    a_name, b_name = _keys(args) if args.views else [f"baseline {args.baseline}", "working tree"]
    body = [f"Medians; ratio = {b_name} ÷ {a_name} (for seconds and ms lower is better, for files/s higher).",
            "", *harness.table(["set", "figure", a_name, b_name, "ratio"], rows)]
    meta = harness.meta("ab.py", args, notes=[f"{a_name} against {b_name}; {args.repeat} rounds each, alternating "
                                               f"which goes first; {reads} random reads a pass"])
    title = ("atlasfs A/B: two views of the working tree" if args.views
             else "atlasfs A/B: baseline revision against the working tree")
    harness.write_report("ab", args, title, body, meta, data)
    return 0


def _files(prepared: datagen.Prepared, scratch: str) -> str:
    """The dataset's files extracted on tmpfs (to draw the random reads' paths from)."""
    folder = os.path.join(scratch, f"{prepared.spec.name}-files")
    if not os.path.isdir(folder):
        datagen.materialize(prepared, folder)
    return folder


if __name__ == "__main__":
    harness.run_main(main)
