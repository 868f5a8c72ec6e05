#!/usr/bin/env python3
"""Probe for issue #18: how many files of the benchmark's three data sets get a span
(atlasfs/formats/atlas/spans/), what finding them adds to a table build, and what a cold read of
one file costs through its span against the block path, in one run.

    python bench/spans_probe.py                  # default sizes (bench/datagen.py), strategy 2
    python bench/spans_probe.py --smoke          # small sizes: seconds
    python bench/spans_probe.py --strategies 0,1,2,3 --reads 500 --workdir /var/tmp/spans

Without FUSE: both read paths are timed as the tree would run them, from the
stored blocks (data.bin in the page cache), with nothing cached between reads:

* block path: read the block, decompress it, unpickle it, name the example and
  encode its files (what ``BlockTree`` does for a file whose block is not cached);
* span path: :func:`atlasfs.formats.atlas.spans.read_span` through a ``BlockReader`` (``pread``
  of the run for strategy 0; otherwise the frame read and decompressed up to the
  run's end), CRC checked. Like the block path (whose codec keeps its zstd
  contexts), it reuses one decompression context per shard: a fresh context
  costs ~70 µs more on its first frame (its buffers), which would measure
  allocation rather than reading.

Each sampled file is read both ways, alternately, and the two results compared.

``--checksum xxh3`` measures what the xxhash package's XXH3 (32 of its bits) would
give instead of CRC-32 (it must be importable; atlasfs does not depend on it).
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

import zstandard

if __package__ in (None, ""):  # run as a script: make `bench` and `atlasfs` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    __package__ = "bench"

from atlasfs import AtlasDataset, AtlasWriter
from bench import datagen, harness
from bench._atlasfs import (
    MAX_NAME_BYTES,
    Locators,
    Shard,
    encode_as,
    example_fields,
    index_key_width,
    safe_loads,
    spans,
)

BlockReader, Span, find_spans = spans.BlockReader, spans.Span, spans.find_spans
new_decompressor, read_span = spans.new_decompressor, spans.read_span

#: Bump when what the probe writes changes, so that kept data sets are rewritten.
PROBE_DATA_VERSION = 1


@dataclass
class SetResult:
    """What the probe measured on one data set under one strategy."""

    name: str
    strategy: int
    checksum: str
    files: int = 0
    files_with_span: int = 0
    bytes_total: int = 0
    bytes_with_span: int = 0
    blocks: int = 0
    decode_s: float = 0.0  # read + decompress + unpickle, all blocks
    naming_s: float = 0.0
    spans_s: float = 0.0
    span_columns_bytes: int = 0
    block_path_us: list[float] = field(default_factory=list)
    span_path_us: list[float] = field(default_factory=list)


def _dataset(spec: datagen.DatasetSpec, strategy: int, workdir: str) -> str:
    """The Atlas form of ``spec`` under ``strategy`` in ``workdir``, written unless kept there."""
    root = os.path.join(workdir, f"{spec.name}-s{strategy}")
    stamp = {"probe": PROBE_DATA_VERSION, "generator": datagen.GENERATOR_VERSION, "spec": asdict(spec),
             "strategy": strategy}
    stamp_path = root + ".json"
    if os.path.isdir(root) and harness.kept(stamp_path, stamp) is not None:
        return root
    shutil.rmtree(root, ignore_errors=True)
    harness.log(f"{spec.name}: writing {spec.examples} examples (shards of {spec.shard_size}, blocks of "
        f"{spec.block_size}, strategy {strategy})")
    with AtlasWriter(root, shard_size=spec.shard_size, block_size=spec.block_size,
                     compression_strategy=strategy) as writer:
        writer.add_examples(datagen.GENERATORS[spec.name](spec))
    harness.keep(stamp_path, stamp)
    return root


def _build(dataset: AtlasDataset, result: SetResult) -> list[tuple[int, int, int, int, Span | None]]:
    """What a table build would do, block by block, timed: decode, name, find spans.
    Returns every file as ``(shard position, block, example in block, file of example, span)``."""
    max_suffix = MAX_NAME_BYTES - 1 - index_key_width(len(dataset))
    files = []
    spans_flat: list[Span | None] = []
    for s, shard in enumerate(dataset.shards):
        for block in range(shard.num_blocks):
            where = f"{shard.data_path} block {block}"
            t0 = time.perf_counter()
            raw = shard.read_raw(block)
            payload = shard.codec.decompress(raw, where)
            examples = safe_loads(payload, trust=False, where=where)
            t1 = time.perf_counter()
            fields = [example_fields(example, max_suffix)[0] for example in examples]
            t2 = time.perf_counter()
            spans = find_spans(payload, fields)
            t3 = time.perf_counter()
            result.decode_s += t1 - t0
            result.naming_s += t2 - t1
            result.spans_s += t3 - t2
            result.blocks += 1
            for pos, (named, found) in enumerate(zip(fields, spans)):
                for j, ((suffix, value), span) in enumerate(zip(named, found)):
                    size = span.size if span is not None else len(encode_as(suffix, value))
                    result.files += 1
                    result.bytes_total += size
                    if span is not None:
                        result.files_with_span += 1
                        result.bytes_with_span += size
                    files.append((s, block, pos, j, span))
                    spans_flat.append(span)
    columns = Locators.build(spans_flat)
    result.span_columns_bytes = columns.nbytes() if columns is not None else 0
    return files


def _block_path(shard: Shard, block: int, pos: int, j: int, max_suffix: int) -> bytes:
    """A cold read through the block: decode it, name and encode the one example (all its files)."""
    examples, _ = shard.decode_block(block)
    fields = example_fields(examples[pos], max_suffix)[0]
    encoded = [encode_as(suffix, value) for suffix, value in fields]
    return encoded[j]


def _span_path(shard: Shard, fd: int, block: int, span: Span, dctx: zstandard.ZstdDecompressor | None) -> bytes:
    """A cold read through the span: the block's stored bytes read only as far as needed."""
    start = int(shard.index[block])
    reader = BlockReader(lambda offset, size: os.pread(fd, size, start + offset), int(shard.index[block + 1]) - start)
    return read_span(reader, span, shard.codec, f"{shard.data_path} block {block}", dctx)


