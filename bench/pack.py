#!/usr/bin/env python3
"""``atlasfs pack`` against its yardsticks, in one run (issue #28).

For each of the benchmark's datasets (bench/datagen.py: its WebDataset tars are the source),
times, medians of ``--repeat`` runs:

* ``pack``: ``atlasfs pack TARS OUT --strategy S`` for each strategy (a subprocess, as a user
  runs it; ``-j 1``), its files/s and MB/s of the tars read;
* ``tar cf``: GNU tar writing the same files, extracted on tmpfs, into one tar (files/s);
* ``writer``: atlasfs's ``AtlasWriter`` alone (the reference writer's rules, in process, from
  the samples already in memory): the rate of the format's writing without reading a source;
* ``reference``: the reference implementation's ``AtlasDatasetWriter`` (torch-atlas-ds) on the
  same samples, in the Python ``--reference-python`` names (one where ``torch_atlas_ds`` imports;
  it is not on PyPI, so this column is measured only where one is at hand, else "missing");

and each packed dataset's size against the tars' (the point of Atlas: dictionary compression of
small samples). Every packed dataset is checked: its ``atlasfs export`` holds the source's files.

With ``--ray``, also ``pack -j 2`` and ``pack --ray ADDRESS`` on one local Ray cluster of two
CPUs started for the run (bench/raycluster.py): Ray's overhead on one node is their ratio
(issue #38: at most 1.15), and each must write the bytes of ``-j 1``. The start-up of a
cluster for one command is timed once beside it.

    python bench/pack.py [--smoke] [--repeat N] [--datasets image,text,tiny] [--examples N]
                         [--strategies 1,2] [--reference-python PYTHON] [--ray]

``--examples N`` sizes every chosen set (its shard and block sizes kept: more shards): a set
where ``pack -j 2`` runs a minute and more, so that Ray's fixed cost (seconds) is not the figure.

Report: bench/results/pack.md and pack.json.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tarfile

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import datagen, harness


def _atlasfs(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "atlasfs", *args], check=True, capture_output=True)


def _members(tars: str) -> list[tuple[str, bytes]]:
    """Every file of every tar under ``tars`` (shards in name order), as (shard/name, bytes)."""
    out = []
    for name in sorted(f for f in os.listdir(tars) if f.endswith(".tar")):
        with tarfile.open(os.path.join(tars, name)) as archive:
            out += [(f"{name[:-4]}/{m.name}", archive.extractfile(m).read())  # type: ignore[union-attr]
                    for m in archive if m.isfile()]
    return out


def _samples(members: list[tuple[str, bytes]]) -> list[dict[str, object]]:
    """The members grouped as webdataset groups them (adjacent, key = name up to the first dot)."""
    samples: list[dict[str, object]] = []
    for path, data in members:
        shard, _, name = path.partition("/")
        folder, _, base = name.rpartition("/")
        key, _, field = base.partition(".")
        key = f"{folder}/{key}" if folder else key
        if not samples or samples[-1]["__key__"] != key:
            samples.append({"__key__": key})
        samples[-1][field] = data
    return samples


#: What the reference writer runs, in its own Python: write the pickled samples, print the seconds.
_REFERENCE = """
import pickle, sys, time
from torch_atlas_ds import AtlasDatasetWriter, CompressionStrategy
samples_path, out, shard_size, block_size, strategy = sys.argv[1:6]
with open(samples_path, "rb") as f:
    samples = pickle.load(f)
start = time.perf_counter()
with AtlasDatasetWriter(out, shard_size=int(shard_size), block_size=int(block_size),
                        compression_strategy=CompressionStrategy(int(strategy))) as writer:
    for sample in samples:
        writer.add_example(sample)
