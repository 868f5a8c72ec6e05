#!/usr/bin/env python3
"""A block's first read against decompressing its frame in process (issue #39, point 1).

    python bench/first_read.py                       # the three sets, 3 passes each
    python bench/first_read.py --sets real --repeat 1 --workdir /dev/shm/firstread
    python bench/first_read.py --smoke               # small sizes, 1 pass (CI)

The target: a block's first read has p50 <= the in-process decompression of its frame up to
the file's end + 0.15 ms, and p99 <= the whole frame's + 0.3 ms.

The sets, each with its file tables stored (``atlasfs index``):

* ``real``: real JPEGs as bench/shuffle.py makes them (Pillow, ~40 KB, a ``cls`` and a
  ``json`` each), written with AtlasWriter's defaults (strategy 2 with the shared dictionary,
  blocks of 64), 2 shards of 2,500 samples; the ``.jpg`` files are read.
* ``image``: the suite's synthetic image set (bench/datagen.py: ~100 KiB of random bytes as
  ``jpg``, blocks of 8, strategy 2); the ``.jpg`` files are read.
* ``random``: the issue's synthetic set: 100 KB random-byte files (``bin``, with a ``cls``),
  strategy 1, blocks of 16, 3 shards; the ``.bin`` files are read.

A pass is a fresh mount with default options (``atlasfs mount -f``), after dropping the page
cache (as root; else noted). One file of each shard's first block is read first, untimed, so
that neither a shard's first lookup nor the daemon's first decompression (its code paged in
again after the drop: the first ten reads of a pass took 2-8 ms) is counted as a block's cost.
Then, for every other block in a seeded shuffled order, one of its files (a seeded choice) is
read whole with ``open().read()``: the block's first read. Its latency is recorded and its
bytes checked (size and CRC) against the source files.

In this process, for the same file: the block's zstd frame decompressed with the shard's own
codec and dictionary up to the file's end (a stream read that stops once the output passes
the file's last byte; the file's place in the decompressed block is found by its bytes) and
whole (``BlockCodec.decompress``), the median of ``--runs`` runs each. Then, in the same mount,
another file of each block in the same order (a "later read": its frame is decompressed
already, so it shows what a read costs beside decompressing). Reported per set: p50
of the first reads against p50 of "up to" + 0.15 ms, p99 against p99 of "whole" + 0.3 ms,
met or not, and the median of each read's excess (its latency less its own "up to"); and what
the daemon decompressed (its last log line). Every pass of a set is pooled. The exit code is
1 if a byte was wrong; the targets are reported only.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

import numpy as np

from bench import datagen, harness, shuffle, systems

log = harness.log
SETS = ("real", "image", "random")
#: The target's margins over the in-process decompression (issue #39), in ms.
P50_MARGIN_MS = 0.15
P99_MARGIN_MS = 0.3
#: Bump when the random set changes, so that a kept one is rebuilt.
RANDOM_VERSION = 1


@dataclass
class DataSet:
    """One set: its Atlas dataset, its files as exported (the expected bytes) and which field is read."""

    name: str
    description: str
    atlas: str
    files: str
    shards: list[str]
    field: str


# -- the data


def real_set(args: argparse.Namespace, workdir: str) -> DataSet:
    """bench/shuffle.py's real media (its own ``prepare``: Pillow's JPEGs, the writer's defaults)."""
    media_python = shuffle.ensure_media_venv(args.media_venv, install=not args.no_install)
    ns = argparse.Namespace(samples=400 if args.smoke else args.real_samples, shard_size=200 if args.smoke else 2500,
                            block_size=shuffle.BLOCK_SIZE, strategy=shuffle.DEFAULT_STRATEGY, seed=args.seed)
    data = shuffle.prepare(ns, workdir, media_python, squashfs=False)
    return DataSet("real", f"{ns.samples:,} real JPEGs (~40 KB) in shards of {ns.shard_size:,}, blocks of "
                           f"{ns.block_size}, strategy {ns.strategy} (AtlasWriter's defaults)",
                   data["atlas"], data["files"], data["shards"], "jpg")


