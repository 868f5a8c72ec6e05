#!/usr/bin/env python3
"""A dataset in a bucket: the mount's cold ``tar`` against fetching the shard whole, and its GETs.

In one run, against one moto S3 server on 127.0.0.1 (tests/support/s3server.py), with a
dataset of one shard of ~100 KiB incompressible images (bench/datagen.py's
``image`` examples; ~60 MiB of ``data.bin`` by default):

* ``fetch``: ``data.bin`` fetched whole with fsspec (``S3FileSystem.cat_file``) by a
  fresh file system: the yardstick, what the store gives one reader;
* ``cold tar``: ``atlasfs mount s3://...`` with an empty table cache, then
  ``tar cf - -C MNT <shard> | cat > /dev/null``: the listing (the shard's blocks
  decoded once to name its files) and the tar of every file, timed together;
* ``GETs``: the same cold mount and tar through a forwarder that counts requests
  (tests/support/tcpcut.py), against ceil(data.bin / window) + a small constant.

Prints MB/s (of ``data.bin``; the median of ``--repeat`` runs), the ratio cold tar /
fetch (target >= 0.5), and the GET count against its bound. Exits 1 if a target is missed.

    python bench/s3.py [--examples 600] [--repeat 3] [--window 8M]
    python bench/s3.py --smoke        # 40 images, one repeat

Report: bench/results/s3.md and s3.json.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys

if __package__ in (None, ""):  # run as a script: make `bench` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from atlasfs import AtlasWriter
from bench import datagen, harness
from bench._atlasfs import parse_size
from bench.systems import Atlasfs

sys.path.insert(0, os.path.join(harness.REPO, "tests", "support"))  # the tests' moto server and counting forwarder
from s3server import s3_server
from tcpcut import Forwarder

BUCKET = "atlasfs-bench"
PREFIX = "images"
#: Requests besides the windows of data.bin: the listing, the root meta.json and
#: dictionary, the shard's meta.json and index.npy, and slack for a block read
#: before the pass is recognised.
GET_SLACK = 8


def cold_tar(url: str, endpoint: str, shard: str, window: int, workdir: str) -> float:
    """Seconds for a tar of ``shard`` through a fresh mount with an empty table cache."""
    system = Atlasfs(url, [shard], workdir, extra_args=["--endpoint-url", endpoint, "-o", f"coalesce={window}"])
    with system.session(fresh_metadata=True) as view:
        return harness.timed(lambda: subprocess.run(f"tar cf - -C {view.root} {shard} | cat > /dev/null",
                                                    shell=True, check=True)).seconds


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__.split("\n\n")[0], repeat=3)
    p.add_argument("--examples", type=int, help="images in the shard (~100 KiB each; default 600, --smoke 40)")
    p.add_argument("--window", default="8M", help="the mount's coalescing size (-o coalesce=)")
    args = harness.parse(p, argv)
    examples = args.examples or (40 if args.smoke else 600)
    window = parse_size(args.window)
    with harness.workspace("s3", args) as ws:
        spec = datagen.DatasetSpec("image", "", examples=examples, shard_size=examples, block_size=8, seed=1)
        atlas = os.path.join(ws.scratch, "atlas")
        with AtlasWriter(atlas, shard_size=spec.shard_size, block_size=spec.block_size,
                         compression_strategy=1) as writer:
            writer.add_examples(datagen.image_examples(spec))
        shard = next(n for n in sorted(os.listdir(atlas)) if n.isdigit())
        data_size = os.path.getsize(os.path.join(atlas, shard, "data.bin"))
        with s3_server() as server:
            server.make_bucket(BUCKET)
            url = f"s3://{BUCKET}/{PREFIX}"
            server.upload(atlas, url)
            key = f"{BUCKET}/{PREFIX}/{shard}/data.bin"
            fetch, tar = [], []
            for _ in range(args.repeat):
                fs = server.filesystem()
                got = harness.timed(lambda: fs.cat_file(key))
                if len(got.answer) != data_size:
                    raise RuntimeError(f"fetched {len(got.answer)} bytes of {key}, {data_size} expected")
                fetch.append(got.seconds)
                tar.append(cold_tar(url, server.endpoint, shard, window, ws.scratch))
            with Forwarder(server.port) as forwarder:
                cold_tar(url, forwarder.endpoint, shard, window, ws.scratch)
                gets = forwarder.gets
                other = {k: v for k, v in forwarder.counts.items() if k != "GET"}
    fetch_s, tar_s = statistics.median(fetch), statistics.median(tar)
    ratio = fetch_s / tar_s
    bound = math.ceil(data_size / window) + GET_SLACK
    mb = data_size / 1e6
    ok_ratio = ratio >= 0.5
    ok_gets = gets <= bound and not other
    notes = [f"moto {_moto_version()} on 127.0.0.1",
             f"one shard: {examples} images, data.bin {mb:.1f} MB in blocks of 8; window {args.window}; "
             f"median of {args.repeat}"]
    body = harness.table(["measure", "seconds", "MB/s of data.bin"],
                         [["fetch data.bin whole (fsspec cat_file)", f"{fetch_s:.3f}", f"{mb / fetch_s:.1f}"],
                          ["cold tar of the shard through the mount", f"{tar_s:.3f}", f"{mb / tar_s:.1f}"]])
    body += ["", f"cold tar / fetch: {ratio:.2f} (target >= 0.5: {'met' if ok_ratio else 'MISSED'})", "",
             f"GET requests for the cold mount and tar: {gets} (bound ceil({data_size} / {window}) + "
             f"{GET_SLACK} = {bound}: {'met' if ok_gets else 'MISSED'}); other requests: {other or 'none'}"]
    data = {"examples": examples, "data_bytes": data_size, "window": window, "fetch_s": fetch, "cold_tar_s": tar,
            "ratio": ratio, "gets": gets, "get_bound": bound, "other_requests": other}
    harness.write_report("s3", args, "atlasfs on S3: cold tar against a whole fetch, and its GETs", body,
                         harness.meta("s3.py", args, notes=notes), data)
    return 0 if ok_ratio and ok_gets else 1


def _moto_version() -> str:
    from importlib.metadata import version

    return version("moto")


if __name__ == "__main__":
    harness.run_main(main)
