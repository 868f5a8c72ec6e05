#!/usr/bin/env python3
"""The daemon's memory against its bound, on datasets far larger than its cache.

    python bench/memory.py             # the full run (~5 minutes on 2 cores): bench/results/memory-latest.md
    python bench/memory.py --smoke     # seconds: small sizes, bench/results/smoke/ (tests/bench/test_bench_memory.py runs it)

Two cases, each on a fresh ``atlasfs mount -f --cache-size SIZE`` with nothing stored:

* **large**: float arrays and text (the issue's kind of data), at least 16 times the cache bound
  in ``data.bin``. The daemon's RSS (``VmRSS``) after ``ls -R MNT``, after ``tar cf - -C MNT .``
  (every member checked against the library's bytes), and its maximum, sampled every 20 ms,
  while 16 threads read random files for 30 s (every read checked); each beside the bound,
  the cache bound plus the stated fixed overhead, whatever the number of files (since issue
  #26). Wrong bytes are counted, and must be 0.
* **listing**: 1,000,000 small examples (two files each) across 100 shards; RSS after
  ``find MNT | wc -l`` beside the bound, on a first mount (tables built) and a second one
  (tables loaded from the store).

RSS is read from ``/proc/PID/status``; the peak (``VmHWM``) is shown too. The exit code is 0
when every figure is within its bound and no byte was wrong, 2 otherwise (the report is
written either way). See docs/performance.md, "Memory".
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

import numpy as np

from atlasfs import AtlasDataset, AtlasWriter
from bench import harness, systems
from bench._atlasfs import BlockTree, parse_size
from bench.datagen import TextSource
from bench.systems import rss

MiB = 1 << 20
log = harness.log
#: Bump when a generator changes, so that kept data sets are rebuilt.
GENERATOR_VERSION = 1
#: What the daemon may use beyond its cache bound, whatever the number of files it has listed,
#: read or tarred (docs/performance.md, "Memory"): since issue #26 stored file tables are mapped,
#: at most atlasfs.tree.table.tables.RESIDENT_TABLE_BYTES of them at once (16 MiB), inside this.
FIXED_OVERHEAD = 100 * MiB
#: How often the readers' phase samples the daemon's RSS.
SAMPLE_SECONDS = 0.02


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = harness.parser(__doc__, repeat=None)
    p.add_argument("--cache-size", default=None, help="the mount's --cache-size (default 8M, --smoke 1M)")
    p.add_argument("--ratio", type=float, default=16.0,
                   help="the large dataset's data.bin bytes, in cache bounds (default 16)")
    p.add_argument("--seconds", type=float, help="the random readers' phase (default 30, --smoke 2)")
    p.add_argument("--readers", type=int, default=16, help="concurrent random readers (default 16)")
    p.add_argument("--listing-examples", type=int, help="examples of the listing case (default 1,000,000; "
                                                       "--smoke 20,000; 0 skips it)")
    p.add_argument("--listing-shards", type=int, help="shards of the listing case (default 100, --smoke 10)")
    args = harness.parse(p, argv)
    args.cache_bytes = parse_size(args.cache_size or ("1M" if args.smoke else "8M"))
    if args.seconds is None:
        args.seconds = 2.0 if args.smoke else 30.0
    if args.listing_examples is None:
        args.listing_examples = 20_000 if args.smoke else 1_000_000
    if args.listing_shards is None:
        args.listing_shards = 10 if args.smoke else 100
    return args


# -- the data


def large_examples(count: int, seed: int) -> Iterator[dict[str, Any]]:
    """Float arrays and text: an 8 KiB ``npy`` array of random doubles (incompressible), 2-8 KiB
    of English-like ``txt``, a ``cls`` int and a small ``json`` dict."""
    rng = np.random.default_rng(seed)
    text = TextSource(rng)
    for i in range(count):
        yield {"npy": rng.random(1024), "txt": text.text(2 << 10, 8 << 10), "cls": i % 1000,
               "json": {"id": i, "score": round(float(rng.random()), 4)}}


def small_examples(count: int, seed: int) -> Iterator[dict[str, Any]]:
    """A ``cls`` int and a short ``txt``: many small files."""
    rng = random.Random(seed)
    words = ["cat", "dog", "tree", "river", "stone", "cloud", "field", "bird", "light", "road"]
    for i in range(count):
        yield {"cls": i % 1000, "txt": " ".join(rng.choices(words, k=rng.randint(3, 8)))}


@dataclass
class Dataset:
    """A generated Atlas dataset and what is in it."""

    name: str
    path: str
    examples: int
    shards: int
    data_bytes: int
    shard_names: list[str] = field(default_factory=list)


def _data_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, s, "data.bin")) for s in os.listdir(path)
               if os.path.isfile(os.path.join(path, s, "data.bin")))


def generate(workdir: str, name: str, kind: str, examples: int, shards: int, block_size: int) -> Dataset:
    """Write (or reuse) dataset ``name`` of ``examples`` examples of ``kind`` in ``shards`` shards."""
    path = os.path.join(workdir, name, "atlas")
    stamp_path = os.path.join(workdir, name, "done.json")
    key = {"generator": GENERATOR_VERSION, "kind": kind, "examples": examples, "shards": shards, "block": block_size}
    if harness.kept(stamp_path, key) is not None:
        return _described(name, path, examples, shards)
    shutil.rmtree(os.path.join(workdir, name), ignore_errors=True)
    os.makedirs(os.path.join(workdir, name))
    log(f"{name}: writing {examples:,} examples in {shards} shards")
    source = large_examples if kind == "large" else small_examples
    with AtlasWriter(path, shard_size=-(-examples // shards), block_size=block_size, compression_strategy=2) as writer:
        writer.add_examples(source(examples, seed=7))
    harness.keep(stamp_path, key)
    return _described(name, path, examples, shards)


def _described(name: str, path: str, examples: int, shards: int) -> Dataset:
    names = sorted((s for s in os.listdir(path) if s.isdigit()), key=int)
    return Dataset(name, path, examples, shards, _data_bytes(path), names)


def expected_files(dataset: Dataset) -> dict[str, tuple[int, int]]:
    """``shard/name`` -> (size, CRC-32) of every file, read through the library, not the mount."""
    tree = BlockTree(AtlasDataset(dataset.path), cache_bytes=64 * MiB)
    found = {}
    for path, entry in tree.walk("/"):
        data = tree.read(entry, 0, entry.size)
        found[path] = (len(data), zlib.crc32(data))
    return found


class Reference:
    """The right bytes of any file, to count how many of a wrong read's bytes differ."""

    def __init__(self, dataset: Dataset) -> None:
        self.tree = BlockTree(AtlasDataset(dataset.path), cache_bytes=16 * MiB)
        self.lock = threading.Lock()

    def wrong_bytes(self, path: str, got: bytes) -> int:
        with self.lock:
            entry = self.tree.lookup("/" + path)
            right = self.tree.read(entry, 0, entry.size)
        return sum(a != b for a, b in zip(got, right)) + abs(len(got) - len(right))