def image_set(args: argparse.Namespace, workdir: str, scratch: str) -> DataSet:
    """bench/datagen.py's image set, its tars extracted into the scratch folder."""
    spec = datagen.spec_for("image", smoke=args.smoke)
    prepared = datagen.prepare(spec, workdir, log)
    files = os.path.join(scratch, "image-files")
    datagen.materialize(prepared, files)
    return DataSet("image", f"the suite's image set: {spec.examples:,} examples of ~100 KiB random bytes as jpg, "
                            f"shards of {spec.shard_size}, blocks of {spec.block_size}, strategy 2",
                   prepared.atlas, files, prepared.shards, "jpg")


def random_set(args: argparse.Namespace, workdir: str) -> DataSet:
    """The issue's synthetic set: 100 KB random-byte files, strategy 1, blocks of 16, 3 shards
    (made once under ``workdir/first-read-random``, reused while its settings match)."""
    from atlasfs import AtlasWriter

    shard_size = 48 if args.smoke else args.random_shard_size
    key = {"version": RANDOM_VERSION, "shard_size": shard_size, "shards": 3, "block_size": 16, "strategy": 1,
           "bytes": 100_000, "seed": args.seed}
    root = os.path.join(workdir, f"first-read-random-{shard_size}")
    atlas, files = os.path.join(root, "atlas"), os.path.join(root, "files")
    stamp = os.path.join(root, "done.json")
    done = harness.kept(stamp, key)
    if done is None:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        rng = np.random.default_rng(args.seed)

        def examples() -> Iterator[dict[str, Any]]:
            for _ in range(3 * shard_size):
                yield {"bin": rng.bytes(100_000), "cls": int(rng.integers(0, 1000))}

        log(f"random: writing {3 * shard_size} examples of 100 KB random bytes (strategy 1, blocks of 16)")
        with AtlasWriter(atlas, shard_size=shard_size, block_size=16, compression_strategy=1) as writer:
            writer.add_examples(examples())
        shards = harness.export_files(atlas, files)
        harness.keep(stamp, key, shards=shards)
        done = harness.kept(stamp, key)
        assert done is not None
    return DataSet("random", f"{3 * shard_size:,} examples of 100 KB random bytes as bin (and a cls) in 3 shards, "
                             "blocks of 16, strategy 1", atlas, files, done["shards"], "bin")


# -- blocks, files and the in-process decompression


@dataclass
class Block:
    """One block of a shard: the files of the read field in it (relative to the files folder)."""

    shard: int
    block: int
    files: list[str]


def blocks_of(ds: DataSet, dataset: Any) -> list[Block]:
    """Every block of every shard with the paths of its files of the field read."""
    from atlasfs.formats.naming import index_key

    out = []
    for position, shard in enumerate(dataset.shards):
        folder = ds.shards[position] if position < len(ds.shards) else "?"
        for block in range(shard.num_blocks):
            first = block * shard.block_size
            paths = [f"{folder}/{index_key(shard.first_index + first + i, shard.key_width)}.{ds.field}"
                     for i in range(shard.block_length(block))]
            missing = [p for p in paths if not os.path.isfile(os.path.join(ds.files, p))]
            if missing:
                raise RuntimeError(f"{ds.name}: {missing[0]} is not among the exported files (shard {shard.name})")
            out.append(Block(position, block, paths))
    return out


def _median_seconds(action: Any, runs: int) -> float:
    clock = time.perf_counter
    times = []
    for _ in range(runs):
        t0 = clock()
        action()
        times.append(clock() - t0)
    return statistics.median(times)


