"""Strategy-0 Atlas datasets whose blocks are bigger than 256 KiB (small files kept inline are
tied to such a block by the CRC-32 of all its stored bytes), and damage to them that keeps
data.bin's size and mtime (tests/unit/tree/test_located_big_blocks.py,
tests/mount/test_located_big_blocks_mount.py)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from locateddata import write_dataset

#: Examples a block: 8 of ~40 KB make a block of ~320 KiB.
BLOCK_EXAMPLES = 8
#: The URL every example's json holds, and what :func:`damage` makes of it in a block.
URL, CHANGED_URL = b"http://x/", b"http://z/"


def big_block_examples(n: int = 24, seed: int = 0) -> list[dict[str, Any]]:
    """A JPEG-sized run of random bytes, a ``cls`` int and a small ``json`` dict each."""
    rng = np.random.default_rng(seed)
    return [{"jpg": rng.bytes(40_000), "cls": i, "json": {"id": i, "url": f"{URL.decode()}{i}.jpg"}}
            for i in range(n)]


def write_big_blocks(root: Path, n: int = 24) -> Path:
    """An Atlas dataset of :func:`big_block_examples` stored as they are (strategy 0), one shard."""
    dataset = write_dataset(root, big_block_examples(n), 0, block_size=BLOCK_EXAMPLES)
    starts = np.load(dataset / "0" / "index.npy")
    assert min(np.diff(starts)) > 256 << 10, np.diff(starts)  # every block past the old bound
    return dataset


def small_files(exported: dict[str, bytes]) -> list[str]:
    """The names of the inline files (``.cls``, ``.json``) of a shard's export, in order."""
    return [name for name in exported if name.endswith((".cls", ".json"))]


def block_of(name: str) -> int:
    """The block of a file named ``<index key>.<suffix>`` of :func:`write_big_blocks`."""
    return int(name.split("/")[-1].split(".")[0]) // BLOCK_EXAMPLES


def damage(dataset: Path, changed: tuple[int, ...], broken: int) -> None:
    """Change the JSON URLs of the blocks ``changed`` (same size: every ``.json`` of them reads
    otherwise now) and break block ``broken`` (its last bytes zeroed: it no longer unpickles),
    keeping data.bin's size and mtime (only its ctime tells). Waits past the clock's tick first."""
    data = dataset / "0" / "data.bin"
    starts = np.load(dataset / "0" / "index.npy")
    st = data.stat()
    raw = bytearray(data.read_bytes())
    for block in changed:
        start, end = int(starts[block]), int(starts[block + 1])
        assert raw.count(URL, start, end) == BLOCK_EXAMPLES
        raw[start:end] = bytes(raw[start:end]).replace(URL, CHANGED_URL)
    end = int(starts[broken + 1])
    raw[end - 64:end] = bytes(64)
    time.sleep(0.05)  # a later tick than the file's last change (HZ >= 100): a new ctime
    data.write_bytes(bytes(raw))
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert data.stat().st_size == st.st_size and data.stat().st_mtime_ns == st.st_mtime_ns


def wait_unchanged_for(path: Path, seconds: float) -> None:
    """Wait until ``path`` last changed ``seconds`` ago (a reader then remembers fingerprints)."""
    st = path.stat()
    left = max(st.st_ctime_ns, st.st_mtime_ns) / 1e9 + seconds - time.time()
    if left > 0:
        time.sleep(left)
