#!/usr/bin/env python3
"""Ten million files in one run (issue #26): memory, listing, tar, random reads and export,
beside ratarmount 1.3.0 mounting the same files as WebDataset tars.

    python bench/scale.py                  # 10,000,000 files; data kept in /dev/shm/atlasfs-scale (~11 GiB)
    python bench/scale.py --files 2000000  # a quicker real run (another size writes the kept data again)
    python bench/scale.py --smoke          # 20,000 files in 4 shards, seconds (tests/bench/test_bench_scale.py)

The data (bench/scaledata.py, written once and kept): ``--files``/2 examples of ``txt`` (100-300
bytes of English-like text) and ``cls`` (an int), in shards of 100,000 examples, blocks of 256,
strategy 1; and ``atlasfs export`` of it, one tar per shard (~1 KiB a file). Every mount is a fresh
``atlasfs mount -f --cache-size 64M`` daemon (or a fresh ratarmount), its RSS read from /proc:

1. nothing stored (the dataset's ``.atlasfs-tables`` and the user's table cache removed): mount,
   ``find MNT -type f | wc -l``, RSS after; ratarmount with no index: index and mount, ``find``;
2. ``atlasfs index -j 2`` (tables stored beside the dataset);
3. tables stored: mount, ``find``, RSS; ratarmount with its index stored: mount, ``find``;
4. ``tar cf - -C MNT/<shard> . | wc -c`` for every shard in turn (each byte count checked against
   the files written), RSS after and peak;
5. 16 threads reading random files for 30 s (bench/memory.py's readers: every read checked against
   bytes read through the Atlas library), the maximum RSS sampled every 20 ms;
6. ``atlasfs export -j 1`` and ``-j 2`` against GNU ``tar cf`` of the same files extracted on tmpfs
   (bench/export.py's), on a SUBSET of ``--export-shards`` shards: all 10M files extracted would
   take a 4 KiB tmpfs page each.

``--listing-only`` runs 1-3 alone (issue #39, point 5: the stored-table ``find`` against
ratarmount's, minutes rather than an hour at 10M).

Then the issue's targets, each with its figure. The exit code is 0 when every figure was measured,
every RSS is within the cache bound + 100 MiB, no byte was wrong and every count matched, 2
otherwise; the speed targets are reported, not part of the exit code. Report: bench/results/scale.md
and scale.json.
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shlex
import shutil
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import export, harness, memory, scaledata, systems
from bench._atlasfs import parse_size
from bench.memory import Figure, rss, shell
from bench.systems import View

MiB = 1 << 20
log = harness.log
#: The kept data's folder of a full run (reused by later runs: writing 10M files takes minutes).
DEFAULT_WORKDIR = os.path.join(harness.SHM or "/tmp", "atlasfs-scale")
DEFAULT_FILES, SMOKE_FILES = 10_000_000, 20_000
DEFAULT_SHARD, SMOKE_SHARD = 100_000, 2_500
#: ratarmount indexes every tar before its mount answers: minutes at 10M files.
MOUNT_TIMEOUT = 3600.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, repeat=None)
    harness.add_ratarmount_args(p)
    p.add_argument("--files", type=int,
                   help=f"files (two an example; default {DEFAULT_FILES:,}, --smoke {SMOKE_FILES:,})")
    p.add_argument("--shard-examples", type=int,
                   help=f"examples a shard (default {DEFAULT_SHARD:,}, --smoke {SMOKE_SHARD:,})")
    p.add_argument("--cache-size", default="64M", help="the mounts' --cache-size (default 64M)")
    p.add_argument("--jobs", type=int, default=2, help="processes writing the data and of atlasfs index (default 2)")
    p.add_argument("--readers", type=int, default=16, help="concurrent random readers (default 16)")
    p.add_argument("--seconds", type=float, help="the random readers' phase (default 30, --smoke 2)")
    p.add_argument("--sample", type=int, help="examples whose files the readers read (default 20,000, --smoke 500)")
    p.add_argument("--export-shards", type=int, default=2, help="shards of the export figure (default 2)")
    p.add_argument("--listing-only", action="store_true",
                   help="figures 1-3 only (the listings and the index): minutes rather than an hour at 10M")
    args = harness.parse(p, argv)
    args.files = args.files or (SMOKE_FILES if args.smoke else DEFAULT_FILES)
    args.shard_examples = args.shard_examples or (SMOKE_SHARD if args.smoke else DEFAULT_SHARD)
    args.seconds = args.seconds if args.seconds is not None else (2.0 if args.smoke else 30.0)
    args.sample = args.sample or (500 if args.smoke else 20_000)
    args.cache_bytes = parse_size(args.cache_size)
    if args.files < 2 or args.shard_examples < 1 or args.export_shards < 1:
        p.error("--files must be >= 2, --shard-examples and --export-shards >= 1")
    if args.workdir is None and not args.smoke:
        args.workdir = DEFAULT_WORKDIR
    return args


class Run:
    """What one run measured: figures by phase, RSS beside its bound, checks, failures, and how
    long each phase took."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.figures: dict[str, dict[str, Any]] = {}
        self.rss: list[Figure] = []
        self.problems: list[str] = []
        self.missing: list[str] = []
        self.phase_seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A phase: timed; an exception is reported as its figures missing, and the run goes on."""
        log(name)
        start = time.monotonic()
        try:
            yield
        except Exception as exc:  # reported, never hidden: the exit code says so
            log(f"{name}: FAILED: {exc}")
            self.missing.append(f"{name}: {exc}"[:500])
        finally:
            self.phase_seconds[name] = time.monotonic() - start

    def memory(self, view: View, step: str, files: int, mounted: int, note: str = "") -> tuple[int, int]:
        """The daemon's RSS and peak now, recorded beside the bound (with its growth a file over
        ``mounted``, the RSS at mount)."""
        assert view.pid is not None
        now, peak = rss(view.pid)
        self.rss.append(Figure("atlasfs", step, now, peak, self.bound, files,
                               (note + "; " if note else "") + f"{(now - mounted) / files:.0f} B a file over "
                               f"the RSS at mount; {memory.mapped_and_anonymous(view.pid)}"))
        return now, peak

    def check(self, ok: bool, problem: str) -> None:
        if not ok:
            log(f"MISMATCH: {problem}")
            self.problems.append(problem)


def find(view: View, files: int, run: Run) -> tuple[float, float]:
    """``find MNT -type f | wc -l``: (seconds, files/s); the count checked."""
    timed = harness.timed(lambda: int(shell(f"find {shlex.quote(view.root)} -type f | wc -l")))
    run.check(timed.answer == files, f"{view.system}: find counted {timed.answer:,} files, {files:,} written")
    return timed.seconds, files / timed.seconds


def listing(run: Run, data: scaledata.Data, atlas: systems.Atlasfs, ratar: systems.Ratarmount | None,
            stored: bool) -> None:
    """Figures 1 (nothing stored) or 3 (tables / index stored): a mount and ``find``, each system."""
    key = "second" if stored else "first"
    what = "tables stored" if stored else "nothing stored"
    with run.phase(f"atlasfs {key} mount ({what}): find"):
        if not stored:
            atlas.clear_metadata()
        with atlas.session() as view:
            assert view.pid is not None
            mounted = rss(view.pid)[0]
            seconds, rate = find(view, data.files, run)
            now, peak = run.memory(view, f"after `find`, {key} mount ({what})", data.files, mounted)
        run.figures[f"atlasfs_{key}"] = {"mount_s": view.mount_seconds, "find_s": seconds, "find_fps": rate,
                                         "mount_find_fps": data.files / (view.mount_seconds + seconds),
                                         "rss": now, "peak": peak}
    if ratar is None:
        return
    with run.phase(f"ratarmount {key} mount ({'index stored' if stored else 'no index'}): find"):
        with ratar.session(fresh_metadata=not stored) as view:
            seconds, rate = find(view, data.files, run)
            assert view.pid is not None
            now, peak = rss(view.pid)
        run.figures[f"ratarmount_{key}"] = {"mount_s": view.mount_seconds, "find_s": seconds, "find_fps": rate,
                                            "mount_find_fps": data.files / (view.mount_seconds + seconds),
                                            "rss": now, "peak": peak}


def index(run: Run, data: scaledata.Data, atlas: systems.Atlasfs, jobs: int) -> None:
    """Figure 2: ``atlasfs index -j JOBS``, from nothing stored."""
    with run.phase(f"atlasfs index -j {jobs}"):
        shutil.rmtree(atlas.cache_home, ignore_errors=True)  # what the first mount stored: index builds all
        command = [sys.executable, "-m", "atlasfs", "index", "-j", str(jobs), data.atlas]
        timed = harness.timed(lambda: subprocess.run(command, capture_output=True, text=True, env=atlas.env,
                                                     check=False))
        if timed.answer.returncode != 0:
            raise RuntimeError(f"atlasfs index exited {timed.answer.returncode}: {timed.answer.stderr.strip()[-300:]}")
        run.figures["index"] = {"jobs": jobs, "seconds": timed.seconds, "fps": data.files / timed.seconds}


def tar_shards(run: Run, data: scaledata.Data, atlas: systems.Atlasfs) -> None:
    """Figure 4: ``tar cf - -C MNT/<shard> . | wc -c`` of every shard in turn, each byte count checked."""
    with run.phase("atlasfs: tar of every shard"), atlas.session() as view:
        assert view.pid is not None
        mounted = rss(view.pid)[0]
        seconds = 0.0
        top = 0
        for shard in data.shards:
            folder = shlex.quote(os.path.join(view.root, shard.name))
            timed = harness.timed(lambda: int(shell(f"tar cf - -C {folder} . | wc -c")))
            seconds += timed.seconds
            run.check(timed.answer == shard.tar_cf_bytes(),
                      f"tar of shard {shard.name}: {timed.answer:,} bytes, {shard.tar_cf_bytes():,} expected")
            top = max(top, rss(view.pid)[0])
        now, peak = run.memory(view, "after `tar` of every shard", data.files, mounted,
                               f"largest after a shard {top / MiB:.1f} MiB")
        run.figures["tar"] = {"seconds": seconds, "fps": data.files / seconds,
                              "mbps": sum(s.file_bytes for s in data.shards) / seconds / 1e6, "rss": now,
                              "peak": peak, "largest_after_a_shard": top}


def readers(run: Run, data: scaledata.Data, atlas: systems.Atlasfs, args: argparse.Namespace) -> None:
    """Figure 5: bench/memory.py's random readers on a fresh mount, every read checked."""
    with run.phase(f"atlasfs: {args.readers} random readers for {args.seconds:g} s"):
        expected = {path: (len(b), zlib.crc32(b)) for path, b in scaledata.sample(data, args.sample, 5).items()}
        reference = memory.Reference(memory.Dataset("scale", data.atlas, data.spec.examples, len(data.shards), 0))
        with atlas.session() as view:
            assert view.pid is not None
            reads, size, wrong, top, errors = memory.random_readers(view.root, expected, reference, view.pid,
                                                                    args.readers, args.seconds)
            now, peak = rss(view.pid)
        run.rss.append(Figure("atlasfs", f"max during {args.readers} random readers, {args.seconds:g} s", top,
                              max(top, peak), run.bound, data.files,
                              f"{reads:,} reads of {len(expected):,} files, {wrong} wrong bytes, {errors} errors"))
        run.check(wrong == 0 and errors == 0, f"random readers: {wrong} wrong bytes, {errors} errors")
        run.figures["readers"] = {"readers": args.readers, "seconds": args.seconds, "files": len(expected),
                                  "reads": reads, "bytes": size, "wrong_bytes": wrong, "errors": errors,
                                  "max_rss": top}


