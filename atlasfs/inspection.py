"""``atlasfs info``, ``verify`` and ``show``: looking at a dataset without mounting it."""

from __future__ import annotations

import itertools
import os
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .errors import AtlasFormatError
from .sources.atlas.dataset import AtlasDataset, BrokenShard, Shard
from .sources.atlas.meta import CompressionStrategy
from .sources.source import Source, SourceShard

#: Above this many blocks, ``info`` skips reading frame headers for the ratio.
RATIO_MAX_BLOCKS = 100_000
_FRAME_HEADER_MAX = 18


def _files_bytes(path: str) -> int:
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def _stored_bytes(dataset: AtlasDataset) -> int:
    """Bytes of every file under the dataset's root (objects, for one in a bucket)."""
    if not dataset.storage.remote:
        return _files_bytes(dataset.root)
    total = 0
    folders = [dataset.root]
    while folders:
        folder = folders.pop()
        for name, is_dir in dataset.storage.listdir(folder):
            path = f"{folder}/{name}"
            if is_dir:
                folders.append(path)
            else:
                total += (dataset.storage.stat(path) or (0, 0))[0]
    return total


def _decoded_size(shard: Shard) -> int | None:
    """Sum of the blocks' decompressed sizes, from their zstd frame headers (None if a
    frame does not record it). Raises :class:`AtlasFormatError` for a bad header."""
    if shard.meta.compression_strategy == CompressionStrategy.NO_COMPRESSION:
        return shard.data_size
    total: int | None = 0
    if shard.storage.remote:  # the headers of every block, in a few coalesced GETs
        ranges = [(int(shard.index[b]), min(_FRAME_HEADER_MAX, shard.stored_block_size(b)))
                  for b in range(shard.num_blocks)]
        for b, header in enumerate(shard.storage.read_ranges(shard.data_path, ranges)):
            size = shard.codec.check_header(header, f"{shard.data_path} block {b}")
            total = None if total is None or size < 0 else total + size
        return total
    with open(shard.data_path, "rb") as f:
        for b in range(shard.num_blocks):
            header = os.pread(f.fileno(), _FRAME_HEADER_MAX, int(shard.index[b]))
            size = shard.codec.check_header(header, f"{shard.data_path} block {b}")
            total = None if total is None or size < 0 else total + size
    return total


def info_lines(dataset: AtlasDataset) -> tuple[list[str], int]:
    """A readable summary of ``dataset``: totals, then one line per shard; and how many
    shards have problems.

    Besides what opening checks, it validates every block's frame header
    (magic, dictionary, claimed size) when there are at most
    :data:`RATIO_MAX_BLOCKS` blocks; only ``verify`` decodes the blocks. A shard that
    could not be opened (a :class:`BrokenShard`, with ``tolerate_broken_shards``) or
    has a bad frame header is one line saying what is wrong; the totals are the others'.
    """
    on_disk = _stored_bytes(dataset)
    check_frames = dataset.num_blocks <= RATIO_MAX_BLOCKS
    problems = {s: str(shard.error) for s, shard in enumerate(dataset.shards) if shard.error is not None}
    decoded: list[int | None] = [None] * len(dataset.shards)
    for s, shard in enumerate(dataset.shards):
        if check_frames and s not in problems:
            try:
                decoded[s] = _decoded_size(shard)
            except AtlasFormatError as exc:
                problems[s] = str(exc)
    good = [s for s in range(len(dataset.shards)) if s not in problems]
    stored = sum(dataset.shards[s].data_size for s in good)
    lines = [
        f"dataset      {dataset.root}",
        f"examples     {sum(len(dataset.shards[s]) for s in good)}",
        f"shards       {len(dataset.shards)}" + (f" ({len(problems)} with problems, below)" if problems else ""),
        f"blocks       {sum(dataset.shards[s].num_blocks for s in good)}",
        f"strategy     {int(dataset.meta.compression_strategy)} ({dataset.meta.compression_strategy.name.lower()}) at the root",
        f"on disk      {on_disk} bytes ({stored} in data.bin files)",
    ]
    if check_frames and stored and all(decoded[s] is not None for s in good):
        total = sum(decoded[s] or 0 for s in good)
        lines.append(f"decoded      {total} bytes of pickle (compression ratio {total / stored:.2f})")
    checked = "metadata, indexes and frame headers" if check_frames else "metadata and indexes"
    lines.append(f"checked      {checked} (atlasfs verify decodes every block)")
    lines.append("")
    lines.append(f"{'shard':>8} {'examples':>10} {'blocks':>8} {'block_size':>10} {'strategy':>8} {'data.bin':>12} {'ratio':>6}")
    for s, (shard, size) in enumerate(zip(dataset.shards, decoded)):
        if s in problems:
            lines.append(f"{shard.name:>8} problem: {problems[s]}")
            continue
        ratio = f"{size / shard.data_size:.2f}" if size is not None and shard.data_size else "-"
        lines.append(f"{shard.name:>8} {len(shard):>10} {shard.num_blocks:>8} {shard.meta.block_size:>10} "
                     f"{int(shard.meta.compression_strategy):>8} {shard.data_size:>12} {ratio:>6}")
    return lines, len(problems)


