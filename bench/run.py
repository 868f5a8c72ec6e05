#!/usr/bin/env python3
"""The atlasfs benchmark: atlasfs against tmpfs (the physical limit) and ratarmount (the peer),
on three synthetic datasets, with the same commands for every system.

    python bench/run.py                 # the default run (a few minutes on 2 cores): bench/results/latest.*
    python bench/run.py --smoke         # tiny sizes, 1 repeat (CI): bench/results/smoke/latest.*
    python bench/run.py --datasets image --repeat 5 --image 3000 --workdir /var/tmp/ab

See docs/performance.md for what each figure means.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import datagen, harness, report, systems, workloads
from bench._atlasfs import default_cache_bytes
from bench.report import Results
from bench.systems import System, View

MB = 1e6
#: The system name of the ``--views both`` mount (``atlasfs mount --view both``).
VIEW_BOTH = "atlasfs-view-both"
#: Figures over the whole mount, where --view both shows the tar view's files beside the
#: per-sample ones: reported, not held to the per-sample files' comparison.
WHOLE_MOUNT = ("find_cold_s", "find_warm_s", "lsR_cold_s", "lsR_warm_s", "du_cold_s", "du_warm_s")
#: How close --view both must be to --view files on every per-sample figure (issue #36).
VIEWS_WITHIN = 0.05
#: Reader processes of the parallel random reads (issue #27).
READERS = (1, 4)
log = harness.log


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, repeat=3)
    p.add_argument("--datasets", default="image,text,tiny",
                   help="comma-separated subset of image,text,tiny (default: all three)")
    for name, spec in datagen.DEFAULTS.items():
        p.add_argument(f"--{name}", type=int, metavar="N",
                       help=f"examples in the {name}-like dataset (default {spec.examples:,}; "
                            f"--smoke: {datagen.SMOKE_EXAMPLES[name]})")
    p.add_argument("--reads", type=int, help="random reads a pass (default 1000, --smoke 200)")
    p.add_argument("--parallel-reads", type=int, metavar="N",
                   help="files read by the parallel readers together (default 3000, --smoke 300)")
    p.add_argument("--views", default="files",
                   help="atlasfs mounts measured in the same run: files (the suite's atlasfs), and with both an "
                        "'atlasfs --view both' mount of the same dataset, reported against it in views.md "
                        "(default: files)")
    harness.add_ratarmount_args(p)
    args = harness.parse(p, argv)
    args.views = [v.strip() for v in args.views.split(",") if v.strip()]
    if "files" not in args.views or not set(args.views) <= {"files", "both"}:
        p.error("--views: files, or files,both")
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    unknown = [d for d in args.datasets if d not in datagen.DEFAULTS]
    if unknown or not args.datasets:
        p.error(f"--datasets: unknown {unknown} (choose from {', '.join(datagen.DEFAULTS)})")
    args.reads = args.reads or (200 if args.smoke else 1000)
    args.parallel_reads = args.parallel_reads or (300 if args.smoke else 3000)
    if args.reads < 1 or args.parallel_reads < 1:
        p.error("--reads and --parallel-reads must be >= 1")
    return args


# -- one dataset


class Bench:
    """Runs every workload of one dataset on every system, ``repeat`` times."""

    def __init__(self, prepared: datagen.Prepared, systems_: list[System], unavailable: dict[str, str],
                 reads: list[str], parallel: list[str], scratch: str) -> None:
        self.p = prepared
        self.systems = systems_
        self.reads = reads
        self.parallel = parallel
        self.scratch = scratch
        self.results = Results()
        for name, reason in unavailable.items():
            for f in report.FIGURES:
                if name in f.systems:
                    self.results.fail(f.id, name, reason)

    @contextlib.contextmanager
    def session(self, system: System, figures: list[str], fresh: bool, rss: list[int]) -> Iterator[View | None]:
        """A fresh mount of ``system`` (None if it failed); a failure makes ``figures`` missing for it
        (with the reason) instead of stopping the run. Records the mount time and the daemon's peak RSS."""
        mount_figure = "mount_first_s" if fresh else "mount_s"
        errors = (workloads.WorkloadError, RuntimeError, OSError)

        def failed(exc: BaseException) -> None:
            log(f"  {system.name}: FAILED: {exc}")
            for f in figures + ([mount_figure] if system.name != "tmpfs" else []):
                self.results.fail(f, system.name, f"failed: {exc}"[:300])

        with contextlib.ExitStack() as stack:
            try:
                view = stack.enter_context(system.session(fresh_metadata=fresh))
            except errors as exc:
                failed(exc)
                yield None
                return
            if view.mount_seconds is not None:
                self.results.add(mount_figure, system.name, view.mount_seconds)
            try:
                yield view
            except errors as exc:
                failed(exc)
            peak = view.peak_rss()
            if peak is not None:
                rss.append(peak)

    def tar(self, view: View, mbps: str, fps: str) -> None:
        timed = workloads.tar_all(view, self.p.shards)
        self.results.add(mbps, view.system, self.p.file_bytes / timed.seconds / MB)
        self.results.add(fps, view.system, self.p.files / timed.seconds)
        self.results.answer("tar bytes of every shard", view.system, timed.answer)

    def cats(self, view: View, kind: str) -> None:
        reads = workloads.random_reads(view, self.reads)
        self.results.add(f"cat_{kind}_fps", view.system, len(self.reads) / reads.seconds)
        self.results.add(f"cat_{kind}_p50_ms", view.system, reads.percentile(50) * 1e3)
        self.results.add(f"cat_{kind}_p99_ms", view.system, reads.percentile(99) * 1e3)
        self.results.answer("random reads (bytes, crc32)", view.system, (reads.nbytes, reads.checksum))

    def command(self, view: View, figure: str, run: Callable[[View], workloads.Timed], what: str) -> None:
        timed = run(view)
        self.results.add(figure, view.system, timed.seconds)
        if what:
            if view.system == VIEW_BOTH and figure in WHOLE_MOUNT:  # the view's tars and indexes are counted too
                what = f"{what} ({VIEW_BOTH})"
            self.results.answer(what, view.system, timed.answer)

    def repeat_once(self, system: System) -> None:
        """Every session of one repeat on one system, each on its own fresh mount."""
        name = system.name
        first = self.p.shards[0]
        rss: list[int] = []
        log(f"  {name}: first mount ever, first listing")
        with self.session(system, ["ls_first_nostore_s"], True, rss) as view:
            if view:
                self.command(view, "ls_first_nostore_s", lambda v: workloads.list_shard(v, first),
                             f"ls of shard {first}")
        log(f"  {name}: first mount ever, tar")
        with self.session(system, ["tar_first_mbps", "tar_first_fps"], True, rss) as view:
            if view:
                self.tar(view, "tar_first_mbps", "tar_first_fps")
        if system.name != "tmpfs":
            system.prepare_metadata()  # complete the stored tables / index whatever the tar pass did
        log(f"  {name}: first listing")
        with self.session(system, ["ls_first_s"], False, rss) as view:
            if view:
                self.command(view, "ls_first_s", lambda v: workloads.list_shard(v, first), f"ls of shard {first}")
        log(f"  {name}: tar cold, warm")
        with self.session(system, ["tar_cold_mbps", "tar_cold_fps", "tar_warm_mbps", "tar_warm_fps"],
                          False, rss) as view:
            if view:
                self.tar(view, "tar_cold_mbps", "tar_cold_fps")
                self.tar(view, "tar_warm_mbps", "tar_warm_fps")
        log(f"  {name}: {len(self.reads)} random reads cold, warm")
        cat_figures = [f"cat_{k}_{m}" for k in ("cold", "warm") for m in ("fps", "p50_ms", "p99_ms")]
        with self.session(system, cat_figures, False, rss) as view:
            if view:
                self.cats(view, "cold")
                self.cats(view, "warm")
        for readers in READERS:
            log(f"  {name}: {len(self.parallel)} random reads by {readers} reader(s) at once, cold")
            figure = f"par{readers}_fps"
            with self.session(system, [figure], False, rss) as view:
                if view:
                    timed = workloads.parallel_reads(view, self.parallel, readers)
                    self.results.add(figure, name, len(self.parallel) / timed.seconds)
                    self.results.answer(f"parallel reads by {readers} (cksum of each)", name, timed.answer)
        for prefix, run, what in (("find", workloads.find_files, "find -type f | wc -l"),
                                  ("lsR", workloads.ls_recursive, "ls -lR | wc -l"),
                                  ("du", workloads.du_bytes, "")):
            log(f"  {name}: {prefix} cold, warm")
            with self.session(system, [f"{prefix}_cold_s", f"{prefix}_warm_s"], False, rss) as view:
                if view:
                    self.command(view, f"{prefix}_cold_s", run, what)
                    self.command(view, f"{prefix}_warm_s", run, what)
        if system.name != "tmpfs":
            if rss:
                self.results.add("rss_mib", name, max(rss) / 2**20)
            else:
                self.results.fail("rss_mib", name, "no session succeeded")

    def in_process(self) -> None:
        """The limits of atlasfs without FUSE."""
        p = self.p
        log("  atlasfs export, library loop, one shard's decode")
        for figure, run in (("export", lambda: workloads.export_tars(p.atlas, self.scratch)),
                            ("startup", workloads.command_startup),
                            ("loop", lambda: workloads.library_loop(p.atlas)),
                            ("decode", lambda: workloads.decode_shard(p.atlas, 0))):
            try:
                timed = run()
            except Exception as exc:  # reported as missing, the run goes on
                log(f"  {figure}: FAILED: {exc}")
                ids = {"export": ["export_mbps", "export_fps"], "loop": ["loop_eps", "loop_mbps"],
                       "startup": ["startup_s"],
                       "decode": ["decode_shard_s"]}[figure]
                for f in ids:
                    self.results.fail(f, "atlasfs", f"failed: {exc}"[:300])
                continue
            if figure == "export":
                self.results.add("export_mbps", "atlasfs", p.file_bytes / timed.seconds / MB)
                self.results.add("export_fps", "atlasfs", p.files / timed.seconds)
                # export's members carry no "./" prefix and no folder entry, unlike `tar -C DIR .`:
                # its tars are checked against the ones made when the data was generated
                self.results.answer("atlasfs export: tar bytes", "atlasfs export", timed.answer)
                self.results.answer("atlasfs export: tar bytes", "expected", p.tar_bytes)
            elif figure == "loop":
                self.results.add("loop_eps", "atlasfs", p.spec.examples / timed.seconds)
                self.results.add("loop_mbps", "atlasfs", p.file_bytes / timed.seconds / MB)
                self.results.answer("examples", "library loop", timed.answer)
                self.results.answer("examples", "expected", p.spec.examples)
            elif figure == "startup":
                self.results.add("startup_s", "atlasfs", timed.seconds)
            else:
                self.results.add("decode_shard_s", "atlasfs", timed.seconds)


