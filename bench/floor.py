#!/usr/bin/env python3
"""The floor under atlasfs: how fast can *any* tree served by atlasfs's FUSE engine be?

Mounts a trivial in-memory tree (N files of SIZE bytes, every lookup a dict hit, every read
a slice of one constant) with atlasfs's own ``serve`` (the native engine, docs/native.md;
mount options, read-ahead), and the same files materialized on tmpfs, then times
``tar cf - -C <folder> . | wc -c`` on each (cold: a fresh mount; then warm: a second pass),
and reads every file in a random order with 1 and with 4 reader processes at once, each on a
fresh mount (``xargs cat``; files/s of all readers together). The engine serves this tree
through its generic path, where every request calls the Python control plane (the
"floor (Python control plane)" lines): what the engine, libfuse 3 and the kernel cost per
file, with no decoding at all, bounds what a tree answered in Python can reach on small files.
The same files as an indexed Atlas dataset (blocks of 100, random bytes, ``atlasfs mount``)
are measured the same way (the "atlas" lines): the path a real mount takes, where the engine
answers flat shards' rows from their tables and reads from its byte cache in C.

    python bench/floor.py                            # 24,000 files of 1 KiB, then 4,500 of 100 KiB; 3 repeats
    python bench/floor.py --files 4500 --size 102400 # one case
    python bench/floor.py --smoke                    # 300 files of 1 KiB, one repeat

Report: bench/results/floor.md and floor.json (docs/performance.md, "The floor").
"""

from __future__ import annotations

import os
import random
import statistics
import sys

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import harness
from bench._atlasfs import Entry, Tree
from bench.systems import Atlasfs, ServedTree, Tmpfs
from bench.workloads import parallel_reads, tar_all

#: The default cases, (files, size): small files, and files of the image set's size.
CASES = [(24_000, 1024), (4_500, 102_400)]
SMOKE_CASE = (300, 1024)
#: The reader counts of the parallel reads.
READERS = (1, 4)
#: The report's name of the do-nothing tree's lines (every request answered in Python).
FLOOR = "floor (Python control plane)"


class ConstantTree(Tree):
    """``/d/000000.bin`` ... every file ``size`` bytes of ``x``."""

    def __init__(self, files: int, size: int) -> None:
        self.data = b"x" * size
        self.folder = Entry(True, 0, 0.0, 2)
        self.file_names = [f"{i:06d}.bin" for i in range(files)]
        self.files = {f"/d/{name}": Entry(False, size, 0.0, i + 10) for i, name in enumerate(self.file_names)}

    def lookup(self, path: str) -> Entry:
        if path in ("/", "/d"):
            return self.folder
        entry = self.files.get(path)
        if entry is None:
            raise OSError(2, "not found", path)
        return entry

    def listdir(self, path: str) -> list[tuple[str, Entry]]:
        if path == "/":
            return [("d", self.folder)]
        return [(name, self.files[f"/d/{name}"]) for name in self.file_names]

    def read(self, entry: Entry, offset: int, size: int) -> bytes:
        return self.data[offset:offset + size]


def readers_name(readers: int) -> str:
    """"1 reader", "4 readers"."""
    return f"{readers} reader{'s' * (readers > 1)}"


def measure(files: int, size: int, repeat: int, workdir: str) -> dict[str, list[float]]:
    """Seconds of every run: tar on tmpfs, and of the do-nothing tree cold (fresh mount) and warm
    (same mount), then its parallel random reads with 1 and 4 readers (fresh mounts); the same
    files as an Atlas dataset: tar cold, and the parallel reads."""
    folder = os.path.join(workdir, f"plain-{files}x{size}")
    os.makedirs(os.path.join(folder, "d"), exist_ok=True)
    data = b"x" * size
    for i in range(files):
        with open(os.path.join(folder, "d", f"{i:06d}.bin"), "wb") as f:
            f.write(data)
    tmpfs = Tmpfs(folder, ["d"])
    floor = ServedTree("floor", "bench.floor:ConstantTree", [files, size], ["d"], workdir)
    order = [f"d/{i:06d}.bin" for i in range(files)]
    random.Random(0).shuffle(order)
    results: dict[str, list[float]] = {"tmpfs": [], f"{FLOOR} cold": [], f"{FLOOR} warm": []}
    results |= {f"{FLOOR} {readers_name(readers)}": [] for readers in READERS}
    atlas = atlas_dataset(workdir, files, size)
    shards = sorted(name for name in os.listdir(atlas) if name.isdigit())
    mount = Atlasfs(atlas, shards, os.path.join(workdir, "atlas"))
    mount.prepare_metadata()
    with mount.session() as view:
        atlas_order = [f"{s}/{name}" for s in shards for name in sorted(os.listdir(view.shard_dirs[s]))]
    random.Random(0).shuffle(atlas_order)
    results["atlas cold"] = []
    results |= {f"atlas {readers_name(readers)}": [] for readers in READERS}
    for _ in range(repeat):
        with mount.session() as view:
            results["atlas cold"].append(tar_all(view, shards).seconds)
        for readers in READERS:
            with mount.session() as view:
                results[f"atlas {readers_name(readers)}"].append(parallel_reads(view, atlas_order, readers).seconds)
    for _ in range(repeat):
        with tmpfs.session() as view:
            results["tmpfs"].append(tar_all(view, ["d"]).seconds)
        with floor.session() as view:
            results[f"{FLOOR} cold"].append(tar_all(view, ["d"]).seconds)
            results[f"{FLOOR} warm"].append(tar_all(view, ["d"]).seconds)
        for readers in READERS:
            with floor.session() as view:
                results[f"{FLOOR} {readers_name(readers)}"].append(parallel_reads(view, order, readers).seconds)
    return results