def export_subset(run: Run, data: scaledata.Data, scratch: str, count: int) -> None:
    """Figure 6: export -j 1 and -j 2 against ``tar cf`` of the same files extracted on tmpfs, on
    the first ``count`` shards; each export's tars must equal the kept ones."""
    shards = data.names[:count]
    files = sum(s.files for s in data.shards[:count])
    with run.phase(f"export against tar cf, {len(shards)} shards"):
        extracted = os.path.join(scratch, "files")
        try:
            for shard in shards:
                os.makedirs(os.path.join(extracted, shard))
                subprocess.run(["tar", "xf", os.path.join(data.tars, f"{shard}.tar"), "-C",
                                os.path.join(extracted, shard)], check=True)
            seconds = {"tar cf": export.tar_seconds(extracted, shards, os.path.join(scratch, "tar-cf"), 1)}
        finally:
            shutil.rmtree(extracted, ignore_errors=True)
        for jobs in (1, 2):
            out = os.path.join(scratch, f"export-{jobs}")
            seconds[f"export -j {jobs}"] = export.export_seconds(data.atlas, out, jobs, shards)
            for shard in shards:
                run.check(filecmp.cmp(os.path.join(out, f"{shard}.tar"), os.path.join(data.tars, f"{shard}.tar"),
                                      shallow=False), f"export -j {jobs}: {shard}.tar differs from the kept export")
            shutil.rmtree(out)
        run.figures["export"] = {"shards": shards, "files": files, "seconds": seconds,
                                 "fps": {name: files / s for name, s in seconds.items()}}