def warm_up(systems_: list[System]) -> None:
    """One untimed mount of every system, so that the first timed one does not pay for loading
    programs and libraries from disk."""
    for system in systems_:
        with contextlib.suppress(Exception), system.session():
            pass


def run_dataset(name: str, args: argparse.Namespace, workdir: str, shm: str, ratarmount: str | None,
                unavailable: dict[str, str]) -> tuple[dict[str, Any], Results]:
    spec = datagen.spec_for(name, getattr(args, name), args.smoke)
    prepared = datagen.prepare(spec, workdir, log)
    log(f"{name}: {prepared.files:,} files, {prepared.file_bytes / MB:.1f} MB, {len(prepared.shards)} shards"
        + (" (reused)" if prepared.reused else f" (generated in {prepared.generate_seconds:.1f} s)"))
    folder = os.path.join(shm, name)
    datagen.materialize(prepared, folder)
    try:
        files = datagen.file_list(folder)
        if len(files) != prepared.files:
            raise RuntimeError(f"{name}: {len(files)} files extracted, {prepared.files} expected")
        reads = workloads.pick_files(files, args.reads, seed=spec.seed)
        parallel = workloads.pick_files(files, args.parallel_reads, seed=spec.seed + 1)
        state = os.path.join(workdir, name, "state")
        shutil.rmtree(state, ignore_errors=True)
        os.makedirs(state)
        systems_: list[System] = [systems.Tmpfs(folder, prepared.shards),
                                  systems.Atlasfs(prepared.atlas, prepared.shards, state)]
        if ratarmount:
            systems_.append(systems.Ratarmount(ratarmount, prepared.tars, prepared.shards, state))
        if "both" in args.views:  # the same dataset under --view both, its own state folder
            both_state = os.path.join(workdir, name, "state-view-both")
            shutil.rmtree(both_state, ignore_errors=True)
            os.makedirs(both_state)
            both = systems.Atlasfs(prepared.atlas, prepared.shards, both_state, extra_args=["--view", "both"])
            both.name = VIEW_BOTH
            systems_.append(both)
        bench = Bench(prepared, systems_, unavailable, reads, parallel, shm)
        r = bench.results
        r.answer("find -type f | wc -l", "expected", prepared.files)
        with systems_[0].session() as extracted:  # the files as extracted from the tars
            expected = workloads.random_reads(extracted, reads)
        r.answer("random reads (bytes, crc32)", "expected", (expected.nbytes, expected.checksum))
        warm_up(systems_)
        for i in range(args.repeat):
            log(f"{name}: repeat {i + 1}/{args.repeat}")
            for system in systems_:
                bench.repeat_once(system)
            bench.in_process()
        for problem in r.mismatches():
            log(f"{name}: WARNING: {problem}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    info = {"description": spec.description, "examples": spec.examples, "files": prepared.files,
            "file_bytes": prepared.file_bytes, "atlas_bytes": prepared.atlas_bytes, "tar_bytes": prepared.tar_bytes,
            "shards": len(prepared.shards), "shard_size": spec.shard_size, "block_size": spec.block_size,
            "seed": spec.seed, "random_reads": len(reads), "parallel_reads": len(parallel)}
    return info, r


