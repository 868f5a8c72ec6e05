#!/usr/bin/env python3
"""A shuffled epoch over real media (issue #39, point 4): what users have.

    python bench/shuffle.py                      # 20,000 samples, 3 repeats: bench/results/shuffle.*
    python bench/shuffle.py --samples 2000 --repeat 1 --workdir /dev/shm/shuffle
    python bench/shuffle.py --smoke              # 400 samples in 2 shards, 1 repeat (CI)

The data: SAMPLES samples, each a JPEG made with Pillow (bench/mediagen.py: 224-272 px, natural-
looking content, quality 88, ~40 KB), a ``cls`` int and a ``json`` caption dict; written by
``AtlasWriter`` with its defaults (strategy 2, the dictionary trained on the first shard and
shared, level 3) in blocks of 64 and shards of 2,500; file tables stored with ``atlasfs index``.
The same files (``atlasfs export``, extracted: checked equal to the JPEGs made) are the tmpfs
system, and a squashfs image of them (``mksquashfs -comp zstd -Xcompression-level 3 -b 131072``)
mounted with ``squashfuse_ll``, the peer. atlasfs is mounted with ``--cache-size`` a quarter of the
files' bytes (the dataset is 4x its block cache; ``--cache-size`` here changes it).

With the decoded cache (``--decoded-cache DIR``, bound 1.25x the dataset's stored bytes, DIR in
the work folder), two more atlasfs passes by 1 reader: epoch 1 with DIR empty, epoch 2 in a new
mount over what epoch 1 left there, each after dropping the page cache; they are compared with
the same run's squashfuse_ll and tmpfs "1 reader" figures, and report what the daemon
decompressed and read from DIR (its log).

The passes, each in a fresh mount after dropping the page cache (``sync; echo 3 >
/proc/sys/vm/drop_caches``, as root; else noted in the report): every ``.jpg`` read whole in a
seeded shuffled order by 1 reader (this process), and by 4 reader processes (every 4th file of
the same order); and a map-style loop: a plain class with ``__getitem__`` that opens
``MNT/<shard>/<key>.jpg``, ``.cls`` and ``.json`` and parses the last two, indexed in a shuffled
order (through ``torch.utils.data.DataLoader`` when torch is importable). Reported: files/s
(samples/s for the loop), p50 and p99 of a file's (sample's) latency, per system; the ratios
atlasfs/squashfuse_ll and atlasfs/tmpfs of the medians over repeats. Every file read is checked
(size and CRC) against the source files: a pass with wrong bytes fails the run (exit 1).

Pillow is a benchmark-only dependency: installed from PyPI, when this runs, into its own
virtualenv (bench/.venv-media, bench/requirements-media.txt), never into the project's.
squashfuse and squashfs-tools are Debian packages, installed when missing
(scripts/install-system-packages.sh); without them the squashfuse_ll figures are reported missing
with the reason and the exit code is 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import datagen, harness, systems

log = harness.log
#: Bump when the data changes, so that kept data sets are rebuilt.
GENERATOR_VERSION = 1
MEDIA_REQUIREMENTS = os.path.join(harness.BENCH_DIR, "requirements-media.txt")
DEFAULT_MEDIA_VENV = os.path.join(harness.BENCH_DIR, ".venv-media")
SYSTEMS = ("atlasfs", "squashfuse_ll", "tmpfs")
PASSES = ("1 reader", "4 readers", "map-style loop")
#: atlasfs with ``--decoded-cache`` sized to the dataset: a shuffled pass by 1 reader with the
#: folder empty (epoch 1), then another in a new mount over the folder it left (epoch 2), each
#: against the same run's squashfuse_ll and tmpfs "1 reader" figures.
DECODED_PASSES = ("decoded cache, epoch 1", "decoded cache, epoch 2")
READERS = 4
BLOCK_SIZE = 64
#: AtlasWriter's default compression strategy (2: zstd with a dictionary shared by the shards).
DEFAULT_STRATEGY = 2
MKSQUASHFS_ARGS = ["-comp", "zstd", "-Xcompression-level", "3", "-b", "131072"]
_WORDS = ("a photo of", "a close-up of", "a blurry picture of", "an old painting of", "a drawing of", "a dog",
          "a cat", "two birds", "the sea", "a red car", "a bowl of fruit", "mountains", "a city street", "at night",
          "in the snow", "on a table", "near a window", "with a hat", "in the park", "from above")


# -- the media virtualenv (Pillow)


def ensure_media_venv(venv: str, install: bool) -> str:
    """The python of ``venv`` with bench/requirements-media.txt installed (from PyPI when
    missing, if ``install``). Raises SystemUnavailable."""
    python = os.path.join(venv, "bin", "python")
    systems.ensure_venv(venv, MEDIA_REQUIREMENTS, python, "Pillow", log, install)
    return python


def ensure_squashfs(install: bool) -> tuple[str | None, str]:
    """(None, version) when mksquashfs and squashfuse_ll are there (installed from Debian when
    missing, if ``install``), else (why not, "missing")."""
    if not (shutil.which("mksquashfs") and shutil.which("squashfuse_ll")):
        if not install:
            return "squashfuse_ll or mksquashfs is missing (run without --no-install)", "missing"
        log("installing the Debian packages squashfuse and squashfs-tools (benchmark-only)")
        result = subprocess.run([os.path.join(harness.REPO, "scripts", "install-system-packages.sh"), "squashfuse",
                                 "squashfs-tools"], capture_output=True, check=False, text=True)
        if result.returncode != 0 or not (shutil.which("mksquashfs") and shutil.which("squashfuse_ll")):
            return f"cannot install squashfuse, squashfs-tools: {(result.stderr or result.stdout).strip()[-300:]}", \
                "missing"
    version = subprocess.run(["dpkg-query", "-W", "-f", "${Package} ${Version}, ", "squashfuse", "squashfs-tools"],
                             capture_output=True, text=True, check=False).stdout.strip(" ,")
    return None, version or "squashfuse_ll (version unknown)"


# -- the data


def prepare(args: argparse.Namespace, workdir: str, media_python: str, squashfs: bool) -> dict[str, Any]:
    """Make (or reuse, when made from the same settings) the Atlas dataset, the extracted files
    and the squashfs image under ``workdir/shuffle-<samples>``; what they are."""
    from atlasfs import AtlasWriter

    # Other block sizes and strategies than the writer's defaults: data of their own beside it.
    settings = "" if (args.block_size, args.strategy) == (BLOCK_SIZE, DEFAULT_STRATEGY) else \
        f"-b{args.block_size}-s{args.strategy}"
    root = os.path.join(workdir, f"shuffle-{args.samples}{settings}")
    stamp_path = os.path.join(root, "done.json")
    with open(MEDIA_REQUIREMENTS) as f:
        key = {"generator": GENERATOR_VERSION, "samples": args.samples, "shard_size": args.shard_size,
               "block_size": args.block_size, "strategy": args.strategy, "seed": args.seed,
               "requirements": f.read()}
    done = harness.kept(stamp_path, key)
    atlas, files, image = (os.path.join(root, x) for x in ("atlas", "files", "squashfs.img"))
    if done is None:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        made = os.path.join(root, "jpg")
        start = time.perf_counter()
        log(f"making {args.samples} JPEGs with Pillow (bench/mediagen.py)")
        subprocess.run([media_python, os.path.join(harness.BENCH_DIR, "mediagen.py"), made, str(args.samples),
                        str(args.seed)], check=True)
        with open(os.path.join(made, "manifest.json")) as f:
            sizes = json.load(f)["sizes"]
        rng = random.Random(args.seed)

        def examples() -> Iterator[dict[str, Any]]:
            for i, (w, h) in enumerate(sizes):
                with open(os.path.join(made, f"{i:06d}.jpg"), "rb") as f:
                    jpg = f.read()
                caption = " ".join(rng.sample(_WORDS, rng.randint(3, 6)))
                yield {"jpg": jpg, "cls": rng.randrange(1000),
                       "json": {"caption": caption, "width": w, "height": h, "id": i}}

        log(f"writing them with AtlasWriter (blocks of {args.block_size}, strategy {args.strategy}, "
            f"shards of {args.shard_size})")
        with AtlasWriter(atlas, shard_size=args.shard_size, block_size=args.block_size,
                         compression_strategy=args.strategy) as writer:
            writer.add_examples(examples())
        make_seconds = time.perf_counter() - start
        shards = harness.export_files(atlas, files)
        jpgs = sorted(p for p in datagen.file_list(files) if p.endswith(".jpg"))
        if len(jpgs) != args.samples:
            raise RuntimeError(f"the export has {len(jpgs)} .jpg files, not {args.samples}")
        seen = set()
        for rel in jpgs:  # the export is the source, byte for byte
            i = json.loads(_read(os.path.join(files, rel[:-4] + ".json")))["id"]
            seen.add(i)
            if _read(os.path.join(files, rel)) != _read(os.path.join(made, f"{i:06d}.jpg")):
                raise RuntimeError(f"{rel} exported differs from the JPEG made ({i:06d}.jpg)")
        if len(seen) != args.samples:
            raise RuntimeError(f"the export has {len(seen)} distinct samples, not {args.samples}")
        shutil.rmtree(made)
        harness.keep(stamp_path, key, shards=shards, make_seconds=make_seconds, squashfs=False)
        done = harness.kept(stamp_path, key)
        assert done is not None
    if squashfs and not done.get("squashfs"):
        log("mksquashfs " + " ".join(MKSQUASHFS_ARGS))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(image)
        start = time.perf_counter()
        subprocess.run(["mksquashfs", files, image, *MKSQUASHFS_ARGS, "-noappend", "-quiet", "-no-progress"],
                       check=True, stdout=subprocess.DEVNULL)
        done.update(squashfs=True, squashfs_seconds=time.perf_counter() - start)
        harness.keep(stamp_path, key, **{k: v for k, v in done.items() if k != "key"})
    with open(os.path.join(atlas, "meta.json")) as f:
        meta = json.load(f)
    all_files = datagen.file_list(files)
    return {"root": root, "atlas": atlas, "files": files, "image": image if squashfs else None,
            "shards": done["shards"], "file_count": len(all_files),
            "file_bytes": sum(os.path.getsize(os.path.join(files, p)) for p in all_files),
            "jpg_bytes": sum(os.path.getsize(os.path.join(files, p)) for p in all_files if p.endswith(".jpg")),
            "atlas_bytes": _dir_bytes(atlas), "squashfs_bytes": os.path.getsize(image) if squashfs else None,
            "block_size": args.block_size,
            "strategies": sorted({json.dumps(s.get("compression_strategy", s.get("strategy")))
                                  for s in _shard_metas(meta)}),
            "make_seconds": done.get("make_seconds"), "squashfs_seconds": done.get("squashfs_seconds")}


def _shard_metas(meta: Any) -> list[dict[str, Any]]:
    """Every dict in the dataset's meta.json that records a shard's compression."""
    found = []
    if isinstance(meta, dict):
        if "compression_strategy" in meta or "strategy" in meta:
            found.append(meta)
        for value in meta.values():
            found += _shard_metas(value)
    elif isinstance(meta, list):
        for value in meta:
            found += _shard_metas(value)
    return found


def _atlasfs(*args: str) -> None:
    result = subprocess.run([sys.executable, "-m", "atlasfs", *args], capture_output=True, check=False, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"atlasfs {' '.join(args)} failed: {result.stderr.strip()[-500:]}")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


# -- squashfuse_ll


class Squashfuse(systems.System):
    """``squashfuse_ll -f IMAGE MNT`` (fuse3), started here so that its pid is ours."""

    name = "squashfuse_ll"

    def __init__(self, image: str, shards: list[str], workdir: str) -> None:
        self.image = image
        self.shards = shards
        self.workdir = workdir

    @contextlib.contextmanager
    def session(self, fresh_metadata: bool = False) -> Iterator[systems.View]:
        os.makedirs(os.path.join(self.workdir, "mnt"), exist_ok=True)
        mountpoint = tempfile.mkdtemp(prefix="squashfuse-", dir=os.path.join(self.workdir, "mnt"))
        log_path = mountpoint + ".log"
        process = None
        try:
            with open(log_path, "ab") as out:
                start = time.perf_counter()
                process = subprocess.Popen(["squashfuse_ll", "-f", self.image, mountpoint], stdin=subprocess.DEVNULL,
                                           stdout=out, stderr=out)
                systems._wait(process, lambda: systems.is_mounted(mountpoint), "squashfuse_ll -f", log_path)
                seconds = time.perf_counter() - start
            yield systems.View(self.name, mountpoint, {s: os.path.join(mountpoint, s) for s in self.shards},
                               pid=process.pid, mount_seconds=seconds)
        finally:
            systems.unmount(mountpoint, process)


# -- the passes


def drop_caches() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False when not allowed (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _read_files(paths: list[str]) -> tuple[list[float], list[tuple[int, int]]]:
    """Open, read whole and close each file in turn: per file its seconds and (size, CRC)."""
    latencies, got = [], []
    clock = time.perf_counter
    for path in paths:
        t0 = clock()
        with open(path, "rb", buffering=0) as f:
            chunks = []
            while chunk := f.read(1 << 20):
                chunks.append(chunk)
        latencies.append(clock() - t0)
        data = b"".join(chunks)
        got.append((len(data), zlib.crc32(data)))
    return latencies, got


def _reader(paths: list[str], barrier: Any, results: Any, index: int) -> None:
    barrier.wait()
    results.put((index, *_read_files(paths)))


def readers_pass(paths: list[str], readers: int) -> tuple[float, list[float], list[tuple[int, int]]]:
    """``readers`` processes at once, each reading every ``readers``-th of ``paths`` (1: this
    process): (wall seconds from the start of all to the end of the last, latencies, per file
    (size, CRC) in the order of ``paths``)."""
    if readers == 1:
        start = time.perf_counter()
        latencies, got = _read_files(paths)
        return time.perf_counter() - start, latencies, got
    context = multiprocessing.get_context("fork")
    barrier, results = context.Barrier(readers + 1), context.Queue()
    workers = [context.Process(target=_reader, args=(paths[i::readers], barrier, results, i)) for i in range(readers)]
    for worker in workers:
        worker.start()
    try:
        barrier.wait(timeout=60)
        start = time.perf_counter()
        parts = [results.get(timeout=3600) for _ in workers]
        seconds = time.perf_counter() - start
    finally:
        for worker in workers:
            worker.join(timeout=60)
            if worker.is_alive():
                worker.kill()
    latencies: list[float] = []
    got: list[tuple[int, int]] = [(0, 0)] * len(paths)
    for index, lat, part in parts:
        latencies += lat
        got[index::readers] = part
    return seconds, latencies, got


class SampleDataset:
    """A map-style dataset as users write one: sample ``i`` is ``(jpg bytes, cls, caption dict)``
    read from ``ROOT/<shard>/<key>.{jpg,cls,json}``."""

    def __init__(self, root: str, samples: list[str]) -> None:
        self.root = root
        self.samples = samples  # "<shard>/<key>"

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[bytes, int, dict[str, Any]]:
        stem = os.path.join(self.root, self.samples[i])
        with open(stem + ".jpg", "rb") as f:
            jpg = f.read()
        with open(stem + ".cls", "rb") as f:
            cls = int(f.read())
        with open(stem + ".json", "rb") as f:
            caption = json.loads(f.read())
        return jpg, cls, caption


def map_style_pass(root: str, samples: list[str], order: list[int]) -> tuple[float, list[float], list[tuple[int, int]],
                                                                               str]:
    """Index a :class:`SampleDataset` in ``order`` (a DataLoader's when torch is importable):
    (seconds, per-sample latencies, per sample (jpg size, CRC of its three values), how)."""
    dataset = SampleDataset(root, samples)
    clock = time.perf_counter
    latencies, got = [], []
    try:
        from torch.utils.data import DataLoader  # type: ignore[import-not-found]
        loader: Any = DataLoader(dataset, batch_size=None, sampler=order, num_workers=0)
        how = "torch.utils.data.DataLoader(batch_size=None, num_workers=0, sampler=the order)"
    except ImportError:
        loader = (dataset[i] for i in order)
        how = "a plain loop (torch is not importable)"
    start = t0 = clock()
    for jpg, cls, caption in loader:
        t1 = clock()
        latencies.append(t1 - t0)
        got.append((len(jpg), zlib.crc32(json.dumps([cls, caption], sort_keys=True).encode(), zlib.crc32(jpg))))
        t0 = clock()
    return clock() - start, latencies, got, how


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (nearest rank)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))]


# -- the run


def run(args: argparse.Namespace, ws: harness.Workspace, media_python: str, squashfs_reason: str | None
        ) -> dict[str, Any]:
    data = prepare(args, ws.workdir, media_python, squashfs_reason is None)
    cache = args.cache_size or f"{max(1, round(data['file_bytes'] / 4 / 2**20))}M"
    files = data["files"]
    jpgs = [p for p in datagen.file_list(files) if p.endswith(".jpg")]
    order = list(range(len(jpgs)))
    random.Random(args.seed).shuffle(order)
    order = order[:args.reads] if args.reads else order
    shuffled = [jpgs[i] for i in order]
    samples = [p[:-4] for p in jpgs]
    expected_files = _read_files([os.path.join(files, p) for p in shuffled])[1]
    expected_samples = map_style_pass(files, samples, order)[2]
    source_bytes = {"files": sum(n for n, _ in expected_files), "samples": sum(n for n, _ in expected_samples)}

    state = os.path.join(ws.scratch, "state")
    os.makedirs(state)
    atlas = systems.Atlasfs(data["atlas"], data["shards"], state, ["--cache-size", cache])
    log("atlasfs index (file tables stored ahead of the mounts)")
    atlas.prepare_metadata()
    chosen: list[systems.System] = [atlas]
    if data["image"]:
        chosen.append(Squashfuse(data["image"], data["shards"], state))
    chosen.append(systems.Tmpfs(files, data["shards"]))

    raw: dict[str, dict[str, dict[str, list[float]]]] = {p: {s.name: {} for s in chosen} for p in PASSES}
    runs: list[dict[str, Any]] = []
    wrong: list[str] = []
    dropped = True
    how = ""
    decoded_runs: list[dict[str, Any]] = []
    for repeat in range(args.repeat):
        for position, system in enumerate(chosen if repeat % 2 == 0 else chosen[::-1]):
            for pass_name in PASSES:
                log(f"repeat {repeat + 1}/{args.repeat}: {system.name}: {pass_name}")
                if not args.no_drop_caches:
                    dropped = drop_caches() and dropped
                with system.session() as view:
                    if pass_name == "map-style loop":
                        seconds, latencies, got, how = map_style_pass(view.root, samples, order)
                        expected, unit = expected_samples, "samples"
                    else:
                        readers = READERS if pass_name == "4 readers" else 1
                        seconds, latencies, got = readers_pass([view.path(p) for p in shuffled], readers)
                        expected, unit = expected_files, "files"
                    rss = view.peak_rss()
                nbytes = sum(n for n, _ in got)
                bad = sum(1 for a, b in zip(got, expected) if a != b) + abs(len(got) - len(expected))
                if bad:
                    wrong.append(f"{system.name} {pass_name} repeat {repeat + 1}: {bad} {unit} differ")
                    log(f"WRONG BYTES: {wrong[-1]}")
                figures = {"per_s": len(got) / seconds, "p50_ms": percentile(latencies, 50) * 1e3,
                           "p99_ms": percentile(latencies, 99) * 1e3}
                for figure, value in figures.items():
                    raw[pass_name][system.name].setdefault(figure, []).append(value)
                runs.append({"repeat": repeat + 1, "turn": position + 1, "system": system.name, "pass": pass_name,
                             "count": len(got), "unit": unit, "bytes": nbytes, "expected_bytes": source_bytes[unit],
                             "wrong": bad, "seconds": seconds, **figures,
                             "mount_seconds": view.mount_seconds, "daemon_peak_rss": rss,
                             "load": os.getloadavg()[0]})
        decoded_runs += decoded_epochs(args, data, state, cache, shuffled, expected_files, repeat, ws.scratch,
                                       wrong)
    for pass_name in DECODED_PASSES:
        for r in decoded_runs:
            if r["pass"] == pass_name:
                for figure in ("per_s", "p50_ms", "p99_ms"):
                    raw.setdefault(pass_name, {"atlasfs": {}})["atlasfs"].setdefault(figure, []).append(r[figure])
        for other in SYSTEMS[1:]:  # the same run's 1-reader figures of the others
            if other in raw["1 reader"]:
                raw.setdefault(pass_name, {"atlasfs": {}})[other] = raw["1 reader"][other]
    summary: dict[str, Any] = {}
    for pass_name, per_system in raw.items():
        summary[pass_name] = {}
        for name, figures in per_system.items():
            summary[pass_name][name] = {f: {"median": statistics.median(v), "min": min(v), "max": max(v), "samples": v}
                                        for f, v in figures.items()}
    return {"data": {k: v for k, v in data.items() if k not in ("root",)}, "cache_size": cache,
            "reads": len(shuffled), "source_bytes": source_bytes, "figures": summary, "runs": runs,
            "decoded_runs": decoded_runs,
            "wrong": wrong, "page_cache_dropped": dropped and not args.no_drop_caches, "map_style": how}


def _daemon_counts(log_path: str) -> dict[str, int]:
    """The frames a mount decompressed and its decoded cache's hits and writes (its last log lines)."""
    import re

    with open(log_path, errors="replace") as f:
        text = f.read()
    counts: dict[str, int] = {}
    frames = re.findall(r"frames decompressed: (\d+) whole, (\d+) in part", text)
    if frames:
        counts.update(frames_whole=int(frames[-1][0]), frames_partial=int(frames[-1][1]))
    decoded = re.findall(r"decoded cache: (\d+) hits, (\d+) misses, (\d+) written", text)
    if decoded:
        counts.update(decoded_hits=int(decoded[-1][0]), decoded_written=int(decoded[-1][2]))
    return counts


def decoded_epochs(args: argparse.Namespace, data: dict[str, Any], state: str, cache: str, shuffled: list[str],
                   expected: list[tuple[int, int]], repeat: int, scratch: str, wrong: list[str]) -> list[dict[str, Any]]:
    """The two decoded-cache epochs of one repeat (DECODED_PASSES): their figures and counts."""
    folder = os.path.join(scratch, "decoded")
    shutil.rmtree(folder, ignore_errors=True)
    bound = f"{max(64, math.ceil(data['atlas_bytes'] * 1.25 / 2**20))}M"
    system = systems.Atlasfs(data["atlas"], data["shards"], state,
                             ["--cache-size", cache, "--decoded-cache", folder, "--decoded-cache-size", bound])
    out = []
    for pass_name in DECODED_PASSES:
        log(f"repeat {repeat + 1}/{args.repeat}: atlasfs: {pass_name}")
        if not args.no_drop_caches:
            drop_caches()
        with system.session() as view:
            seconds, latencies, got = readers_pass([view.path(p) for p in shuffled], 1)
            log_path = view.root + ".log"
            rss = view.peak_rss()
        bad = sum(1 for a, b in zip(got, expected) if a != b) + abs(len(got) - len(expected))
        if bad:
            wrong.append(f"atlasfs {pass_name} repeat {repeat + 1}: {bad} files differ")
            log(f"WRONG BYTES: {wrong[-1]}")
        out.append({"repeat": repeat + 1, "system": "atlasfs", "pass": pass_name, "count": len(got),
                    "bytes": sum(n for n, _ in got), "wrong": bad, "seconds": seconds,
                    "per_s": len(got) / seconds, "p50_ms": percentile(latencies, 50) * 1e3,
                    "p99_ms": percentile(latencies, 99) * 1e3, "decoded_cache_size": bound,
                    "decoded_folder_bytes": _dir_bytes(folder), "daemon_peak_rss": rss,
                    "load": os.getloadavg()[0], **_daemon_counts(log_path)})
    shutil.rmtree(folder, ignore_errors=True)
    return out


def _cell(stats: dict[str, Any] | None, digits: int) -> str:
    if not stats:
        return "missing"
    if stats["min"] == stats["max"]:
        return f"{stats['median']:,.{digits}f}"
    return f"{stats['median']:,.{digits}f} ({stats['min']:,.{digits}f}–{stats['max']:,.{digits}f})"


def body(result: dict[str, Any], squashfs_version: str) -> list[str]:
    d = result["data"]
    mib = 2**20
    lines = [f"{d['file_count'] // 3:,} samples ({d['file_count']:,} files, {d['file_bytes'] / mib:,.1f} MiB; "
             f".jpg {d['jpg_bytes'] / mib:,.1f} MiB, {d['jpg_bytes'] / (d['file_count'] // 3) / 1000:.1f} KB each) "
             f"in {len(d['shards'])} shard{'s' if len(d['shards']) != 1 else ''}; Atlas {d['atlas_bytes'] / mib:,.1f} MiB "
             f"(blocks of {d.get('block_size', '?')} examples; compression strategies in meta.json: "
             f"{', '.join(d['strategies']) or '?'}), squashfs image "
             + (f"{d['squashfs_bytes'] / mib:,.1f} MiB" if d["squashfs_bytes"] else "missing")
             + f". atlasfs --cache-size {result['cache_size']}; {squashfs_version}.",
             "",
             f"Each pass reads {result['reads']:,} samples' files in the same seeded shuffled order, in a fresh "
             f"mount, after " + ("dropping the page cache" if result["page_cache_dropped"]
                                 else "**not** dropping the page cache (not root, or --no-drop-caches)")
             + f". Map-style loop: {result['map_style']}; its unit is a sample (3 files). "
             "Medians over repeats (min–max); ratios of the medians.", ""]
    rows = []
    for pass_name, per_system in result["figures"].items():
        for figure, label, digits in (("per_s", "samples/s" if pass_name == "map-style loop" else "files/s", 0),
                                      ("p50_ms", "p50 (ms)", 3), ("p99_ms", "p99 (ms)", 3)):
            cells = [_cell(per_system.get(s, {}).get(figure), digits) for s in SYSTEMS]
            a = per_system.get("atlasfs", {}).get(figure)
            ratios = []
            for other in SYSTEMS[1:]:
                b = per_system.get(other, {}).get(figure)
                ratios.append(f"{a['median'] / b['median']:.3g}" if a and b and b["median"] else "missing")
            rows.append([pass_name, label, *cells, *ratios])
    lines += harness.table(["pass", "figure", *SYSTEMS, "atlasfs/squashfuse_ll", "atlasfs/tmpfs"], rows)
    if result.get("decoded_runs"):
        lines += ["", "The decoded cache's epochs (atlasfs's 1 reader with `--decoded-cache`; squashfuse_ll's and "
                  "tmpfs's columns above are their 1-reader figures): what each mount decompressed and read from "
                  "the folder, from its log:", ""]
        lines += harness.table(["pass", "repeat", "files/s", "frames decompressed (whole, in part)",
                                "read from the folder", "files written", "folder bytes", "check", "load"],
                               [[r["pass"], str(r["repeat"]), f"{r['per_s']:,.0f}",
                                 f"{r.get('frames_whole', '?')}, {r.get('frames_partial', '?')}",
                                 f"{r.get('decoded_hits', '?'):,}", f"{r.get('decoded_written', '?'):,}",
                                 f"{r['decoded_folder_bytes']:,}", "ok" if not r["wrong"] else f"**{r['wrong']} wrong**",
                                 f"{r['load']:.2f}"] for r in result["decoded_runs"]])
    lines += ["", "Bytes read, every pass (checked against the source files, size and CRC of each):", ""]
    checks = [[r["system"], r["pass"], str(r["repeat"]), f"{r['bytes']:,}", f"{r['expected_bytes']:,}",
               "ok" if not r["wrong"] else f"**{r['wrong']} wrong**", f"{r['seconds']:.2f}", f"{r['load']:.2f}"]
              for r in result["runs"]]
    lines += harness.table(["system", "pass", "repeat", "bytes read", "source bytes", "check", "seconds",
                            "load"], checks)
    return lines


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=3)
    p.add_argument("--samples", type=int, help="samples (default 20000, --smoke 400)")
    p.add_argument("--shard-size", type=int, help="samples a shard (default 2500, --smoke 200)")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                   help=f"examples a block (default {BLOCK_SIZE}, the writer's default)")
    p.add_argument("--strategy", type=int, choices=(0, 1, 2, 3), default=DEFAULT_STRATEGY,
                   help=f"compression strategy (default {DEFAULT_STRATEGY}, the writer's default)")
    p.add_argument("--reads", type=int, help="samples a pass reads (default all, in the shuffled order)")
    p.add_argument("--cache-size", help="atlasfs --cache-size (default a quarter of the files' bytes)")
    p.add_argument("--seed", type=int, default=39)
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before each pass")
    p.add_argument("--media-venv", default=DEFAULT_MEDIA_VENV,
                   help="virtualenv for Pillow, created and installed from PyPI if missing (default bench/.venv-media)")
    p.add_argument("--no-squashfs", action="store_true", help="skip squashfuse_ll (its figures are reported missing)")
    p.add_argument("--no-install", action="store_true", help="install neither Pillow nor squashfuse if missing")
    args = harness.parse(p, argv)
    args.samples = args.samples or (400 if args.smoke else 20000)
    args.shard_size = args.shard_size or (200 if args.smoke else 2500)
    if args.samples < 1 or args.shard_size < 1 or (args.reads is not None and args.reads < 1):
        p.error("--samples, --shard-size and --reads must be >= 1")
    media_python = ensure_media_venv(args.media_venv, install=not args.no_install)
    if args.no_squashfs:
        reason, version = "skipped (--no-squashfs)", "missing"
    else:
        reason, version = ensure_squashfs(install=not args.no_install)
    if reason:
        log(f"squashfuse_ll figures are MISSING: {reason}")
    with harness.workspace("shuffle", args) as ws:
        result = run(args, ws, media_python, reason)
    notes = [f"{args.repeat} repeats; systems take turns (the order reversed every other repeat)"]
    if reason:
        notes.append(f"squashfuse_ll figures are MISSING: {reason}")
    if result["wrong"]:
        notes.append(f"**passes with wrong bytes**: {'; '.join(result['wrong'])}")
    meta = harness.meta("shuffle.py", args, repeat=args.repeat, samples=args.samples, notes=notes,
                        unavailable={"squashfuse_ll": reason} if reason else {}, squashfuse=version)
    harness.write_report("shuffle", args, "a shuffled epoch over real media: atlasfs, squashfuse_ll, tmpfs",
                         body(result, version), meta, result)
    if result["wrong"]:
        return 1
    return 2 if reason else 0


if __name__ == "__main__":
    harness.run_main(main)