def _cold_reads(dataset: AtlasDataset, files: list[tuple[int, int, int, int, Span | None]], reads: int,
                seed: int, result: SetResult) -> None:
    max_suffix = MAX_NAME_BYTES - 1 - index_key_width(len(dataset))
    with_span = [f for f in files if f[4] is not None]
    rng = random.Random(seed)
    sample = [rng.choice(with_span) for _ in range(reads)] if with_span else []
    fds = {s: os.open(shard.data_path, os.O_RDONLY) for s, shard in enumerate(dataset.shards)}
    dctxs = {s: new_decompressor(shard.codec) if shard.codec.strategy else None
             for s, shard in enumerate(dataset.shards)}
    try:
        for k, (s, block, pos, j, span) in enumerate(sample):
            shard = dataset.shards[s]
            assert span is not None
            runs = []
            # Alternate which path goes first, so that neither always finds the other's
            # data in the CPU caches.
            order = ("block", "span") if k % 2 else ("span", "block")
            for path in order:
                if path == "block":
                    run = harness.timed(lambda: _block_path(shard, block, pos, j, max_suffix))
                else:
                    run = harness.timed(lambda: _span_path(shard, fds[s], block, span, dctxs[s]))
                runs.append((path, run.seconds * 1e6, run.answer))
            (_, _, first), (_, _, second) = runs
            if first != second:
                raise AssertionError(f"{shard.data_path} block {block} example {pos} file {j}: paths differ")
            for path, us, _ in runs:
                (result.block_path_us if path == "block" else result.span_path_us).append(us)
    finally:
        for fd in fds.values():
            os.close(fd)