class InProcess:
    """The in-process decompression of a dataset's blocks with each shard's own codec: up to a
    file's end (per file) and whole (per block, measured once)."""

    def __init__(self, dataset: Any, files: str, runs: int) -> None:
        self.dataset = dataset
        self.files = files
        self.runs = runs
        self._whole: dict[tuple[int, int], float] = {}
        self._raw: dict[tuple[int, int], tuple[bytes, bytes]] = {}

    def _frame(self, shard: int, block: int) -> tuple[bytes, bytes]:
        key = (shard, block)
        if key not in self._raw:
            s = self.dataset.shards[shard]
            raw = s.read_raw(block)
            self._raw = {key: (raw, s.codec.decompress(raw, s.block_where(block)))}  # one block kept at a time
        return self._raw[key]

    def whole_ms(self, shard: int, block: int) -> float:
        """Milliseconds to decompress the block's frame whole (the median of the runs)."""
        key = (shard, block)
        if key not in self._whole:
            s = self.dataset.shards[shard]
            raw, _ = self._frame(shard, block)
            where = s.block_where(block)
            self._whole[key] = _median_seconds(lambda: s.codec.decompress(raw, where), self.runs) * 1e3
        return self._whole[key]

    def up_to_ms(self, shard: int, block: int, path: str) -> tuple[float, int, int]:
        """(milliseconds to decompress the frame up to the file's end, that end, the frame's
        decompressed size): a stream read that stops once its output passes the end."""
        s = self.dataset.shards[shard]
        raw, payload = self._frame(shard, block)
        with open(os.path.join(self.files, path), "rb") as f:
            file = f.read()
        at = payload.find(file)
        if at < 0:
            raise RuntimeError(f"{path}: its bytes are not a run of block {block} of shard {s.name}")
        end = at + len(file)
        if s.meta.compression_strategy == 0:
            return 0.0, end, len(payload)

        def read() -> None:
            with s.codec.context() as dctx:
                reader = dctx.stream_reader(raw)
                got = 0
                while got < end:
                    chunk = reader.read(end - got)
                    if not chunk:
                        raise RuntimeError(f"{path}: block {block}'s frame ends before byte {end}")
                    got += len(chunk)

        return _median_seconds(read, self.runs) * 1e3, end, len(payload)


# -- the passes


