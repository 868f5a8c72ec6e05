#!/usr/bin/env python3
"""The floor under atlasfs: how fast can *any* tree served by our FUSE adapter be?

Mounts a trivial in-memory tree (N files of SIZE bytes, every lookup a dict hit, every read
a slice of one constant) with atlasfs's own ``serve`` (adapter, mount options, read-ahead),
and the same files materialized on tmpfs, then times ``tar cf - -C <folder> . | wc -c`` on
each (cold: a fresh mount; then warm: a second pass). What the adapter, libfuse 3 and the
kernel cost per file, with no decoding at all, bounds what atlasfs can reach on small files.

    python bench/floor.py                 # 24,000 files of 1 KiB, 3 repeats
    python bench/floor.py --files 4500 --size 102400
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from atlasfs.tree import Entry, Tree  # noqa: E402
from bench.systems import View, is_mounted, unmount  # noqa: E402
from bench.workloads import tar_all  # noqa: E402

_SERVE = """
import sys
sys.path.insert(0, {repo!r})
from bench.floor import ConstantTree
from atlasfs.mount import MountOptions, serve
serve(ConstantTree({files}, {size}), {mnt!r}, MountOptions(foreground=True), "floor", lambda: print("ready", flush=True))
"""


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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=24_000)
    p.add_argument("--size", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    work = tempfile.mkdtemp(prefix="atlasfs-floor-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        plain = os.path.join(work, "plain", "d")
        os.makedirs(plain)
        data = b"x" * args.size
        for i in range(args.files):
            with open(os.path.join(plain, f"{i:06d}.bin"), "wb") as f:
                f.write(data)
        results: dict[str, list[float]] = {"tmpfs": [], "adapter cold": [], "adapter warm": []}
        for _ in range(args.repeat):
            results["tmpfs"].append(tar_all(View("tmpfs", plain, {"d": plain}), ["d"]).seconds)
            mnt = tempfile.mkdtemp(prefix="mnt-", dir=work)
            code = _SERVE.format(repo=repo, files=args.files, size=args.size, mnt=mnt)
            daemon = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            try:
                # "ready" once the mount answers and its read-ahead is set, as atlasfs mount waits for
                if daemon.stdout is None or daemon.stdout.readline().strip() != "ready" or not is_mounted(mnt):
                    raise SystemExit("floor: the mount did not come up")
                view = View("floor", mnt, {"d": os.path.join(mnt, "d")})
                results["adapter cold"].append(tar_all(view, ["d"]).seconds)
                results["adapter warm"].append(tar_all(view, ["d"]).seconds)
            finally:
                unmount(mnt, daemon)
        base = statistics.median(results["tmpfs"])
        print(f"tar of {args.files:,} files of {args.size:,} bytes, median of {args.repeat}:")
        for name, samples in results.items():
            median = statistics.median(samples)
            print(f"  {name:13s} {args.files / median:10,.0f} files/s  {args.files * args.size / median / 1e6:8.1f} MB/s"
                  f"  ({min(samples):.3f}-{max(samples):.3f} s)  {base / median:.3f} of tmpfs")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