def _row(r: SetResult) -> dict[str, str]:
    block = statistics.median(r.block_path_us) if r.block_path_us else float("nan")
    span = statistics.median(r.span_path_us) if r.span_path_us else float("nan")
    mean_ratio = (statistics.fmean(r.span_path_us) / statistics.fmean(r.block_path_us)
                  if r.block_path_us else float("nan"))
    # A random cold read over all files: files without a span keep the block path's cost.
    share = r.files_with_span / r.files if r.files else 0.0
    mixed = share * (span / block) + (1 - share) if r.block_path_us else float("nan")
    return {
        "set": r.name,
        "strategy": str(r.strategy),
        "checksum": r.checksum,
        "files": f"{r.files}",
        "with span": f"{100 * share:.1f}%",
        "of bytes": f"{100 * r.bytes_with_span / max(r.bytes_total, 1):.1f}%",
        "decode/blk": f"{1e6 * r.decode_s / max(r.blocks, 1):.0f} µs",
        "naming/blk": f"{1e6 * r.naming_s / max(r.blocks, 1):.0f} µs",
        "find_spans/blk": f"{1e6 * r.spans_s / max(r.blocks, 1):.0f} µs",
        "spans/decode": f"{r.spans_s / max(r.decode_s, 1e-12):.2f}",
        "spans/(decode+naming)": f"{r.spans_s / max(r.decode_s + r.naming_s, 1e-12):.2f}",
        "columns B/file": f"{r.span_columns_bytes / max(r.files, 1):.1f}",
        "cold block path": f"{block:.0f} µs",
        "cold span path": f"{span:.0f} µs",
        "span/block (median)": f"{span / block:.2f}",
        "span/block (mean)": f"{mean_ratio:.2f}",
        "all files (est.)": f"{mixed:.2f}",
    }


def main(argv: list[str] | None = None) -> int:
    p = harness.parser(__doc__, repeat=None)
    p.add_argument("--datasets", default="image,text,tiny", help="comma-separated subset of image,text,tiny")
    p.add_argument("--strategies", default="2", help="comma-separated compression strategies (default 2, the bench's)")
    p.add_argument("--reads", type=int, default=300, help="cold reads sampled per data set and strategy")
    p.add_argument("--seed", type=int, default=18)
    p.add_argument("--checksum", choices=("crc32", "xxh3"), default="crc32",
                   help="the run checksum (default crc32, atlasfs's; xxh3 needs the xxhash package)")
    args = harness.parse(p, argv)
    names = [n.strip() for n in args.datasets.split(",") if n.strip()]
    strategies = [int(s) for s in args.strategies.split(",") if s.strip()]
    if args.checksum == "xxh3":
        try:
            import xxhash
        except ImportError:
            p.error("--checksum xxh3 needs the xxhash package")
        # every check of the package takes its checksum from spans/find.py
        spans.find._crc32 = lambda data, seed=0: xxhash.xxh3_64_intdigest(data, seed=seed) & 0xFFFFFFFF

    results = []
    with harness.workspace("spans", args) as ws:
        for name in names:
            spec = datagen.spec_for(name, smoke=args.smoke)
            for strategy in strategies:
                root = _dataset(spec, strategy, ws.workdir)
                with AtlasDataset(root, cache_bytes=0) as dataset:
                    result = SetResult(name, strategy, args.checksum)
                    harness.log(f"{name} s{strategy}: decoding, naming and finding spans in every block")
                    files = _build(dataset, result)
                    harness.log(f"{name} s{strategy}: {args.reads} cold reads each way")
                    _cold_reads(dataset, files, args.reads, args.seed, result)
                results.append(result)
    rows = [_row(r) for r in results]
    notes = [f"{', '.join(names)}; strategies {strategies}; {args.checksum}; {args.reads} cold reads each; "
             f"{'smoke' if args.smoke else 'default'} sizes"]
    body = harness.table(list(rows[0]), [list(row.values()) for row in rows]) if rows else []
    harness.write_report("spans_probe", args, "spans probe (issue #18)", body,
                         harness.meta("spans_probe.py", args, notes=notes), {"results": [asdict(r) for r in results]})
    return 0


if __name__ == "__main__":
    harness.run_main(main)