# -- the report


def targets(run: Run, listing_only: bool = False) -> list[dict[str, Any]]:
    """The issue's targets: each its figure, met or not; ``enforced`` ones decide the exit code
    (with ``listing_only``, those of the phases not run are left out)."""
    f = run.figures
    rows: list[dict[str, Any]] = []

    def add(target: str, measured: str | None, met: bool | None, enforced: bool) -> None:
        rows.append({"target": target, "measured": measured, "met": met, "enforced": enforced})

    for figure in run.rss:
        add(f"RSS <= cache + 100 MiB ({run.bound / MiB:.0f} MiB), {figure.step}",
            f"{figure.rss / MiB:.1f} MiB (peak {figure.peak / MiB:.1f})", figure.within, True)
    readers_ = f.get("readers")
    if not listing_only:
        add("0 wrong bytes under the random readers",
            None if readers_ is None else f"{readers_['wrong_bytes']} wrong, {readers_['errors']} errors",
            None if readers_ is None else readers_["wrong_bytes"] == readers_["errors"] == 0, True)

    def ratio(target: str, ours: str, theirs: str, key: str) -> None:
        if ours in f and theirs in f:
            value = f[ours][key] / f[theirs][key]
            add(target, f"{f[ours][key]:,.0f} / {f[theirs][key]:,.0f} files/s = {value:.2f}x", value >= 1, False)
        else:
            add(target, None, None, False)

    ratio("stored-table `find` >= ratarmount's stored-index `find` (files/s)", "atlasfs_second",
          "ratarmount_second", "find_fps")
    ratio("first mount + `find` >= ratarmount's index + mount + `find` (files/s)", "atlasfs_first",
          "ratarmount_first", "mount_find_fps")
    if "export" in f:
        fps = f["export"]["fps"]
        value = fps["export -j 2"] / fps["tar cf"]
        add("export (-j 2, the default here) >= 0.5x GNU tar cf's files/s (subset)",
            f"{value:.2f}x (-j 1: {fps['export -j 1'] / fps['tar cf']:.2f}x)", value >= 0.5, False)
    elif not listing_only:
        add("export >= 0.5x GNU tar cf's files/s (subset)", None, None, False)
    mounts = [f[k]["mount_s"] for k in ("atlasfs_first", "atlasfs_second") if k in f]
    add("atlasfs mount < 1 s (first and second mount)", f"{max(mounts):.2f} s" if mounts else None,
        max(mounts) < 1 if mounts else None, False)
    return rows