print(time.perf_counter() - start)
"""


def reference_seconds(python: str, samples_path: str, out: str, shard_size: int, strategy: int) -> float:
    """Seconds the reference writer takes to write the samples at ``samples_path`` (a subprocess)."""
    result = subprocess.run([python, "-c", _REFERENCE, samples_path, out, str(shard_size), "64", str(strategy)],
                            capture_output=True, text=True, check=True)
    shutil.rmtree(out)
    return float(result.stdout.split()[-1])


def _same(a: str, b: str) -> bool:
    """Whether folders ``a`` and ``b`` hold the same files, byte for byte."""
    return subprocess.run(["diff", "-r", "-q", a, b], capture_output=True).returncode == 0


def run(name: str, workdir: str, scratch: str, repeat: int, smoke: bool, strategies: list[int],
        reference: str | None, ray: str | None = None, examples: int | None = None) -> dict:
    prepared = datagen.prepare(datagen.spec_for(name, examples, smoke=smoke), workdir, harness.log)
    extracted = os.path.join(scratch, f"{name}-files")
    datagen.materialize(prepared, extracted)
    members = _members(prepared.tars)
    files = len(members)
    source_bytes = sum(len(data) for _, data in members)
    tar_bytes = sum(os.path.getsize(os.path.join(prepared.tars, f)) for f in os.listdir(prepared.tars)
                    if f.endswith(".tar"))
    figures: dict[str, object] = {"files": files, "source MB": source_bytes / 1e6, "tars bytes": tar_bytes,
                                  "tars": prepared.tars}
    gnu = []
    for _ in range(repeat):
        out = os.path.join(scratch, f"{name}.tar")
        gnu.append(harness.timed(lambda: subprocess.run(["tar", "cf", out, "-C", extracted, "."], check=True)).seconds)
        os.unlink(out)
    figures["tar cf files/s"] = files / statistics.median(gnu)
    samples = _samples(members)
    samples_path = os.path.join(scratch, f"{name}-samples.pkl")
    with open(samples_path, "wb") as f:
        pickle.dump(samples, f)
    from atlasfs import AtlasWriter
    for strategy in strategies:
        packs, writes, references, size = [], [], [], 0
        parallel: dict[str, list[float]] = {"-j 2": [], "--ray": []}
        loads: dict[str, list[float]] = {"-j 2": [], "--ray": []}
        for _ in range(repeat):
            out = os.path.join(scratch, f"{name}-packed-{strategy}")
            shutil.rmtree(out, ignore_errors=True)
            packs.append(harness.timed(lambda: _atlasfs("pack", prepared.tars, out, "--strategy", str(strategy),
                                                        "-j", "1")).seconds)
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
            exported = os.path.join(scratch, f"{name}-export-{strategy}")
            shutil.rmtree(exported, ignore_errors=True)
            _atlasfs("export", out, exported)
            if sorted(data for _, data in _members(exported)) != sorted(data for _, data in members):
                raise SystemExit(f"pack: {name}, strategy {strategy}: the packed dataset does not hold the source's files")
            shutil.rmtree(exported)
            if ray:  # the same pack on two processes, then as Ray tasks: the same bytes
                for column, flags in (("-j 2", ["-j", "2"]), ("--ray", ["--ray", ray])):
                    other = os.path.join(scratch, f"{name}-packed-{strategy}-other")
                    shutil.rmtree(other, ignore_errors=True)
                    parallel[column].append(harness.timed(lambda: _atlasfs(
                        "pack", prepared.tars, other, "--strategy", str(strategy), *flags)).seconds)
                    loads[column].append(os.getloadavg()[0])  # the machine's load over that run, about
                    if not _same(out, other):
                        raise SystemExit(f"pack {' '.join(flags)}: {name}, strategy {strategy}: other bytes than -j 1")
                    shutil.rmtree(other)
            written = os.path.join(scratch, f"{name}-writer-{strategy}")
            shutil.rmtree(written, ignore_errors=True)

            def write(path: str = written) -> None:
                with AtlasWriter(path, shard_size=prepared.spec.shard_size, block_size=64,
                                 compression_strategy=strategy) as writer:
                    writer.add_examples(samples)
            writes.append(harness.timed(write).seconds)
            shutil.rmtree(written)
            if reference:
                references.append(reference_seconds(reference, samples_path, written, prepared.spec.shard_size,
                                                    strategy))
            shutil.rmtree(out)
        figures[f"s{strategy}"] = {"pack s": statistics.median(packs), "writer s": statistics.median(writes),
                                   "reference s": statistics.median(references) if references else None,
                                   "bytes": size, "shards": len(prepared.shards),
                                   **({"pack -j 2 s": statistics.median(parallel["-j 2"]),
                                       "pack --ray s": statistics.median(parallel["--ray"]),
                                       "runs -j 2 s": parallel["-j 2"], "runs --ray s": parallel["--ray"],
                                       "load after -j 2": loads["-j 2"], "load after --ray": loads["--ray"]}
                                      if ray else {})}
    shutil.rmtree(extracted)
    os.unlink(samples_path)
    return figures


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=3)
    p.add_argument("--datasets", default="image,text,tiny")
    p.add_argument("--examples", type=int, metavar="N",
                   help="examples of each set (default: the set's own; more gives more shards of the same size)")
    p.add_argument("--strategies", default="1,2", help="Atlas compression strategies to pack with (default 1,2)")
    p.add_argument("--reference-python", metavar="PYTHON",
                   help="a Python in which torch_atlas_ds (the reference writer) imports (default: its column missing)")
    p.add_argument("--ray", action="store_true", help="also pack -j 2 and pack --ray on a local Ray cluster")
    args = harness.parse(p, argv)
    if args.ray:
        from bench import raycluster
        with raycluster.cluster() as address:
            return _report(args, address)
    return _report(args, None)


def _report(args: argparse.Namespace, ray: str | None) -> int:
    """Run every dataset and write the report (``ray``: the cluster of the --ray columns)."""
    strategies = [int(s) for s in args.strategies.split(",")]
    results, rows, ray_rows = {}, [], []
    with harness.workspace("pack", args) as ws:
        for name in args.datasets.split(","):
            harness.log(f"{name}: packing")
            r = results[name] = run(name, ws.workdir, ws.scratch, args.repeat, args.smoke, strategies,
                                    args.reference_python, ray, args.examples)
            files = int(r["files"])  # type: ignore[call-overload]
            for strategy in strategies:
                s = r[f"s{strategy}"]
                rows.append([name, str(strategy), f"{files / s['pack s']:,.0f}", f"{r['source MB'] / s['pack s']:.1f}",
                             f"{files / s['pack s'] / r['tar cf files/s']:.2f}",
                             f"{files / s['writer s']:,.0f}",
                             f"{files / s['reference s']:,.0f}" if s["reference s"] else "missing",
                             f"{s['bytes'] / r['tars bytes']:.2f}"])
                if ray:
                    ray_rows.append([name, str(strategy), f"{s['pack s']:.2f}", f"{s['pack -j 2 s']:.2f}",
                                     f"{s['pack --ray s']:.2f}", f"{s['pack --ray s'] / s['pack -j 2 s']:.2f}",
                                     f"{s['pack s'] / s['shards']:.3f}",
                                     " / ".join(f"{x:.1f}" for x in s["load after -j 2"]),
                                     " / ".join(f"{x:.1f}" for x in s["load after --ray"])])
        if ray:
            from bench import raycluster
            results["ray startup s"] = raycluster.startup_seconds(str(r["tars"]))
    sized = f" ({args.examples:,} examples a set)" if args.examples else ""
    body = [f"Medians of {args.repeat or 1}{sized}. pack ÷ tar cf: files/s of `atlasfs pack` (a subprocess, -j 1) over GNU tar's into one tar "
            "of the same files on tmpfs; writer: AtlasWriter alone, in process; reference: torch-atlas-ds's "
            "AtlasDatasetWriter on the same samples; size: the packed dataset's bytes over the WebDataset tars'.", "",
            *harness.table(["set", "strategy", "pack files/s", "pack MB/s in", "pack ÷ tar cf", "writer files/s",
                            "reference files/s", "size ÷ tars"], rows)]
    if ray:
        body += ["", "Ray on this machine (2 CPUs): seconds of `pack -j 1`, `pack -j 2` and `pack --ray ADDRESS` on a "
                 "local cluster of 2 CPUs started once for the run; --ray ÷ -j 2 is Ray's overhead on one node (target "
                 "<= 1.15); per shard: -j 1's seconds per shard (one process). A cluster started for one command "
                 f"(`--ray` with no address) adds {results['ray startup s']:.1f} s (verify's, measured once).", "",
                 *harness.table(["set", "strategy", "-j 1 s", "-j 2 s", "--ray s", "--ray ÷ -j 2", "s per shard (-j 1)",
                                 "load after -j 2", "load after --ray"], ray_rows),
                 "", "load after: the 1-minute load average as each run ended (2 cores: above 2, other work "
                 f"shared them); at the end of the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())}."]
    meta = harness.meta("pack.py", args)
    harness.write_report("pack", args, "atlasfs pack: throughput and size", body, meta, {"results": results})
    return 0


if __name__ == "__main__":
    harness.run_main(main)