def one_pass(ds: DataSet, blocks: list[Block], inproc: InProcess, system: systems.Atlasfs, seed: int,
             drop: bool) -> dict[str, Any]:
    """A fresh mount, every block's first read in a seeded shuffled order: per read its latency,
    its bytes checked, and the in-process figures of the same file."""
    rng = random.Random(seed)
    # Each shard's first block is read first, untimed: its table looked up, and the daemon's
    # first decompression after the page cache was dropped (its code paged in again) counted as
    # no block's. The other blocks are the pass.
    warm_blocks = {}
    for i, b in enumerate(blocks):
        warm_blocks.setdefault(b.shard, i)
    order = [i for i in range(len(blocks)) if i not in warm_blocks.values()]
    rng.shuffle(order)
    chosen = {i: rng.choice(blocks[i].files) for i in order}
    warm = {shard: rng.choice(blocks[i].files) for shard, i in sorted(warm_blocks.items())}
    later = {}  # per block, a file read after its first read
    for i in order:
        rest = [p for p in blocks[i].files if p != chosen[i]]
        if rest:
            later[i] = rng.choice(rest)
    dropped = shuffle.drop_caches() if drop else False
    with system.session() as view:
        warmed = shuffle._read_files([view.path(p) for p in warm.values()])[1]
        paths = [chosen[i] for i in order]
        latencies, got = shuffle._read_files([view.path(p) for p in paths])
        # then another file of each block, in the same order: its frame is decompressed already
        later_paths = [later[i] for i in order if i in later]
        later_latencies, later_got = shuffle._read_files([view.path(p) for p in later_paths])
        log_path = view.root + ".log"
        rss = view.peak_rss()
    counts = shuffle._daemon_counts(log_path)
    reads = []
    wrong = 0
    for path, (size, crc) in zip(warm.values(), warmed):
        with open(os.path.join(ds.files, path), "rb") as f:
            expected = f.read()
        wrong += size != len(expected) or crc != zlib.crc32(expected)
    for i, path, seconds, (size, crc) in zip(order, paths, latencies, got):
        with open(os.path.join(ds.files, path), "rb") as f:
            expected = f.read()
        ok = size == len(expected) and crc == zlib.crc32(expected)
        wrong += not ok
        b = blocks[i]
        up_to, end, content = inproc.up_to_ms(b.shard, b.block, path)
        reads.append({"shard": b.shard, "block": b.block, "file": path, "ms": seconds * 1e3, "up_to_ms": up_to,
                      "whole_ms": inproc.whole_ms(b.shard, b.block), "end": end, "content": content, "ok": ok})
    later_reads = []
    for path, seconds, (size, crc) in zip(later_paths, later_latencies, later_got):
        with open(os.path.join(ds.files, path), "rb") as f:
            expected = f.read()
        ok = size == len(expected) and crc == zlib.crc32(expected)
        wrong += not ok
        later_reads.append({"file": path, "ms": seconds * 1e3, "ok": ok})
    return {"seed": seed, "reads": reads, "later_reads": later_reads, "wrong": wrong, "page_cache_dropped": dropped,
            "daemon": counts,
            "daemon_peak_rss": rss, "load": os.getloadavg()[0]}


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank)."""
    return shuffle.percentile(values, q)


def summarize(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """The set's figures over every read of every pass, and the target's verdicts."""
    reads = [r for p in passes for r in p["reads"]]
    ms = [r["ms"] for r in reads]
    up_to = [r["up_to_ms"] for r in reads]
    whole = [r["whole_ms"] for r in reads]
    s = {"reads": len(reads), "p50_ms": percentile(ms, 50), "p99_ms": percentile(ms, 99),
         "up_to_p50_ms": percentile(up_to, 50), "whole_p50_ms": percentile(whole, 50),
         "whole_p99_ms": percentile(whole, 99),
         "excess_median_ms": statistics.median(r["ms"] - r["up_to_ms"] for r in reads),
         "wrong": sum(p["wrong"] for p in passes)}
    later = [r["ms"] for p in passes for r in p.get("later_reads", [])]
    s["later_p50_ms"] = percentile(later, 50) if later else None
    s["p50_target_ms"] = s["up_to_p50_ms"] + P50_MARGIN_MS
    s["p99_target_ms"] = s["whole_p99_ms"] + P99_MARGIN_MS
    s["p50_met"] = s["p50_ms"] <= s["p50_target_ms"]
    s["p99_met"] = s["p99_ms"] <= s["p99_target_ms"]
    return s


def run_set(name: str, args: argparse.Namespace, ws: harness.Workspace) -> dict[str, Any]:
    from atlasfs import AtlasDataset

    ds = {"real": lambda: real_set(args, ws.workdir), "image": lambda: image_set(args, ws.workdir, ws.scratch),
          "random": lambda: random_set(args, ws.workdir)}[name]()
    state = os.path.join(ws.scratch, f"state-{name}")
    os.makedirs(state, exist_ok=True)
    system = systems.Atlasfs(ds.atlas, ds.shards, state)
    log(f"{name}: atlasfs index (file tables stored ahead of the mounts)")
    system.prepare_metadata()
    passes = []
    with AtlasDataset(ds.atlas) as dataset:
        blocks = blocks_of(ds, dataset)
        inproc = InProcess(dataset, ds.files, args.runs)
        for i in range(args.repeat):
            log(f"{name}: pass {i + 1}/{args.repeat}: {len(blocks)} blocks' first reads")
            passes.append(one_pass(ds, blocks, inproc, system, args.seed + i, not args.no_drop_caches))
    return {"description": ds.description, "blocks": len(blocks), "passes": passes, "summary": summarize(passes)}


# -- the report


def body(results: dict[str, dict[str, Any]], runs: int) -> list[str]:
    lines = ["Each set's passes pooled. \"up to\": the in-process decompression of the block's frame up to the "
             "file's end; \"whole\": of the whole frame (median of "
             f"{runs} runs each, this process, the shard's own codec and dictionary). Targets: p50 <= p50(up to) + "
             f"{P50_MARGIN_MS} ms, p99 <= p99(whole) + {P99_MARGIN_MS} ms. Excess: the median of each read's latency "
             "less its own \"up to\". Later read: another file of each block read after the pass, in the same "
             "mount (its frame decompressed already: what a read costs beside decompressing).", ""]
    rows = []
    for name, r in results.items():
        s = r["summary"]
        rows.append([name, f"{s['reads']:,}", f"{s['p50_ms']:.3f}", f"{s['up_to_p50_ms']:.3f}",
                     f"{s['p50_target_ms']:.3f}", "met" if s["p50_met"] else "not met", f"{s['p99_ms']:.3f}",
                     f"{s['whole_p99_ms']:.3f}", f"{s['p99_target_ms']:.3f}", "met" if s["p99_met"] else "not met",
                     f"{s['excess_median_ms']:.3f}", f"{s['whole_p50_ms']:.3f}",
                     f"{s['later_p50_ms']:.3f}" if s["later_p50_ms"] is not None else "missing",
                     "ok" if not s["wrong"] else f"**{s['wrong']} wrong**"])
    lines += harness.table(["set", "first reads", "p50 (ms)", "up to, p50", "p50 target", "p50",
                            "p99 (ms)", "whole, p99", "p99 target", "p99", "excess, median", "whole, p50",
                            "later read, p50", "bytes"], rows)
    lines += ["", "The sets, and what each pass's daemon did (its last log line: frames decompressed whole and "
                  "in part):", ""]
    detail = []
    for name, r in results.items():
        for i, p in enumerate(r["passes"]):
            d = p["daemon"]
            detail.append([name, str(i + 1), f"{len(p['reads'])}", f"{d.get('frames_whole', '?')}, "
                           f"{d.get('frames_partial', '?')}", "yes" if p["page_cache_dropped"] else "no",
                           f"{(p['daemon_peak_rss'] or 0) / 2**20:.0f} MiB", f"{p['load']:.2f}",
                           "ok" if not p["wrong"] else f"**{p['wrong']} wrong**"])
    lines += harness.table(["set", "pass", "reads", "frames (whole, in part)", "page cache dropped",
                            "daemon peak RSS", "load", "bytes"], detail)
    lines += [""] + [f"- {name}: {r['description']}; {r['blocks']:,} blocks." for name, r in results.items()]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=3)
    p.add_argument("--sets", default=",".join(SETS), help=f"comma-separated, of {', '.join(SETS)} (default all)")
    p.add_argument("--runs", type=int, default=5, help="in-process runs of each decompression (default 5)")
    p.add_argument("--real-samples", type=int, default=5000, help="samples of the real set (default 5000, 2 shards)")
    p.add_argument("--random-shard-size", type=int, default=320,
                   help="examples a shard of the random set (default 320: 20 blocks a shard)")
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before each pass")
    p.add_argument("--media-venv", default=shuffle.DEFAULT_MEDIA_VENV,
                   help="virtualenv for Pillow, created and installed from PyPI if missing (default bench/.venv-media)")
    p.add_argument("--no-install", action="store_true", help="do not install Pillow if it is missing")
    args = harness.parse(p, argv)
    if not any(a == "--out" or a.startswith("--out=") for a in args.argv) and not args.smoke:
        args.out = os.path.join(harness.DEFAULT_OUT, "first-read")
    sets = [s.strip() for s in args.sets.split(",") if s.strip()]
    if not sets or any(s not in SETS for s in sets):
        p.error(f"--sets: choose among {', '.join(SETS)}")
    if args.runs < 1 or args.real_samples < 2 or args.random_shard_size < 2:
        p.error("--runs must be >= 1, --real-samples and --random-shard-size >= 2")
    results = {}
    with harness.workspace("first-read", args) as ws:
        for name in sets:
            results[name] = run_set(name, args, ws)
    wrong = sum(r["summary"]["wrong"] for r in results.values())
    notes = [f"{args.repeat} pass{'es' if args.repeat != 1 else ''} a set, each a fresh mount with default options"]
    if any(not p["page_cache_dropped"] for r in results.values() for p in r["passes"]):
        notes.append("the page cache was **not** dropped before some passes (not root, or --no-drop-caches)")
    if wrong:
        notes.append(f"**{wrong} reads gave wrong bytes**")
    meta = harness.meta("first_read.py", args, repeat=args.repeat, notes=notes)
    harness.write_report("first_read", args, "A block's first read against its frame's decompression in process",
                         body(results, args.runs), meta, {"sets": results})
    return 1 if wrong else 0


if __name__ == "__main__":
    harness.run_main(main)