def views_report(args: argparse.Namespace, meta: dict[str, Any], all_results: dict[str, Results]) -> None:
    """views.md and views.json: every atlasfs figure under --view both against --view files,
    measured in the same run (each repeat mounts both in turn), as speed ratios (>= 1: --view
    both as fast or faster); per-sample figures must be within VIEWS_WITHIN."""
    rows, data = [], {}
    for name, results in all_results.items():
        for figure in report.FIGURES:
            if "atlasfs" not in figure.systems or figure.table == "inprocess":
                continue
            files, both = results.median(figure.id, "atlasfs"), results.median(figure.id, VIEW_BOTH)
            if files is None or both is None or not files or not both:
                rows.append([name, figure.id, "-", "-", "missing", ""])
                continue
            speed = both / files if figure.higher_is_better else files / both
            whole = figure.id in WHOLE_MOUNT or figure.table == "memory"
            verdict = "whole mount" if whole else ("ok" if speed >= 1 - VIEWS_WITHIN else "SLOWER")
            rows.append([name, figure.id, f"{files:.4g}", f"{both:.4g}", f"{speed:.3f}", verdict])
            data.setdefault(name, {})[figure.id] = {"files": files, "both": both, "speed": speed, "verdict": verdict}
    body = [f"`atlasfs mount --view both` against `--view files` (the suite's atlasfs), medians of {args.repeat} "
            f"repeats, each mounting both in turn. speed: --view both / --view files for higher-is-better figures, "
            f"the inverse for times (>= {1 - VIEWS_WITHIN:.2f}: within {VIEWS_WITHIN:.0%}). 'whole mount': "
            "`find`, `ls -lR`, `du` of the mount's root and the daemon's memory, where --view both also shows "
            "the tar view's files.", ""]
    body += harness.table(["set", "figure", "--view files", "--view both", "speed", ""], rows)
    harness.write_report("views", argparse.Namespace(**{**vars(args), "json": None}), "--view both against --view files",
                         body, meta, {"figures": data})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    notes: list[str] = []
    unavailable: dict[str, str] = {}
    ratarmount, ratarmount_version, reason = harness.ratarmount(args)
    if reason is not None:
        unavailable["ratarmount"] = reason
        notes.append(f"ratarmount figures are MISSING: {reason}")
    if harness.SHM is None:
        notes.append("/dev/shm is missing: the 'tmpfs' copy is in the default temporary folder")
    infos: dict[str, dict[str, Any]] = {}
    all_results: dict[str, Results] = {}
    # The backing files (Atlas dataset, tars, ratarmount indexes) are in the work folder, on
    # tmpfs by default (harness.SHM says why); the extracted copies are in the scratch folder.
    with harness.workspace("run", args) as ws:
        backing = harness.fstype(ws.workdir)
        notes.append(f"backing files (Atlas dataset, WebDataset tars, ratarmount indexes) are in {ws.workdir} "
                     f"({backing})" + ("" if backing == "tmpfs" else ": the FUSE figures include reads from that "
                                                                        "file system"))
        for name in args.datasets:
            infos[name], all_results[name] = run_dataset(name, args, ws.workdir, ws.scratch, ratarmount, unavailable)

    cache_bound = default_cache_bytes()
    meta = harness.meta("run.py", args, ratarmount=ratarmount_version,
                        tar=subprocess.run(["tar", "--version"], capture_output=True, check=False,
                                           text=True).stdout.splitlines()[0],
                        repeat=args.repeat, random_reads=args.reads, cache_bound_mib=cache_bound / 2**20,
                        notes=notes, unavailable=unavailable)
    if "both" in args.views:
        views_report(args, meta, all_results)
    targets = report.evaluate_targets(all_results, cache_bound / 2**20)
    harness.write_report("latest", args, "atlasfs benchmark", report.markdown(meta, infos, all_results, targets),
                         meta, report.to_json(infos, all_results, targets))
    problems = [p for r in all_results.values() for p in r.mismatches()]
    missing = [f"{ds} {f.id} {s}" for ds, r in all_results.items() for f in report.FIGURES for s in f.systems
               if s not in unavailable and "median" not in r.stats(f.id, s)]
    if problems or missing:
        log(f"{len(problems)} mismatched answer(s), {len(missing)} missing figure(s): {missing[:5]}")
        return 2
    return 0


if __name__ == "__main__":
    harness.run_main(main)