# -- the daemon's memory


@dataclass
class Figure:
    """One measured RSS beside its bound."""

    case: str
    step: str
    rss: int
    peak: int
    bound: int
    files: int
    note: str = ""

    @property
    def within(self) -> bool:
        return self.rss <= self.bound and self.peak <= self.bound


def bound(cache_bytes: int) -> int:
    """The stated bound: the cache bound + the fixed overhead, whatever the number of files."""
    return cache_bytes + FIXED_OVERHEAD


def mapped_and_anonymous(pid: int) -> str:
    """What process ``pid``'s RSS is made of, for a note: ``RssFile`` (mapped files: libraries, and
    the file tables), ``RssShmem`` (files mapped from a tmpfs: the tables when the cache is on
    /dev/shm, as in the default work folder) and ``RssAnon`` (the heap)."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("RssFile:", "RssShmem:", "RssAnon:")):
                key, value = line.split(":")
                values[key] = int(value.split()[0]) * 1024
    return (f"file {values['RssFile'] / MiB:.0f} + shmem {values['RssShmem'] / MiB:.0f} + "
            f"anon {values['RssAnon'] / MiB:.0f} MiB")


def shell(command: str, cwd: str | None = None) -> str:
    """Run ``command`` in bash (``pipefail``); its stdout, stripped. Raises RuntimeError naming the
    command and its stderr if it fails."""
    result = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True, text=True, cwd=cwd,
                            check=False)
    if result.returncode != 0:
        raise RuntimeError(f"{command}: exit {result.returncode}: {result.stderr.strip()[-500:]}")
    return result.stdout.strip()


def check_tar(root: str, expected: dict[str, tuple[int, int]], reference: Reference) -> tuple[int, int, int]:
    """``tar cf - -C root .``, every member checked: (files, bytes, wrong bytes)."""
    process = subprocess.Popen(["tar", "cf", "-", "-C", root, "."], stdout=subprocess.PIPE)
    assert process.stdout is not None
    files = total = wrong = 0
    with tarfile.open(fileobj=process.stdout, mode="r|") as archive:
        for member in archive:
            if not member.isfile():
                continue
            path = member.name.removeprefix("./")
            extracted = archive.extractfile(member)
            data = extracted.read() if extracted is not None else b""
            files += 1
            total += len(data)
            if expected.get(path) != (len(data), zlib.crc32(data)):
                wrong += reference.wrong_bytes(path, data) if path in expected else len(data)
    if process.wait() != 0:
        raise RuntimeError(f"tar of {root} exited with {process.returncode}")
    missing = len(expected) - files
    if missing:
        raise RuntimeError(f"tar of {root} holds {files} files, {len(expected)} expected")
    return files, total, wrong


def random_readers(root: str, expected: dict[str, tuple[int, int]], reference: Reference, pid: int,
                   readers: int, seconds: float) -> tuple[int, int, int, int, int]:
    """``readers`` threads reading random whole files for ``seconds`` while the daemon's RSS is
    sampled: (reads, bytes, wrong bytes, max RSS, errors)."""
    paths = sorted(expected)
    deadline = time.monotonic() + seconds
    counts = {"reads": 0, "bytes": 0, "wrong": 0, "errors": 0}
    lock = threading.Lock()
    peak = [0]

    def read(seed: int) -> None:
        rng = random.Random(seed)
        reads = size = wrong = errors = 0
        while time.monotonic() < deadline:
            path = rng.choice(paths)
            try:
                fd = os.open(os.path.join(root, path), os.O_RDONLY)
                try:
                    chunks = []
                    while chunk := os.read(fd, 1 << 20):
                        chunks.append(chunk)
                finally:
                    os.close(fd)
            except OSError:
                errors += 1
                continue
            data = b"".join(chunks)
            reads += 1
            size += len(data)
            if expected[path] != (len(data), zlib.crc32(data)):
                wrong += reference.wrong_bytes(path, data)
        with lock:
            for key, value in (("reads", reads), ("bytes", size), ("wrong", wrong), ("errors", errors)):
                counts[key] += value

    def sample() -> None:
        while time.monotonic() < deadline:
            peak[0] = max(peak[0], rss(pid)[0])
            time.sleep(SAMPLE_SECONDS)

    threads = [threading.Thread(target=read, args=(seed,)) for seed in range(readers)]
    threads.append(threading.Thread(target=sample))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    peak[0] = max(peak[0], rss(pid)[0])
    return counts["reads"], counts["bytes"], counts["wrong"], peak[0], counts["errors"]


def large_case(dataset: Dataset, args: argparse.Namespace, workdir: str, figures: list[Figure]) -> dict[str, Any]:
    log("large: the right bytes of every file, through the library")
    expected = expected_files(dataset)
    reference = Reference(dataset)
    files = len(expected)
    limit = bound(args.cache_bytes)
    system = systems.Atlasfs(dataset.path, dataset.shard_names, os.path.join(workdir, "large-mount"),
                             extra_args=["--cache-size", str(args.cache_bytes)])
    system.clear_metadata()
    facts: dict[str, Any] = {"files": files}
    with system.session() as view:
        assert view.pid is not None
        now, top = rss(view.pid)
        figures.append(Figure("large", "mounted", now, top, limit, files))
        log("large: ls -R")
        lines = int(shell(f"ls -R {shlex.quote(view.root)} | wc -l"))
        now, top = rss(view.pid)
        figures.append(Figure("large", "after `ls -R`", now, top, limit, files, f"{lines:,} lines"))
        log("large: tar of the whole mount, every member checked")
        run = harness.timed(lambda: check_tar(view.root, expected, reference))
        (tar_files, tar_bytes, wrong), seconds = run.answer, run.seconds
        now, top = rss(view.pid)
        figures.append(Figure("large", "after `tar cf - -C MNT .`", now, top, limit, files,
                              f"{tar_files:,} files, {tar_bytes / MiB:.0f} MiB in {seconds:.0f} s, {wrong} wrong bytes"))
        facts["tar_wrong_bytes"] = wrong
        log(f"large: {args.readers} random readers for {args.seconds:.0f} s")
        reads, size, wrong, top_sampled, errors = random_readers(view.root, expected, reference, view.pid,
                                                                 args.readers, args.seconds)
        now, top = rss(view.pid)
        figures.append(Figure("large", f"max during {args.readers} random readers, {args.seconds:.0f} s",
                              top_sampled, max(top, top_sampled), limit, files,
                              f"{reads:,} reads, {size / MiB:.0f} MiB, {wrong} wrong bytes, {errors} errors; "
                              f"after: {mapped_and_anonymous(view.pid)}"))
        facts.update(reads=reads, read_wrong_bytes=wrong, read_errors=errors)
    return facts


def listing_case(dataset: Dataset, args: argparse.Namespace, workdir: str, figures: list[Figure]) -> dict[str, Any]:
    system = systems.Atlasfs(dataset.path, dataset.shard_names, os.path.join(workdir, "listing-mount"),
                             extra_args=["--cache-size", str(args.cache_bytes)])
    system.clear_metadata()
    facts: dict[str, Any] = {}
    limit = bound(args.cache_bytes)
    for step in ("first mount, tables built", "second mount, tables stored"):  # stored by the first
        with system.session() as view:
            assert view.pid is not None
            mounted, _ = rss(view.pid)
            log(f"listing: find MNT | wc -l, {step}")
            run = harness.timed(lambda: int(shell(f"find {shlex.quote(view.root)} | wc -l")))
            lines, seconds = run.answer, run.seconds
            now, top = rss(view.pid)
            files = lines - 1 - dataset.shards  # the mount point and the shard folders are not files
            figures.append(Figure("listing", f"after `find MNT \\| wc -l`, {step}", now, top, limit, files,
                                  f"{lines:,} lines in {seconds:.1f} s; {(now - mounted) / files:.0f} B a file "
                                  f"over the RSS at mount; {mapped_and_anonymous(view.pid)}"))
            facts[step] = files
    return facts


# -- the report


def body(meta: dict[str, Any], datasets: list[Dataset], figures: list[Figure]) -> list[str]:
    """The report's tables: the datasets, then every RSS beside its bound."""
    lines = harness.table(["dataset", "examples", "shards", "data.bin", "× cache bound"],
                          [[d.name, f"{d.examples:,}", str(d.shards), f"{d.data_bytes / MiB:.1f} MiB",
                            f"{d.data_bytes / meta['cache_bytes']:.1f}"] for d in datasets])
    lines += [""] + harness.table(
        ["case", "after", "RSS", "peak (VmHWM)", "bound", "within", "files", "notes"],
        [[f.case, f.step, f"{f.rss / MiB:.1f} MiB", f"{f.peak / MiB:.1f} MiB", f"{f.bound / MiB:.1f} MiB",
          "yes" if f.within else "**NO**", f"{f.files:,}", f.note] for f in figures])
    return lines


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    figures: list[Figure] = []
    datasets: list[Dataset] = []
    facts: dict[str, Any] = {}
    with harness.workspace("memory", args) as ws:
        workdir = ws.workdir
        # ~10.5 KiB of data.bin an example: enough examples for the ratio asked, in 8 shards
        per_example = 10_500
        examples = max(800, int(args.ratio * args.cache_bytes * 1.05 / per_example) // 8 * 8)
        large = generate(workdir, "large", "large", examples, 8, 64 if not args.smoke else 16)
        while large.data_bytes < args.ratio * args.cache_bytes:  # the estimate was short: more examples
            examples = int(examples * args.ratio * args.cache_bytes / large.data_bytes * 1.02) // 8 * 8 + 8
            large = generate(workdir, "large", "large", examples, 8, 64 if not args.smoke else 16)
        datasets.append(large)
        facts["large"] = large_case(large, args, workdir, figures)
        if args.listing_examples:
            listing = generate(workdir, "listing", "small", args.listing_examples, args.listing_shards, 256)
            datasets.append(listing)
            facts["listing"] = listing_case(listing, args, workdir, figures)

    notes = [f"cache bound (`--cache-size`): {args.cache_bytes / MiB:g} MiB; bound = cache bound + "
             f"{FIXED_OVERHEAD // MiB} MiB, whatever the number of files"]
    meta = harness.meta("memory.py", args, cache_bytes=args.cache_bytes, cache_mib=args.cache_bytes / MiB,
                        notes=notes)
    data = {"datasets": [{"name": d.name, "examples": d.examples, "shards": d.shards, "data_bytes": d.data_bytes}
                         for d in datasets],
            "figures": [{**vars(f), "within": f.within} for f in figures], "facts": facts}
    harness.write_report("memory-latest", args, "atlasfs daemon memory against its bound",
                         body(meta, datasets, figures), meta, data)
    wrong = facts["large"]["tar_wrong_bytes"] + facts["large"]["read_wrong_bytes"] + facts["large"]["read_errors"]
    return 0 if all(f.within for f in figures) and wrong == 0 else 2


if __name__ == "__main__":
    harness.run_main(main)