@dataclass
class VerifyReport:
    """What ``verify`` found: problems (each one line naming a file) and what was checked."""

    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    shards: int = 0
    blocks: int = 0
    examples: int = 0


def verify(root: str, *, trust_pickle: bool = False,
           on_block: Callable[[], None] | None = None,
           on_total: Callable[[int], None] | None = None) -> VerifyReport:
    """Check everything: metas, indexes and every block of every shard.

    Unlike a plain open, a bad shard does not stop the check: each problem is
    reported and the other shards are still decoded.
    """
    report = VerifyReport()
    try:
        dataset = AtlasDataset(root, cache_bytes=0, trust_pickle=trust_pickle, mmap_index=False,
                               tolerate_broken_shards=True)
    except AtlasFormatError as exc:
        report.problems.append(str(exc))
        return report
    with dataset:
        shards = [s for s in dataset.shards if not isinstance(s, BrokenShard)]
        report.problems.extend(str(s.error) for s in dataset.shards if isinstance(s, BrokenShard))
        sizes = [len(s) for s in dataset.shards]
        if not report.problems and list(dataset.meta.shard_sizes) != sizes:
            report.warnings.append(
                f"{os.path.join(root, 'meta.json')}: shard_sizes {list(dataset.meta.shard_sizes)} differ from the "
                f"shards' stored_examples {sizes} (informational only; the shards' values are used)")
        _decode_all(report, shards, on_total, on_block)
    return report


def _decode_all(report: VerifyReport, shards: list[Any], on_total: Callable[[int], None] | None,
                on_block: Callable[[], None] | None) -> None:
    """Decode every block of ``shards`` into ``report``: what was checked and each failure."""
    if on_total is not None:
        on_total(sum(shard.num_blocks for shard in shards))
    for shard in shards:
        report.shards += 1
        for b in range(shard.num_blocks):
            try:
                report.examples += len(shard.decode_block(b)[0])
            except AtlasFormatError as exc:
                report.problems.append(str(exc))
            report.blocks += 1
            if on_block is not None:
                on_block()


def _prepared(shard: SourceShard) -> SourceShard:
    """The shard after its pass over its files (raises :class:`AtlasFormatError`)."""
    if shard.error is not None:
        raise shard.error
    shard.prepare()
    return shard


