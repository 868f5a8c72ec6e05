#!/usr/bin/env python3
"""The training loaders' indexes of the tar view, timed (issue #36's target: "each index served in
under 1 s for a 2,500-sample shard (cold) and at the speed of a file read once stored").

    python bench/indexes.py                 # 2,500-sample shards, 3 repeats: bench/results/indexes/
    python bench/indexes.py --smoke         # 200-sample shards, 1 repeat (CI)

The data: one 2,500-sample shard of each set, made as the other benchmarks make them:

* ``media``: real JPEGs (bench/mediagen.py, ~40 KB), a ``cls`` and a ``json`` caption, written by
  ``AtlasWriter`` with its defaults (strategy 2, blocks of 64), as bench/shuffle.py makes them;
* ``image`` and ``text``: the synthetic sets of bench/datagen.py (their own block sizes, strategy 2);

each as its Atlas dataset and as its WebDataset tars (``atlasfs export``), each mounted with
``atlasfs mount --view tars``. For each index file (``MNT/<shard>.tar.idx``, ``MNT/<shard>.idx``
and ``MNT/.nv-meta/``'s ``.info.json``, ``split.yaml``, ``dataset.yaml``, ``index.sqlite``,
``index.uuid``), in a fresh mount (a new daemon) with the page cache dropped once the mount is up
(``sync; echo 3 > /proc/sys/vm/drop_caches`` as root; else the report says so), the time of its
first whole read (``open``, ``read`` by 1 MiB until the end, ``close``, in this process):

* **stored**: file tables and ``index.sqlite`` stored by ``atlasfs index`` (a user's second
  mount): the shard's tar is laid out from its stored table;
* **nothing stored**: the first mount ever (stored tables and the user cache removed first): the
  mount decodes the shard to build its table and sizes every file to lay out the tar;
* **again**: the same file read again in that mount (the median of 21 whole reads after the
  first), beside a plain file of the same bytes on tmpfs read the same way, and the READ requests
  the mount was sent in all (as many as one read's: the reads again were the page cache's).

Beside the "nothing stored" figures, the floor of a first mount, in a fresh process without the
mount: decoding every block of the shard once (the Atlas sets), building its file table with every
size, then laying out its tar; the index's own share is the rest. Every index's bytes must be the
same in every mode and from both sources (the tars are the same bytes): a difference fails the run
(exit 1).

Report: bench/results/indexes/indexes.md and indexes.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import zlib
from typing import Any

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from bench import datagen, harness, shuffle, systems

log = harness.log
SAMPLES = 2500
SMOKE_SAMPLES = 200
#: The issue's bound on a cold index's first read, seconds.
TARGET_SECONDS = 1.0
#: Reads again of each index (and of its tmpfs copy): their median is reported.
AGAIN = 21
META = (".nv-meta/.info.json", ".nv-meta/split.yaml", ".nv-meta/dataset.yaml", ".nv-meta/index.sqlite",
        ".nv-meta/index.uuid")
MODES = ("stored", "nothing stored")
SOURCES = ("atlas", "webdataset")
DATASETS = ("media", "image", "text")


def index_files(shard: str) -> list[str]:
    """The index files of a mount whose first shard is ``shard``, as the report names them."""
    return [f"{shard}.tar.idx", f"{shard}.idx", *META]


# -- the data


def prepare(name: str, workdir: str, samples: int, media_python: str | None, shards: int = 1) -> dict[str, Any]:
    """``shards`` shards of ``samples`` samples of set ``name``: {"atlas", "tars", "shards"} (made or reused)."""
    if name == "media":
        args = argparse.Namespace(samples=samples * shards, shard_size=samples, block_size=shuffle.BLOCK_SIZE,
                                  strategy=shuffle.DEFAULT_STRATEGY, seed=39)
        data = shuffle.prepare(args, workdir, media_python or "", False)
        tars = os.path.join(data["root"], "tars")
        if not os.path.exists(tars + ".done"):  # shuffle.py keeps the extracted files, not the tars
            _atlasfs("export", data["atlas"], tars)
            open(tars + ".done", "w").close()
        return {"atlas": data["atlas"], "tars": tars, "shards": data["shards"]}
    base = datagen.spec_for(name)
    spec = datagen.DatasetSpec(base.name, base.description, samples * shards, samples, base.block_size, base.seed)
    prepared = datagen.prepare(spec, os.path.join(workdir, f"indexes-{samples}" + (f"x{shards}" if shards > 1 else "")),
                               log)
    return {"atlas": prepared.atlas, "tars": prepared.tars, "shards": prepared.shards}


def _atlasfs(*args: str, env: dict[str, str] | None = None) -> None:
    result = subprocess.run([sys.executable, "-m", "atlasfs", *args], capture_output=True, check=False, text=True,
                            env=env)
    if result.returncode != 0:
        raise RuntimeError(f"atlasfs {' '.join(args)} failed: {result.stderr.strip()[-500:]}")


# -- the floor of a first mount, in process


def floor_in_process(dataset: str, decode: bool) -> None:
    """Print, as JSON, the seconds of: decoding every block of shard 0 (``decode``), building its
    file table with every size (no store), laying out its tar, then each index from that layout.
    Runs in a fresh process (:func:`floor`)."""
    from bench._atlasfs import BlockTree
    from atlasfs.formats.factory import SourceOptions, open_source
    from atlasfs.tree.tarview import TarView

    out: dict[str, float] = {}
    if decode:
        from bench.workloads import decode_shard
        out["decode"] = decode_shard(dataset).seconds
    tree = BlockTree(open_source(dataset, None, SourceOptions()))
    view = TarView(tree)
    shard = view.base.shard_folders()[0]
    out["table"] = harness.timed(lambda: tree.table(0, sizes=True)).seconds
    out["layout"] = harness.timed(lambda: view.layout(shard)).seconds
    for path in index_files(shard):
        out[path] = harness.timed(lambda: view.read(view.lookup("/" + path), 0, 1 << 30)).seconds
    view.loaders.close()
    print(json.dumps(out))


def floor(dataset: str, decode: bool) -> dict[str, float]:
    """:func:`floor_in_process` in a fresh process."""
    code = ("import sys\nfrom bench.indexes import floor_in_process\n"
            "floor_in_process(sys.argv[1], sys.argv[2] == '1')\n")
    result = subprocess.run([sys.executable, "-c", code, dataset, "1" if decode else "0"], capture_output=True,
                            text=True, check=False, cwd=harness.REPO)
    if result.returncode != 0:
        raise RuntimeError(f"the in-process floor of {dataset} failed: {result.stderr.strip()[-500:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# -- the reads


def read_whole(path: str) -> tuple[float, int, int]:
    """(seconds, size, CRC-32) of one whole read of ``path``: open, read by 1 MiB, close."""
    seconds, _, got = shuffle.readers_pass([path], 1)
    return seconds, got[0][0], got[0][1]


def reads_again(path: str, size: int, crc: int) -> float:
    """The median seconds of :data:`AGAIN` more whole reads of ``path``, each checked."""
    times = []
    for _ in range(AGAIN):
        seconds, got, check = read_whole(path)
        if (got, check) != (size, crc):
            raise RuntimeError(f"{path}: a read again gave other bytes than the first")
        times.append(seconds)
    return statistics.median(times)


def tmpfs_again(data: bytes, scratch: str) -> float:
    """:func:`reads_again` of a plain tmpfs file holding ``data`` (the index's bytes), read once first."""
    plain = os.path.join(scratch, "plain")
    with open(plain, "wb") as f:
        f.write(data)
    _, size, crc = read_whole(plain)
    return reads_again(plain, size, crc)


def daemon_reads(log_path: str) -> int | None:
    """The READ requests a mount was sent (C and Python, its last log line), None if not logged."""
    try:
        with open(log_path, errors="replace") as f:
            found = re.findall(r"read (\d+) in C, (\d+) in Python", f.read())
    except OSError:
        return None
    return int(found[-1][0]) + int(found[-1][1]) if found else None


def measure(system: systems.Atlasfs, files: list[str], mode: str, scratch: str, dropped: list[bool],
            drop: bool) -> list[dict[str, Any]]:
    """Each of ``files`` in its own fresh mount of ``system``: its first read (after the page cache
    is dropped), its reads again, a tmpfs file of its bytes read again, and the READ requests the
    daemon was sent in all."""
    out = []
    for path in files:
        if mode == "nothing stored":
            system.clear_metadata()
        with system.session() as view:
            if drop:
                dropped[0] = shuffle.drop_caches() and dropped[0]
            full = os.path.join(view.root, path)
            first, size, crc = read_whole(full)
            again = reads_again(full, size, crc)
            with open(full, "rb") as f:
                data = f.read()
            log_path = view.root + ".log"
        plain = tmpfs_again(data, scratch)
        out.append({"file": path, "mode": mode, "first": first, "again": again, "tmpfs again": plain,
                    "size": size, "crc": crc, "daemon reads": daemon_reads(log_path), "load": os.getloadavg()[0]})
        log(f"  {path:24} {mode:15} first {first * 1e3:8.1f} ms, again {again * 1e6:6.1f} us "
            f"(tmpfs {plain * 1e6:6.1f} us), {size:,} bytes, {out[-1]['daemon reads']} READs")
    return out


def run(args: argparse.Namespace, ws: harness.Workspace) -> dict[str, Any]:
    samples = SMOKE_SAMPLES if args.smoke else args.samples
    media_python = None
    if "media" in args.datasets:
        media_python = shuffle.ensure_media_venv(args.media_venv, install=not args.no_install)
    runs: list[dict[str, Any]] = []
    floors: dict[str, dict[str, float]] = {}
    wrong: list[str] = []
    dropped = [True]
    for name in args.datasets:
        data = prepare(name, ws.workdir, samples, media_python, args.shards)
        files = index_files(data["shards"][0])
        crcs: dict[str, tuple[int, int]] = {}
        for source in SOURCES:
            dataset = data["atlas"] if source == "atlas" else data["tars"]
            log(f"{name} ({source}): the floor of a first mount, in process")
            systems.Atlasfs(dataset, data["shards"], os.path.join(ws.scratch, "floor")).clear_metadata()
            floors[f"{name} {source}"] = floor(dataset, source == "atlas")
            state = os.path.join(ws.scratch, f"{name}-{source}")
            system = systems.Atlasfs(dataset, data["shards"], state, ["--view", "tars"])
            for repeat in range(args.repeat):
                for mode in MODES[::-1]:  # nothing stored first, then `atlasfs index`, then stored
                    if mode == "stored":
                        system.clear_metadata()
                        _atlasfs("index", system.dataset, env=system.env)
                    log(f"{name} ({source}), repeat {repeat + 1}/{args.repeat}: {mode}")
                    for r in measure(system, files, mode, ws.scratch, dropped, not args.no_drop_caches):
                        r.update(dataset=name, source=source, repeat=repeat + 1)
                        runs.append(r)
                        seen = crcs.setdefault(r["file"], (r["size"], r["crc"]))
                        if seen != (r["size"], r["crc"]):
                            wrong.append(f"{name} {source} {mode} {r['file']}: {r['size']} bytes, CRC {r['crc']:08x}"
                                         f"; first seen {seen[0]} bytes, CRC {seen[1]:08x}")
                            log(f"WRONG BYTES: {wrong[-1]}")
            system.clear_metadata()
    return {"samples": samples, "shards": args.shards, "runs": runs, "floors": floors, "wrong": wrong,
            "page_cache_dropped": dropped[0] and not args.no_drop_caches}


# -- the report


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per (dataset, source, file, mode): medians, min and max of each figure; the most READ
    requests a mount was sent and the median load."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault(f"{r['dataset']}|{r['source']}|{r['file']}|{r['mode']}", []).append(r)
    out: dict[str, dict[str, Any]] = {}
    for key, rs in groups.items():
        reads = [r["daemon reads"] for r in rs if r["daemon reads"] is not None]
        out[key] = {"size": rs[0]["size"], "daemon reads": max(reads) if reads else None,
                    "load": statistics.median(r["load"] for r in rs)}
        for figure in ("first", "again", "tmpfs again"):
            values = [r[figure] for r in rs]
            out[key][figure] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def _ms(stats: dict[str, float]) -> str:
    if stats["min"] == stats["max"]:
        return f"{stats['median'] * 1e3:,.1f}"
    return f"{stats['median'] * 1e3:,.1f} ({stats['min'] * 1e3:,.1f}–{stats['max'] * 1e3:,.1f})"


def body(result: dict[str, Any], figures: dict[str, dict[str, Any]], repeat: int) -> list[str]:
    lines = [("One" if result["shards"] == 1 else f"{result['shards']}") + f" {result['samples']:,}-sample shard"
             + ("" if result["shards"] == 1 else "s (the indexes of the first; `.nv-meta`'s of them all)")
             + " of each set, mounted with `atlasfs mount --view tars` from "
             "its Atlas dataset and from its WebDataset tars (`atlasfs export`). Each file is read in its own "
             "fresh mount, after " + ("dropping the page cache" if result["page_cache_dropped"]
                                     else "**not** dropping the page cache (not root, or --no-drop-caches)")
             + f" once the mount is up; medians of {repeat} (min–max). Target: a first read under "
             f"{TARGET_SECONDS:.0f} s (`met`: the worst run of both modes is under it). *stored*: tables and "
             "index.sqlite stored by `atlasfs index`; *nothing stored*: the first mount ever, which decodes the "
             "shard to build its file table, sizes every file and lays out the tar before answering.", "",
             "First whole read, ms:", ""]
    rows = []
    for key, f in figures.items():
        name, source, path, mode = key.split("|")
        if mode != "stored":
            continue
        cold = figures[f"{name}|{source}|{path}|nothing stored"]
        worst = max(f["first"]["max"], cold["first"]["max"])
        rows.append([name, source, path, f"{f['size']:,}", _ms(f["first"]), _ms(cold["first"]),
                     f"{TARGET_SECONDS / worst:.1f}", "met" if worst < TARGET_SECONDS else "**not met**",
                     f"{max(f['load'], cold['load']):.1f}"])
    lines += harness.table(["set", "source", "file", "bytes", "stored", "nothing stored",
                            "1 s ÷ worst", "under 1 s", "load"], rows)
    lines += ["", f"Read again in the same mount (tables stored; the median of {AGAIN} whole reads after the first), "
              "beside a tmpfs file of the same bytes read the same way, µs; and the READ requests the mount was "
              f"sent in all ({AGAIN + 2} whole reads: a count of one pass's means the reads again were the kernel's "
              "page cache):", ""]
    rows = []
    for key, f in figures.items():
        name, source, path, mode = key.split("|")
        if mode != "stored":
            continue
        ratio = f["again"]["median"] / f["tmpfs again"]["median"]
        rows.append([name, source, path, f"{f['size']:,}", f"{f['again']['median'] * 1e6:.1f}",
                     f"{f['tmpfs again']['median'] * 1e6:.1f}", f"{ratio:.2f}",
                     "?" if f["daemon reads"] is None else str(f["daemon reads"])])
    lines += harness.table(["set", "source", "file", "bytes", "mount, again", "tmpfs, again", "mount ÷ tmpfs",
                            "READs sent"], rows)
    lines += ["", "The floor of a first mount (nothing stored), in a fresh process without FUSE, ms: decoding every "
              "block of the shard once (Atlas), building its file table with every size, laying out its tar, "
              "then each index from that layout" + (":" if result["shards"] == 1 else
                                                    " (`.nv-meta`'s first also build every other shard's table):"),
              ""]
    rows = []
    for key, f in result["floors"].items():
        rest = [f"{f[p] * 1e3:,.1f}" for p in f if p not in ("decode", "table", "layout")]
        rows.append([key, f"{f['decode'] * 1e3:,.1f}" if "decode" in f else "-", f"{f['table'] * 1e3:,.1f}",
                     f"{f['layout'] * 1e3:,.1f}", *rest])
    any_floor = next(iter(result["floors"].values()), {})
    names = [p for p in any_floor if p not in ("decode", "table", "layout")]
    lines += harness.table(["set", "decode", "table, sized", "tar layout", *names], rows)
    if result["wrong"]:
        lines += ["", "**Indexes that differ between modes or sources:**", ""] + [f"- {w}" for w in result["wrong"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=3)
    p.add_argument("--samples", type=int, default=SAMPLES, help=f"samples of the shard (default {SAMPLES}; "
                                                                 f"--smoke {SMOKE_SAMPLES})")
    p.add_argument("--shards", type=int, default=1, help="shards of the dataset (default 1): .nv-meta's files "
                                                              "are made from every shard's tar")
    p.add_argument("--datasets", default=",".join(DATASETS), help=f"which sets (default {','.join(DATASETS)})")
    p.add_argument("--no-drop-caches", action="store_true", help="do not drop the page cache before each read")
    p.add_argument("--media-venv", default=shuffle.DEFAULT_MEDIA_VENV,
                   help="virtualenv for Pillow (the media set), created from PyPI if missing")
    p.add_argument("--no-install", action="store_true", help="do not install Pillow if it is missing")
    args = harness.parse(p, argv)
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    if args.samples < 1 or args.shards < 1 or not set(args.datasets) <= set(DATASETS) or not args.datasets:
        p.error(f"--samples and --shards must be >= 1 and --datasets a list of {', '.join(DATASETS)}")
    if not any(a == "--out" or a.startswith("--out=") for a in args.argv) and not args.smoke:
        args.out = os.path.join(harness.DEFAULT_OUT, "indexes")
    with harness.workspace("indexes", args) as ws:
        result = run(args, ws)
    figures = summary(result["runs"])
    notes = [f"{args.repeat} repeat{'s' if args.repeat != 1 else ''}; each index in its own fresh mount"]
    if result["wrong"]:
        notes.append("**indexes that differ between modes or sources**: " + "; ".join(result["wrong"]))
    meta = harness.meta("indexes.py", args, repeat=args.repeat, notes=notes)
    harness.write_report("indexes", args, "the loaders' indexes of the tar view: first read, stored and not",
                         body(result, figures, args.repeat), meta, {**result, "figures": figures})
    return 1 if result["wrong"] else 0


if __name__ == "__main__":
    harness.run_main(main)
