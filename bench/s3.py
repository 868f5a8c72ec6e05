#!/usr/bin/env python3
"""A dataset in a bucket: the mount's cold ``tar`` against fetching the shard whole, and its GETs.

In one run, against one moto S3 server on 127.0.0.1 (tests/s3server.py), with a
dataset of one shard of ~100 KiB incompressible images (bench/datagen.py's
``image`` examples; ~60 MiB of ``data.bin`` by default):

* ``fetch``: ``data.bin`` fetched whole with fsspec (``S3FileSystem.cat_file``) by a
  fresh file system: the yardstick, what the store gives one reader;
* ``cold tar``: ``atlasfs mount s3://...`` with an empty table cache, then
  ``tar cf - -C MNT <shard> | cat > /dev/null``: the listing (the shard's blocks
  decoded once to name its files) and the tar of every file, timed together;
* ``GETs``: the same cold mount and tar through a forwarder that counts requests
  (tests/tcpcut.py), against ceil(data.bin / window) + a small constant.

Prints MB/s (of ``data.bin``; the median of ``--repeat`` runs), the ratio cold tar /
fetch (target >= 0.5), and the GET count against its bound, with the commit and date.
Exits 1 if a target is missed.

Usage: python bench/s3.py [--examples 600] [--repeat 3] [--window 8M]
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "tests"))

from atlasfs import AtlasWriter  # noqa: E402
from atlasfs.sizes import parse_size  # noqa: E402
from bench import datagen  # noqa: E402
from bench.systems import host  # noqa: E402
from s3server import s3_server  # noqa: E402
from tcpcut import Forwarder  # noqa: E402

BUCKET = "atlasfs-bench"
PREFIX = "images"
#: Requests besides the windows of data.bin: the listing, the root meta.json and
#: dictionary, the shard's meta.json and index.npy, and slack for a block read
#: before the pass is recognised.
GET_SLACK = 8


def _commit() -> str:
    result = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (result.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def _atlasfs(*args: str, env: dict[str, str]) -> None:
    result = subprocess.run([sys.executable, "-m", "atlasfs", *args], capture_output=True, text=True,
                            env=env, timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"atlasfs {args[0]} failed: {result.stderr.strip()}")


def _cold_tar(url: str, endpoint: str, shard: str, window: int, workdir: str) -> float:
    """Seconds for a tar of ``shard`` through a fresh mount with an empty table cache."""
    mountpoint = tempfile.mkdtemp(prefix="mnt-", dir=workdir)
    cache = tempfile.mkdtemp(prefix="cache-", dir=workdir)
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    _atlasfs("mount", url, mountpoint, "--endpoint-url", endpoint, "-o", f"coalesce={window}", env=env)
    try:
        start = time.perf_counter()
        subprocess.run(f"tar cf - -C {mountpoint} {shard} | cat > /dev/null", shell=True, check=True)
        return time.perf_counter() - start
    finally:
        subprocess.run(["fusermount3", "-u", mountpoint], capture_output=True)
        os.rmdir(mountpoint)
        shutil.rmtree(cache, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=600, help="images in the shard (~100 KiB each)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--window", default="8M", help="the mount's coalescing size (-o coalesce=)")
    args = parser.parse_args()
    window = parse_size(args.window)
    workdir = tempfile.mkdtemp(prefix="atlasfs-bench-s3-")
    try:
        spec = datagen.DatasetSpec("image", "", examples=args.examples, shard_size=args.examples,
                                   block_size=8, seed=1)
        atlas = os.path.join(workdir, "atlas")
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
                start = time.perf_counter()
                assert len(fs.cat_file(key)) == data_size
                fetch.append(time.perf_counter() - start)
                tar.append(_cold_tar(url, server.endpoint, shard, window, workdir))
            with Forwarder(server.port) as forwarder:
                _cold_tar(url, forwarder.endpoint, shard, window, workdir)
                gets = forwarder.gets
                other = {k: v for k, v in forwarder.counts.items() if k != "GET"}
        fetch_s, tar_s = statistics.median(fetch), statistics.median(tar)
        ratio = fetch_s / tar_s
        bound = math.ceil(data_size / window) + GET_SLACK
        mb = data_size / 1e6
        print(f"# atlasfs on S3 (moto {_moto_version()} on 127.0.0.1), commit {_commit()}, "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
        print(f"# {host()}")
        print(f"# one shard: {args.examples} images, data.bin {mb:.1f} MB in blocks of 8; "
              f"window {args.window}; median of {args.repeat}")
        print()
        print("| measure | seconds | MB/s of data.bin |")
        print("| --- | --- | --- |")
        print(f"| fetch data.bin whole (fsspec cat_file) | {fetch_s:.3f} | {mb / fetch_s:.1f} |")
        print(f"| cold tar of the shard through the mount | {tar_s:.3f} | {mb / tar_s:.1f} |")
        print()
        ok_ratio = ratio >= 0.5
        ok_gets = gets <= bound and not other
        print(f"cold tar / fetch: {ratio:.2f} (target >= 0.5: {'met' if ok_ratio else 'MISSED'})")
        print(f"GET requests for the cold mount and tar: {gets} (bound ceil({data_size} / {window}) + "
              f"{GET_SLACK} = {bound}: {'met' if ok_gets else 'MISSED'}); other requests: {other or 'none'}")
        return 0 if ok_ratio and ok_gets else 1
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def _moto_version() -> str:
    from importlib.metadata import version

    return version("moto")


if __name__ == "__main__":
    sys.exit(main())