def targets(results: dict[str, list[float]]) -> list[str]:
    """Issue #27's targets measured here, as ratios of medians (files/s, so inverse times)."""
    def rate(name: str) -> float:
        return 1 / statistics.median(results[name])

    tar = rate("atlas cold") / rate(f"{FLOOR} cold")
    readers = rate(f"atlas {readers_name(4)}") / rate(f"atlas {readers_name(1)}")
    return [f"atlas cold tar ÷ {FLOOR} cold tar: {tar:.2f} (target >= 0.80: {'met' if tar >= 0.8 else 'NOT met'})",
            f"atlas {readers_name(4)} ÷ atlas {readers_name(1)}: {readers:.2f} "
            f"(target >= 1.6: {'met' if readers >= 1.6 else 'NOT met'})"]


def atlas_dataset(workdir: str, files: int, size: int) -> str:
    """An Atlas dataset of ``files`` files of ``size`` random bytes (one field an example), in
    four shards of blocks of 100 examples, its tables stored by ``atlasfs index`` (run by the
    mount's ``prepare_metadata``)."""
    path = os.path.join(workdir, f"atlas-{files}x{size}")
    if not os.path.exists(os.path.join(path, "meta.json")):
        from atlasfs import AtlasWriter

        rng = random.Random(0)
        with AtlasWriter(path, shard_size=max(1, -(-files // 4)), block_size=100) as writer:
            for _ in range(files):
                writer.add_example({"bin": rng.randbytes(size)})
    return path


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=3)
    p.add_argument("--files", type=int, help="one case: this many files (default: the two cases above)")
    p.add_argument("--size", type=int, help="one case: files of this many bytes (default 1024 with --files)")
    args = harness.parse(p, argv)
    if args.files is not None or args.size is not None:
        cases = [(args.files or CASES[0][0], args.size or 1024)]
    else:
        cases = [SMOKE_CASE] if args.smoke else CASES
    body: list[str] = []
    data: dict[str, dict[str, list[float]]] = {}
    with harness.workspace("floor", args) as ws:
        for files, size in cases:
            harness.log(f"floor: {files:,} files of {size:,} bytes, {args.repeat} repeat(s)")
            results = measure(files, size, args.repeat, ws.workdir)
            data[f"{files}x{size}"] = results
            base = statistics.median(results["tmpfs"])
            rows = []
            for name, samples in results.items():
                median = statistics.median(samples)
                rows.append([name, f"{files / median:,.0f}", f"{files * size / median / 1e6:.1f}",
                             f"{min(samples):.3f}-{max(samples):.3f}", f"{base / median:.3f}"])
            body += [f"tar (tmpfs, cold, warm) and random reads by 1 or 4 processes at once (readers) of {files:,} "
                     f"files of {size:,} bytes, median of {args.repeat}; of tmpfs: against tmpfs's tar:", ""]
            body += harness.table(["tree", "files/s", "MB/s", "range (s)", "of tmpfs"], rows) + [""]
            body += [f"- {line}" for line in targets(results)] + [""]
    harness.write_report("floor", args, "the FUSE floor: a do-nothing tree answered by the Python control plane, and an Atlas "
                         "dataset whose rows C answers, through atlasfs's native engine, against tmpfs",
                         body, harness.meta("floor.py", args), {"cases": data})
    return 0


if __name__ == "__main__":
    harness.run_main(main)
