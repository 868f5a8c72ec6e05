#!/usr/bin/env python3
"""The tar view against its yardsticks, in one run (docs/performance.md, "The tar view").

For shard 0 of each of the benchmark's datasets (bench/datagen.py), with file tables stored
(``atlasfs index``), times:

* ``export``: writing the shard's tar in process (``TarLayout.write_to`` into /dev/null) from a
  fresh tree: what ``atlasfs export`` does for one shard, without its start-up;
* ``cold cat``: ``cat MNT/<shard>.tar > /dev/null`` on a fresh ``atlasfs mount --view tars``
  (``--view both``: the mount shows the per-sample files too);
* ``warm cat``: the same again on that mount;
* ``tmpfs cat``: ``cat`` of the exported tar copied to /dev/shm (page cache warm).

and prints MB/s, the median of ``--repeat`` runs, with the issue's ratios: cold cat / export
(target >= 0.9, issue #36) and warm cat / tmpfs cat (target >= 0.7). The mounted tar must equal the export.
Each repeat times export and then the cold cat at once: the median of each repeat's cold / export,
with its range, is the ratio a machine whose load moves between repeats moves least.
Beside them, CPU milliseconds (medians): export's process (its threads included) and the mount
daemon's during the cold cat: figures a loaded machine moves less than wall-clock ones.

    python bench/tarview.py [--smoke] [--repeat N] [--datasets image,text,tiny] [--view tars|both]

Report: bench/results/tarview.md and tarview.json.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import datagen, harness
from bench.systems import Atlasfs


#: The figures in MB/s (the others are milliseconds or ratios).
MB_PER_S = ("export", "cold cat", "warm cat", "tmpfs cat")


def export_in_process(atlas: str, shard: str) -> None:
    """Open ``atlas`` with its stored tables and write shard ``shard``'s tar to /dev/null; prints the
    seconds, the tar's size and the process's CPU seconds meanwhile. Runs in a fresh process
    (:func:`export_seconds`)."""
    import time

    from atlasfs import AtlasDataset
    from bench._atlasfs import BlockTree, TableStore, TarLayout

    tree = BlockTree(AtlasDataset(atlas), store=TableStore(atlas))

    def write() -> int:
        layout = TarLayout(tree, f"/{shard}")
        with open("/dev/null", "wb") as out:
            layout.write_to(out)
        return layout.size
    cpu = time.process_time()
    run = harness.timed(write)
    print(run.seconds, run.answer, time.process_time() - cpu)


def export_seconds(atlas: str, shard: str) -> tuple[float, int, float]:
    """:func:`export_in_process` in a fresh process: (seconds, tar bytes, CPU seconds)."""
    code = "import sys\nfrom bench.tarview import export_in_process\nexport_in_process(sys.argv[1], sys.argv[2])\n"
    out = subprocess.run([sys.executable, "-c", code, atlas, shard], capture_output=True, text=True, check=True,
                         cwd=harness.REPO).stdout.split()
    return float(out[0]), int(out[1]), float(out[2])


def cpu_seconds(pid: int | None) -> float:
    """User and system CPU seconds of process ``pid`` so far, its threads included (0 without one)."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cat(path: str) -> float:
    """Seconds of ``cat PATH > /dev/null``."""
    return harness.timed(lambda: subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)).seconds


def run(name: str, workdir: str, scratch: str, repeat: int, smoke: bool, view: str = "tars") -> dict[str, float]:
    """MB/s of every figure (medians) for shard 0 of dataset ``name``, the tar read through an
    ``atlasfs mount --view VIEW`` (tars, or both: the per-sample files beside it)."""
    prepared = datagen.prepare(datagen.spec_for(name, smoke=smoke), workdir, harness.log)
    shard = prepared.shards[0]
    system = Atlasfs(prepared.atlas, prepared.shards, os.path.join(workdir, name, "tarview-state"),
                     extra_args=["--view", view])
    system.prepare_metadata()  # atlasfs index: the tables stored beside the dataset
    tmpfs_tar = os.path.join(scratch, f"{name}-{shard}.tar")
    shutil.copyfile(os.path.join(prepared.tars, f"{shard}.tar"), tmpfs_tar)
    figures: dict[str, list[float]] = {"export": [], "cold cat": [], "warm cat": [], "tmpfs cat": [],
                                       "export cpu ms": [], "cold cat daemon cpu ms": [], "cold / export": []}
    size = os.path.getsize(tmpfs_tar)
    for _ in range(repeat):
        seconds, exported, export_cpu = export_seconds(prepared.atlas, shard)
        if exported != size:
            raise RuntimeError(f"{name}: the export's tar has {exported} bytes, the exported file {size}")
        figures["export"].append(size / seconds)
        figures["export cpu ms"].append(export_cpu * 1e3)
        with system.session() as view:
            tar = os.path.join(view.root, f"{shard}.tar")
            before = cpu_seconds(view.pid)
            figures["cold cat"].append(size / cat(tar))
            figures["cold / export"].append(figures["cold cat"][-1] / figures["export"][-1])
            figures["cold cat daemon cpu ms"].append((cpu_seconds(view.pid) - before) * 1e3)
            figures["warm cat"].append(size / cat(tar))
            if subprocess.run(["cmp", tar, tmpfs_tar]).returncode != 0:
                raise RuntimeError(f"{name}: the mounted tar differs from the export")
        cat(tmpfs_tar)
        figures["tmpfs cat"].append(size / cat(tmpfs_tar))
    result = {key: statistics.median(values) / (1e6 if key in MB_PER_S else 1) for key, values in figures.items()}
    result["cold / export min"], result["cold / export max"] = min(figures["cold / export"]), max(figures["cold / export"])
    result["tar MB"] = size / 1e6
    return result


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=3)
    p.add_argument("--datasets", default="image,text,tiny")
    p.add_argument("--view", choices=("tars", "both"), default="tars",
                   help="the mount's view the tar is read through (default tars)")
    args = harness.parse(p, argv)
    rows, data = [], {}
    with harness.workspace("tarview", args) as ws:
        for name in [d.strip() for d in args.datasets.split(",") if d.strip()]:
            r = data[name] = run(name, ws.workdir, ws.scratch, args.repeat, args.smoke, args.view)
            rows.append([name, f"{r['tar MB']:.1f}", f"{r['export']:.0f}", f"{r['cold cat']:.0f}",
                         f"{r['cold cat'] / r['export']:.2f}",
                         f"{r['cold / export']:.2f} ({r['cold / export min']:.2f}-{r['cold / export max']:.2f})",
                         f"{r['warm cat']:.0f}", f"{r['tmpfs cat']:.0f}",
                         f"{r['warm cat'] / r['tmpfs cat']:.2f}", f"{r['export cpu ms']:.0f}",
                         f"{r['cold cat daemon cpu ms']:.0f}"])
            harness.log(" | ".join(rows[-1]))
    body = [f"Shard 0 of each set, tables stored, MB/s, median of {args.repeat}; the tar read through "
            f"`atlasfs mount --view {args.view}`.", ""]
    body += harness.table(["set", "tar MB", "export", "cold cat", "cold / export (>= 0.9)",
                           "cold / export, each repeat: median (range)", "warm cat", "tmpfs cat",
                           "warm / tmpfs (>= 0.7)", "export CPU ms", "cold cat: daemon CPU ms"], rows)
    harness.write_report("tarview", args, "the tar view against export and tmpfs", body,
                         harness.meta("tarview.py", args), {"datasets": data})
    return 0


if __name__ == "__main__":
    harness.run_main(main)
