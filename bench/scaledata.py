"""The data of ``bench/scale.py``: millions of small files, written once and kept.

An Atlas dataset of examples ``{"txt": 100-300 bytes of English-like text, "cls": int}`` (two
files an example), strategy 1 (each shard compressed on its own, so shards are written in
parallel processes with the writer's :class:`ShardWriter`), and ``atlasfs export -j N`` of it
(one WebDataset tar per shard, for ratarmount and for the export figure). The folder is reused
when its ``done.json`` matches the spec; else it is written again from nothing.

Each shard's worker also records what a ``tar cf`` of the shard's folder holds (files, and the
bytes of their headers and padded data), from the bytes of each file as WebDataset names them
(``txt``: the text in UTF-8, ``cls``: the integer in decimal), so that a ``tar`` through the
mount is checked by its byte count alone; the count is checked against each exported tar's size.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from atlasfs import AtlasDataset, CompressionStrategy
from bench import harness
from bench._atlasfs import FORMAT_VERSION, RootMeta, ShardWriter, index_key, index_key_width, shard_name_width
from bench.datagen import TextSource

#: Bump when the generator changes, so that kept data sets are written again.
GENERATOR_VERSION = 1
BLOCK = 512
RECORD = 10240
#: Text of each ``txt`` file, in bytes (its tar member is then one 512-byte block of data).
TEXT_BYTES = (100, 300)


@dataclass(frozen=True)
class Spec:
    """What to write: ``examples`` examples (two files each) in shards of ``shard_examples``."""

    examples: int
    shard_examples: int
    block_size: int = 256
    seed: int = 26

    @property
    def shards(self) -> int:
        return -(-self.examples // self.shard_examples)


@dataclass
class ShardFacts:
    """One shard as written: its folder name, examples, files and the bytes ``tar cf`` gives of
    its members (headers and padded data, without the folder's own entry and the end blocks)."""

    name: str
    examples: int
    files: int
    file_bytes: int
    member_bytes: int

    def tar_cf_bytes(self) -> int:
        """Bytes of ``tar cf - -C <shard folder> .`` (GNU tar: a ``./`` entry, the members, two
        end blocks, padded to a 10 KiB record)."""
        return -(-(BLOCK + self.member_bytes + 2 * BLOCK) // RECORD) * RECORD

    def export_bytes(self) -> int:
        """Bytes of the shard's ``atlasfs export`` tar: the members, two end blocks, a record."""
        return -(-(self.member_bytes + 2 * BLOCK) // RECORD) * RECORD


@dataclass
class Data:
    """The kept data set: where its forms are and what is in them."""

    spec: Spec
    atlas: str
    tars: str
    shards: list[ShardFacts]
    seconds: dict[str, float]
    reused: bool

    @property
    def files(self) -> int:
        return sum(s.files for s in self.shards)

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.shards]


def file_name(spec: Spec, index: int, field: str) -> str:
    """``<shard>/<key>.<field>``: the path of example ``index``'s file in the mount."""
    shard = str(index // spec.shard_examples).zfill(shard_name_width(spec.shards))
    return f"{shard}/{index_key(index, index_key_width(spec.examples))}.{field}"


def example_files(spec: Spec, index: int, example: dict[str, object]) -> dict[str, bytes]:
    """The files of ``example`` as WebDataset writes them (what the mount must show)."""
    return {file_name(spec, index, "cls"): str(example["cls"]).encode(),
            file_name(spec, index, "txt"): str(example["txt"]).encode("utf-8")}


def _padded(size: int) -> int:
    return BLOCK + -(-size // BLOCK) * BLOCK


def _write_shard(spec: Spec, number: int, folder: str) -> ShardFacts:
    """Write shard ``number`` into ``folder/<number>`` (a process of its own)."""
    first = number * spec.shard_examples
    count = min(spec.shard_examples, spec.examples - first)
    rng = np.random.default_rng([spec.seed, number])
    text = TextSource(rng)
    path = os.path.join(folder, str(number))
    shutil.rmtree(path, ignore_errors=True)
    writer = ShardWriter(path, spec.block_size, CompressionStrategy.STANDARD_COMPRESSION, 3, 0.01, None)
    file_bytes = member_bytes = 0
    for index in range(first, first + count):
        example = {"txt": text.text(*TEXT_BYTES), "cls": index % 1000}
        writer.add(example)
        for data in (str(example["cls"]).encode(), example["txt"].encode("utf-8")):
            file_bytes += len(data)
            member_bytes += _padded(len(data))
    meta = writer.close()
    with open(os.path.join(path, "meta.json"), "w") as f:
        f.write(meta.to_json())
    return ShardFacts(str(number).zfill(shard_name_width(spec.shards)), count, 2 * count, file_bytes, member_bytes)


def prepare(spec: Spec, workdir: str, jobs: int, log: Callable[[str], None]) -> Data:
    """The data set of ``spec`` in ``workdir`` (``atlas/``, ``tars/``), reused if ``done.json``
    matches, else written: shards in ``jobs`` processes, then ``atlasfs export -j jobs``."""
    atlas, tars = os.path.join(workdir, "atlas"), os.path.join(workdir, "tars")
    stamp_path = os.path.join(workdir, "done.json")
    key = {"generator": GENERATOR_VERSION, "spec": asdict(spec)}
    done = harness.kept(stamp_path, key)
    if done is not None:
        return Data(spec, atlas, tars, [ShardFacts(**s) for s in done["shards"]], done["seconds"], True)
    for stale in (stamp_path, atlas, tars, atlas + ".partial"):
        if os.path.isdir(stale):
            shutil.rmtree(stale)
        elif os.path.exists(stale):
            os.unlink(stale)
    os.makedirs(workdir, exist_ok=True)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    partial = atlas + ".partial"
    os.makedirs(partial)
    log(f"writing {spec.examples:,} examples ({2 * spec.examples:,} files) as Atlas: {spec.shards} shards of "
        f"{spec.shard_examples:,}, blocks of {spec.block_size}, strategy 1, {jobs} processes")
    with ProcessPoolExecutor(jobs) as pool:
        shards = list(pool.map(_write_shard, [spec] * spec.shards, range(spec.shards), [partial] * spec.shards))
    width = shard_name_width(spec.shards)
    for number in range(spec.shards):
        os.rename(os.path.join(partial, str(number)), os.path.join(partial, str(number).zfill(width)))
    with open(os.path.join(partial, "meta.json"), "w") as f:
        f.write(RootMeta(FORMAT_VERSION, tuple(s.examples for s in shards),
                         CompressionStrategy.STANDARD_COMPRESSION).to_json())
    os.rename(partial, atlas)
    seconds["atlas"] = time.perf_counter() - start
    log(f"Atlas written in {seconds['atlas']:.0f} s; atlasfs export -j {jobs}")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "atlasfs", "export", "-j", str(jobs), atlas, tars],
                            capture_output=True, check=False, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"atlasfs export {atlas} failed: {result.stderr.strip()[-500:]}")
    seconds["tars"] = time.perf_counter() - start
    for shard in shards:  # the counted bytes are those atlasfs writes
        size = os.path.getsize(os.path.join(tars, f"{shard.name}.tar"))
        if size != shard.export_bytes():
            raise RuntimeError(f"{tars}/{shard.name}.tar: {size} bytes, {shard.export_bytes()} expected from "
                               "the files written")
    log(f"tars written in {seconds['tars']:.0f} s")
    harness.keep(stamp_path, key, shards=[asdict(s) for s in shards], seconds=seconds)
    return Data(spec, atlas, tars, shards, seconds, False)


def sample(data: Data, count: int, seed: int) -> dict[str, bytes]:
    """The bytes of the files of ``count`` examples picked at random (``txt`` and ``cls``), read
    through the Atlas library (:class:`atlasfs.AtlasDataset`), not through a mount."""
    rng = np.random.default_rng(seed)
    found: dict[str, bytes] = {}
    with AtlasDataset(data.atlas, cache_bytes=16 << 20) as dataset:
        for index in sorted(set(rng.integers(0, data.spec.examples, size=count).tolist())):
            found.update(example_files(data.spec, index, dataset[index]))
    return found