def body(run: Run, data: scaledata.Data, args: argparse.Namespace, target_rows: list[dict[str, Any]]) -> list[str]:
    """The report's tables."""
    f = run.figures
    files = data.files
    lines = harness.table(
        ["files", "examples", "shards", "examples a shard", "block", "atlas", "tars", "written"],
        [[f"{files:,}", f"{data.spec.examples:,}", str(len(data.shards)), f"{data.spec.shard_examples:,}",
          str(data.spec.block_size), f"{_dir_bytes(data.atlas) / MiB:,.1f} MiB",
          f"{_dir_bytes(data.tars) / MiB:,.1f} MiB",
          "reused" if data.reused else " + ".join(f"{k} {v:.0f} s" for k, v in data.seconds.items())]])
    lines += ["", "### Listing: `find MNT -type f | wc -l` on a fresh mount", ""]
    rows = []
    for key, label in (("atlasfs_first", "atlasfs, nothing stored"), ("ratarmount_first", "ratarmount, no index"),
                       ("atlasfs_second", "atlasfs, tables stored"), ("ratarmount_second", "ratarmount, index stored")):
        g = f.get(key)
        rows.append([label] + (["missing"] * 6 if g is None else [
            f"{g['mount_s']:.2f}", f"{g['find_s']:.1f}", f"{g['find_fps']:,.0f}", f"{g['mount_find_fps']:,.0f}",
            f"{g['rss'] / MiB:.1f}", f"{g['peak'] / MiB:.1f}"]))
    lines += harness.table(["", "mount s (ratarmount: index + mount)", "find s", "find files/s",
                            "(mount + find) files/s", "RSS after MiB", "peak MiB"], rows)
    g = f.get("index")
    lines += ["", f"`atlasfs index -j {args.jobs}` (between the two): "
              + ("missing" if g is None else f"{g['seconds']:.1f} s, {g['fps']:,.0f} files/s"), ""]
    lines += ["### `tar cf - -C MNT/<shard> . | wc -c`, every shard in turn, one fresh mount", ""]
    g = f.get("tar")
    lines += harness.table(["files", "seconds", "files/s", "MB/s of file data", "RSS after MiB", "peak MiB"],
                           [["missing"] * 6 if g is None else [
                               f"{files:,}", f"{g['seconds']:.1f}", f"{g['fps']:,.0f}", f"{g['mbps']:.1f}",
                               f"{g['rss'] / MiB:.1f}", f"{g['peak'] / MiB:.1f}"]])
    g = f.get("readers")
    lines += ["", f"### {args.readers} random readers, {args.seconds:g} s, one fresh mount", ""]
    lines += harness.table(["files read from", "reads", "MiB", "wrong bytes", "errors", "max RSS MiB"],
                           [["missing"] * 6 if g is None else [
                               f"{g['files']:,}", f"{g['reads']:,}", f"{g['bytes'] / MiB:.1f}", str(g["wrong_bytes"]),
                               str(g["errors"]), f"{g['max_rss'] / MiB:.1f}"]])
    g = f.get("export")
    lines += ["", f"### Export against GNU tar cf: a SUBSET, {args.export_shards} of {len(data.shards)} shards", "",
              "GNU `tar cf` (one process, one shard after the other) of the shards' files extracted on tmpfs "
              "(page cache warm), against the whole `atlasfs export -j N --shards ...` command from the Atlas "
              "dataset (start-up included; export reads no stored table); every tar on tmpfs; one run each.", ""]
    lines += harness.table(["", "files", "seconds", "files/s", "of tar cf"], [["missing"] * 5] if g is None else [
        [name, f"{g['files']:,}", f"{s:.2f}", f"{g['fps'][name]:,.0f}", f"{g['fps'][name] / g['fps']['tar cf']:.2f}"]
        for name, s in g["seconds"].items()])
    lines += ["", "### Daemon RSS against the bound (cache bound + 100 MiB)", ""]
    lines += harness.table(["after", "RSS", "peak (VmHWM)", "bound", "within", "notes"],
                           [[r.step, f"{r.rss / MiB:.1f} MiB", f"{r.peak / MiB:.1f} MiB", f"{r.bound / MiB:.0f} MiB",
                             "yes" if r.within else "**NO**", r.note] for r in run.rss])
    lines += ["", "### Targets (issue #26)", "",
              "Only the RSS bounds and the wrong bytes decide the exit code; the speed targets are reported.", ""]
    lines += harness.table(["target", "measured", "met", "in exit code"],
                           [[t["target"], t["measured"] or "missing",
                             "missing" if t["met"] is None else ("yes" if t["met"] else "**NO**"),
                             "yes" if t["enforced"] else "no"] for t in target_rows])
    lines += ["", "### Phases", ""]
    lines += harness.table(["phase", "seconds"], [[name, f"{s:.1f}"] for name, s in run.phase_seconds.items()])
    if run.problems or run.missing:
        lines += ["", "### Problems", ""] + [f"- {p}" for p in run.problems + run.missing]
    return lines


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(path) for name in names)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems.MOUNT_TIMEOUT = max(systems.MOUNT_TIMEOUT, MOUNT_TIMEOUT)
    notes: list[str] = []
    executable, version, reason = harness.ratarmount(args)
    run = Run(memory.bound(args.cache_bytes))
    if reason is not None:
        notes.append(f"ratarmount figures are MISSING: {reason}")
        run.missing.append(f"ratarmount: {reason}")
    spec = scaledata.Spec(args.files // 2, args.shard_examples)
    with harness.workspace("scale", args) as ws:
        data = scaledata.prepare(spec, ws.workdir, args.jobs, log)
        log(f"{data.files:,} files in {len(data.shards)} shards"
            + (" (reused)" if data.reused else f" (written in {sum(data.seconds.values()):.0f} s)"))
        notes.append(f"data in {ws.workdir} ({harness.fstype(ws.workdir)}), mounts' state in {ws.scratch}")
        atlas = systems.Atlasfs(data.atlas, data.names, os.path.join(ws.scratch, "atlasfs"),
                                extra_args=["--cache-size", args.cache_size])
        ratar = (systems.Ratarmount(executable, data.tars, data.names, os.path.join(ws.scratch, "ratarmount"))
                 if executable else None)
        try:
            with atlas.session():  # untimed: programs and libraries loaded once before the first figure
                pass
            listing(run, data, atlas, ratar, stored=False)
            index(run, data, atlas, args.jobs)
            listing(run, data, atlas, ratar, stored=True)
            if ratar is not None:  # its index is no longer needed: give its tmpfs back
                shutil.rmtree(ratar.index_folder, ignore_errors=True)
            if not args.listing_only:
                tar_shards(run, data, atlas)
                readers(run, data, atlas, args)
                export_subset(run, data, ws.scratch, min(args.export_shards, len(data.shards)))
        finally:
            atlas.clear_metadata()  # leave the kept data as it was written
    target_rows = targets(run, args.listing_only)
    meta = harness.meta("scale.py", args, ratarmount=version, cache_bytes=args.cache_bytes, notes=notes)
    payload = {"data": {"files": data.files, "examples": spec.examples, "shard_examples": spec.shard_examples,
                        "block_size": spec.block_size, "shards": len(data.shards), "reused": data.reused,
                        "written_seconds": data.seconds},
               "figures": run.figures, "rss": [{**vars(r), "within": r.within} for r in run.rss],
               "targets": target_rows, "phase_seconds": run.phase_seconds, "problems": run.problems,
               "missing": run.missing}
    harness.write_report("scale", args, f"atlasfs at {data.files:,} files", body(run, data, args, target_rows),
                         meta, payload)
    bounds = all(t["met"] for t in target_rows if t["enforced"])
    return 0 if bounds and not run.problems and not run.missing else 2


if __name__ == "__main__":
    harness.run_main(main)