def source_info_lines(source: Source) -> tuple[list[str], int]:
    """A readable summary of a source of any format: totals, then one line per shard
    (a shard that cannot be read: one line saying why); and how many shards cannot be
    read. Shards that need a pass over their files (Dolma) make it."""
    rows = []
    problems = 0
    for shard in source.shards:
        try:
            _prepared(shard)
        except AtlasFormatError as exc:
            rows.append(f"{shard.name}: {exc}")
            problems += 1
            continue
        samples = sum(shard.block_length(b) for b in range(shard.num_blocks))
        rows.append((shard.name, samples, shard.num_blocks, shard.data_size))
    good = [row for row in rows if isinstance(row, tuple)]
    width = max([len(row[0]) for row in good] + [5])
    lines = [*source.info(),
             f"samples      {sum(row[1] for row in good)}",
             f"shards       {len(rows)}" + (f" ({problems} unreadable)" if problems else ""),
             f"blocks       {sum(row[2] for row in good)}",
             f"on disk      {sum(row[3] for row in good)} bytes",
             "checked      layout and indexes (atlasfs verify decodes every block)",
             "",
             f"{'shard':<{width}} {'samples':>10} {'blocks':>8} {'bytes':>12}"]
    for row in rows:
        lines.append(row if isinstance(row, str) else f"{row[0]:<{width}} {row[1]:>10} {row[2]:>8} {row[3]:>12}")
    return lines, problems


def verify_source(opener: Callable[[], Source], *, on_block: Callable[[], None] | None = None,
                  on_total: Callable[[int], None] | None = None) -> VerifyReport:
    """Check a source of any format: open it, make every shard's pass, decode every block.
    Every problem is reported (one line each) and the check goes on."""
    report = VerifyReport()
    try:
        source = opener()
    except AtlasFormatError as exc:
        report.problems.append(str(exc))
        return report
    with source:
        ready = []
        for shard in source.shards:
            try:
                ready.append(_prepared(shard))
            except AtlasFormatError as exc:
                report.problems.append(str(exc))
                continue
            report.problems.extend(shard.problems())
        report.problems.extend(source.problems())
        _decode_all(report, ready, on_total, on_block)
    return report


def locate(source: Source, index: int) -> tuple[SourceShard, int, int]:
    """``(shard, block, position)`` of the sample at ``index`` over all shards (negative:
    from the end); raises IndexError saying how many samples there are."""
    places = []
    for shard in source.shards:
        _prepared(shard)
        places.extend((shard, b, shard.block_length(b)) for b in range(shard.num_blocks))
    total = sum(length for _, _, length in places)
    i = index + total if index < 0 else index
    if not 0 <= i < total:
        raise IndexError(f"index {index} out of range: the dataset has {total} samples")
    for shard, block, length in places:
        if i < length:
            return shard, block, i
        i -= length
    raise AssertionError("unreachable")


def describe(value: Any, indent: str = "") -> list[str]:
    """Readable lines for one example: fields with types, sizes and a short preview."""
    if isinstance(value, dict):
        lines = [f"{indent}{type(value).__name__} with {len(value)} fields"]
        for name, field_value in value.items():
            lines.append(f"{indent}  {name!r}: {_summary(field_value)}")
        return lines
    return [f"{indent}{_summary(value)}"]


class _InOrder(reprlib.Repr):
    """reprlib's short repr, but a dict keeps the example's own key order (reprlib sorts keys)."""

    def repr_dict(self, x: dict, level: int) -> str:
        if not x:
            return "{}"
        if level <= 0:
            return "{...}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}"
                  for k, v in itertools.islice(x.items(), self.maxdict)]
        if len(x) > self.maxdict:
            pieces.append("...")
        return "{" + ", ".join(pieces) + "}"


_short = _InOrder()
_short.maxstring = 80
_short.maxother = 80
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 8


def _summary(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return f"{type(value).__name__}, {len(value)} bytes: {_short.repr(bytes(value[:48]))}"
    if isinstance(value, np.ndarray):
        preview = np.array2string(value, threshold=8, edgeitems=2, max_line_width=60).replace("\n", " ")
        return f"ndarray {value.dtype} {value.shape}: {preview}"
    if isinstance(value, str):
        return f"str, {len(value)} chars: {_short.repr(value)}"
    return f"{type(value).__name__}: {_short.repr(value)}"
