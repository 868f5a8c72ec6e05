"""atlasfs.formats.atlas.spans: every span found holds exactly the file's bytes, reads give them back
without unpickling, and a block that changed since is detected, never served."""

from __future__ import annotations

import os
import pickle
import shutil
import tempfile
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from atlasfs import AtlasDataset, AtlasFormatError, AtlasWriter
from atlasfs.formats import safepickle
from atlasfs.formats.atlas.codec import BlockCodec
from atlasfs.formats.atlas.dataset import Shard
from atlasfs.formats.atlas.meta import CompressionStrategy
from atlasfs.formats.atlas.spans import (
    INLINE_MAX,
    BlockReader,
    Span,
    SpanMismatch,
    block_fingerprint,
    check_run,
    file_locators,
    find_spans,
    read_span,
    run_check,
)
from atlasfs.formats.naming import MAX_NAME_BYTES, encode_as, example_fields, index_key_width
from atlasfs.tree.table.filetable import Locators
from atlasfs.tree.table.layout import NO_LOCATOR
from helpers import REFERENCE, reference_names

# ---------------------------------------------------------------- helpers


def _blocks(root: Path) -> Iterator[tuple[Shard, int, bytes, bytes, list[list[tuple[str, Any]]]]]:
    """``(shard, block, stored bytes, decompressed pickle, files named as the tree names them)``
    of every block of the dataset at ``root``."""
    dataset = AtlasDataset(root, cache_bytes=0)
    max_suffix = MAX_NAME_BYTES - 1 - index_key_width(len(dataset))
    try:
        for shard in dataset.shards:
            for block in range(shard.num_blocks):
                where = f"{shard.data_path} block {block}"
                raw = shard.read_raw(block)
                payload = shard.codec.decompress(raw, where)
                examples = safepickle.loads(payload, trust=False, where=where)
                yield shard, block, raw, payload, [example_fields(e, max_suffix)[0] for e in examples]
    finally:
        dataset.close()  # a shard read again later reopens its data.bin


class _Reader(BlockReader):
    """A reader of one block through its own descriptor (closed by the test)."""

    def __init__(self, shard: Shard, block: int) -> None:
        self.fd = os.open(shard.data_path, os.O_RDONLY)
        start = int(shard.index[block])
        super().__init__(lambda offset, size: os.pread(self.fd, size, start + offset),
                         int(shard.index[block + 1]) - start)


def _reader(shard: Shard, block: int) -> _Reader:
    return _Reader(shard, block)


def _run_of(suffix: str, value: Any) -> bytes | None:
    """The bytes a span of this file would cover (its encoding, less a .npy header), or None
    if the file cannot have one."""
    ext = suffix.rsplit(".", 1)[-1].lower()
    if type(value) is bytes:
        return value
    if type(value) is str and ext in ("txt", "text", "transcript"):
        return encode_as(suffix, value)
    if type(value) is np.ndarray and ext == "npy":
        encoded = encode_as(suffix, value)
        return encoded[len(encoded) - value.nbytes:]
    return None


def _check_block(payload: bytes, fields: list[list[tuple[str, Any]]],
                 spans: list[list[Span | None]]) -> None:
    """Every span found covers exactly the file's encoding."""
    assert [len(f) for f in fields] == [len(s) for s in spans]
    for files, found in zip(fields, spans):
        for (suffix, value), span in zip(files, found):
            if span is not None:
                assert span.prefix + payload[span.offset:span.end] == encode_as(suffix, value), suffix
                assert span.check == run_check(span.prefix, payload[span.offset:span.end])
                assert span.size == len(encode_as(suffix, value))


# ---------------------------------------------------------------- the reference fixtures


@pytest.mark.parametrize("name", reference_names())
def test_reference_fixtures_spans_are_found_exact_and_read_back(name: str) -> None:
    for shard, block, raw, payload, fields in _blocks(REFERENCE / name / "dataset"):
        spans = find_spans(payload, fields)
        _check_block(payload, fields, spans)
        reader = _reader(shard, block)
        try:
            for files, found in zip(fields, spans):
                for (suffix, value), span in zip(files, found):
                    run = _run_of(suffix, value)
                    if span is None:
                        # Missed only where the run is not in the block at all (numpy turns
                        # big-endian pickled data native while unpickling, say).
                        assert run is None or (type(value) is np.ndarray and payload.find(run) < 0), suffix
                        continue
                    expected = encode_as(suffix, value)
                    where = f"{shard.data_path} block {block}"
                    assert read_span(raw, span, shard.codec, where) == expected
                    assert read_span(reader, span, shard.codec, where) == expected  # reader reused: rewinds
        finally:
            os.close(reader.fd)


def test_reference_fixtures_cover_bytes_text_and_arrays() -> None:
    """Across the fixtures, spans are found for every kind of run, under every strategy."""
    kinds: set[tuple[int, str]] = set()
    for name in reference_names():
        for shard, _, _, payload, fields in _blocks(REFERENCE / name / "dataset"):
            for files, found in zip(fields, find_spans(payload, fields)):
                for (_, value), span in zip(files, found):
                    if span is not None:
                        kinds.add((int(shard.codec.strategy), type(value).__name__))
    for strategy in range(4):
        for kind in ("bytes", "str", "ndarray"):
            assert (strategy, kind) in kinds, (strategy, kind)


# ---------------------------------------------------------------- any example, any protocol

FIELD_NAMES = ["jpg", "txt", "bin", "json", "npy", "cls", "pickle", "caption.txt", "TXT", "Text", "x.npy",
               "emb.NPY", "transcript", "blob", "meta.json", "pkl"]
DTYPES = ["u1", "<i4", ">i4", "<f8", "?", "<c16", ">u2", "S3", "<U2", "<M8[s]", [("a", "<i2"), ("b", "u1")]]


@st.composite
def arrays(draw: st.DrawFn) -> np.ndarray:
    dtype = np.dtype(draw(st.sampled_from(DTYPES)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    size = int(np.prod(shape)) * dtype.itemsize
    array = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=np.uint8).view(dtype).reshape(shape)
    if dtype.kind == "M":  # not every 64-bit pattern is a date numpy writes back the same way
        array = array.view("<i8").copy() % (1 << 40)
        array = array.view(dtype)
    layout = draw(st.sampled_from(["C", "F", "strided"]))
    if layout == "F":
        return np.asfortranarray(array)
    if layout == "strided" and array.ndim:
        return np.ascontiguousarray(np.repeat(array, 2, axis=0))[::2]  # a view with gaps
    return array.copy()


SHARED = [b"shared bytes " * 3, "shared text", b"", ""]
values = st.one_of(
    st.binary(max_size=600), st.text(max_size=300), st.sampled_from(["caf\xe9", "a\udc80b", "\u20ac" * 100]),
    st.integers(), st.floats(allow_nan=False), arrays(), st.sampled_from(SHARED),
    st.binary(min_size=250, max_size=260), st.text(min_size=250, max_size=260))


@st.composite
def examples(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 9)) == 0:  # a non-dict example is one file
        return draw(values)
    names = draw(st.lists(st.sampled_from(FIELD_NAMES), min_size=1, max_size=5, unique=True))
    example: dict[str, Any] = {name: draw(values) for name in names}
    if draw(st.booleans()):  # a value pickled first inside another field, then as its own file
        inner = draw(st.sampled_from(SHARED))
        example = {"meta": {"nested": inner}, **example, "again": inner}
    return example


def _fields(examples_: list[Any]) -> list[list[tuple[str, Any]]]:
    return [example_fields(e, 200)[0] for e in examples_]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(examples(), min_size=1, max_size=12), st.sampled_from([4, 5, 3, 2]))
def test_every_span_found_is_the_files_encoding(batch: list[Any], protocol: int) -> None:
    payload = pickle.dumps(batch, protocol=protocol)
    decoded = pickle.loads(payload)  # the spans' values must be the unpickled objects
    fields = _fields(decoded)
    spans = find_spans(payload, fields)
    _check_block(payload, fields, spans)
    event(f"protocol {protocol}: {'some' if any(s for found in spans for s in found) else 'no'} spans found")
    if protocol < 3:  # bytes go through _codecs.encode there: no run is trusted
        assert all(span is None for found in spans for span in found)


def test_plain_bytes_and_text_are_all_found() -> None:
    batch = [{"jpg": os.urandom(n), "txt": "word " * n, "cls": n, "npy": np.arange(n, dtype="<f4")}
             for n in (0, 1, 47, 48, 49, 255, 256, 70_000)]
    for protocol in (3, 4, 5):
        payload = pickle.dumps(batch, protocol=protocol)
        fields = _fields(pickle.loads(payload))
        spans = find_spans(payload, fields)
        _check_block(payload, fields, spans)
        for files, found in zip(fields, spans):
            for (suffix, _), span in zip(files, found):
                assert (span is None) == (suffix == "cls"), (protocol, suffix)


def test_shared_values_reuse_their_span() -> None:
    blob = os.urandom(3000)
    batch = [{"a.bin": blob, "b.bin": blob}, {"c.bin": blob}]
    payload = pickle.dumps(batch, protocol=4)
    assert payload.count(blob) == 1  # pickled once, referred to by the memo after
    fields = _fields(pickle.loads(payload))
    spans = find_spans(payload, fields)
    assert spans[0][0] == spans[0][1] == spans[1][0] is not None
    _check_block(payload, fields, spans)


def test_a_block_of_absent_runs_is_searched_a_bounded_number_of_times() -> None:
    """Values not in the pickle (a caller's mistake, or numpy's conversions) cost a bounded
    scan each block, not one scan per file: past the bound, files simply get no span."""
    payload = pickle.dumps([b"x" * (1 << 20)], protocol=4)
    absent = [[("bin", os.urandom(300))] for _ in range(20_000)]
    scanned = []
    original = bytes.find

    class Counting(bytes):
        def find(self, *args: Any) -> int:  # type: ignore[override]
            scanned.append(len(self) - (args[1] if len(args) > 1 else 0))
            return original(self, *args)

    assert all(span is None for found in find_spans(Counting(payload), absent) for span in found)
    assert sum(scanned) < 5 * len(payload)


# ---------------------------------------------------------------- written datasets, all strategies


def _write(root: Path, batch: list[Any], strategy: int, block_size: int, shard_size: int | None = None) -> Path:
    with AtlasWriter(root, shard_size=shard_size or max(len(batch) // 2, 1), block_size=block_size,
                     compression_strategy=strategy) as writer:
        writer.add_examples(batch)
    return root


def _with_fillers(batch: list[Any], block_size: int) -> list[Any]:
    """``batch`` and enough text-heavy examples after it that its shard has the 7 blocks and
    the samples zstd needs to train a dictionary: strategies 2 and 3 stay what they are."""
    return batch + [{"txt": f"filler example number {i} " * 40, "cls": i} for i in range(7 * block_size)]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(examples(), min_size=1, max_size=16), st.sampled_from([2, 3, 1, 0]), st.integers(1, 3))
def test_written_datasets_spans_read_back_in_every_strategy(batch: list[Any], strategy: int,
                                                           block_size: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="atlasfs-spans-"))
    try:
        batch = _with_fillers(batch, block_size)
        root = _write(work / "ds", batch, strategy, block_size, shard_size=len(batch))
        for shard, block, raw, payload, fields in _blocks(root):
            assert int(shard.codec.strategy) == strategy
            spans = find_spans(payload, fields)
            _check_block(payload, fields, spans)
            reader = _reader(shard, block)
            try:
                for files, found in zip(fields, spans):
                    for (suffix, value), span in zip(files, found):
                        if span is not None:
                            expected = encode_as(suffix, value)
                            assert read_span(raw, span, shard.codec, "ds") == expected
                            assert read_span(reader, span, shard.codec, "ds") == expected
            finally:
                os.close(reader.fd)
    finally:
        shutil.rmtree(work)


# ---------------------------------------------------------------- changed blocks


def _first_spans(root: Path) -> list[tuple[Shard, int, Span, bytes]]:
    """``(shard, block, span, file bytes)`` of every span of a dataset."""
    out = []
    for shard, block, _, payload, fields in _blocks(root):
        for files, found in zip(fields, find_spans(payload, fields)):
            for (suffix, value), span in zip(files, found):
                if span is not None and span.length:
                    out.append((shard, block, span, encode_as(suffix, value)))
    return out


def _same_layout(seed: int) -> list[dict[str, Any]]:
    """Examples whose pickles have one layout whatever the seed: only the run bytes differ."""
    rng = np.random.default_rng(seed)
    return [{"jpg": rng.bytes(2000 + 10 * i), "txt": "".join(rng.choice(list("abc"), 300 + i)),
             "npy": rng.random(50 + i), "cls": i} for i in range(12)]


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_a_block_rewritten_with_the_same_layout_is_detected(tmp_path: Path, strategy: int) -> None:
    old = _first_spans(_write(tmp_path / "old", _same_layout(1), strategy, 2))
    new_root = _write(tmp_path / "new", _same_layout(2), strategy, 2)
    new = {(s.name, b, span.offset, span.length) for s, b, span, _ in _first_spans(new_root)}
    assert new == {(s.name, b, span.offset, span.length) for s, b, span, _ in old}  # the very same places
    dataset = AtlasDataset(new_root, cache_bytes=0)
    shards = {shard.name: shard for shard in dataset.shards}
    for shard, block, span, _ in old:
        changed = shards[shard.name]
        with pytest.raises(SpanMismatch):
            read_span(changed.read_raw(block), span, changed.codec, "new")


def test_flipped_bits_in_an_uncompressed_run_are_detected(tmp_path: Path) -> None:
    root = _write(tmp_path / "ds", _same_layout(1), 0, 2)
    for shard, block, span, expected in _first_spans(root):
        raw = bytearray(shard.read_raw(block))
        assert read_span(bytes(raw), span, shard.codec, "ds") == expected
        raw[span.offset + span.length // 2] ^= 0x10
        with pytest.raises(SpanMismatch):
            read_span(bytes(raw), span, shard.codec, "ds")
        with pytest.raises(SpanMismatch):  # a block cut short before the run's end
            read_span(bytes(raw[:span.end - 1]), span, shard.codec, "ds")


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_mutated_frames_give_the_right_bytes_or_a_format_error(data: st.DataObject) -> None:
    strategy = data.draw(st.sampled_from([1, 2, 3]))
    shard, block, span, expected = data.draw(st.sampled_from(MUTATION_SPANS[strategy]))
    raw = bytearray(shard.read_raw(block))
    position = data.draw(st.integers(0, len(raw) - 1))
    raw[position] ^= 1 << data.draw(st.integers(0, 7))
    try:
        got = read_span(bytes(raw), span, shard.codec, "ds")
    except AtlasFormatError:
        return
    assert got == expected  # a flip after the run's end is never decompressed


def _mutation_spans() -> dict[int, list[tuple[Shard, int, Span, bytes]]]:
    root = Path(tempfile.mkdtemp(prefix="atlasfs-spans-mutate-"))
    batch = _same_layout(3) * 2  # one shard of 12 blocks: enough blocks to train a dictionary
    return {strategy: _first_spans(_write(root / str(strategy), batch, strategy, 2, len(batch)))
            for strategy in (1, 2, 3)}


MUTATION_SPANS = _mutation_spans()


def test_mutation_datasets_use_their_strategies() -> None:
    for strategy, spans in MUTATION_SPANS.items():
        assert spans and all(int(shard.codec.strategy) == strategy for shard, *_ in spans)


def test_spans_past_the_frame_or_the_block_bound_are_refused(tmp_path: Path) -> None:
    root = _write(tmp_path / "ds", _same_layout(1), 1, 2)
    shard, block, span, expected = _first_spans(root)[0]  # the block's first run: more follow it
    raw = shard.read_raw(block)
    content = len(shard.codec.decompress(raw, "ds"))
    assert span.end < content
    with pytest.raises(SpanMismatch):  # past the frame's content
        read_span(raw, span._replace(offset=content - span.length + 1), shard.codec, "ds")
    codec = shard.codec
    with pytest.raises(SpanMismatch):  # past the block bound: refused before decompressing anything
        read_span(raw, span, BlockCodec(codec.strategy, codec.dictionary, max_block_bytes=span.end - 1), "ds")
    with pytest.raises(AtlasFormatError) as refused:  # within it, but the frame claims more than the bound
        read_span(raw, span, BlockCodec(codec.strategy, codec.dictionary, max_block_bytes=span.end), "ds")
    assert not isinstance(refused.value, SpanMismatch)
    bounded = BlockCodec(codec.strategy, codec.dictionary, max_block_bytes=content)
    assert read_span(raw, span, bounded, "ds") == expected


def test_check_run_verifies_length_and_checksum() -> None:
    run = b"0123456789"
    span = Span(5, len(run), run_check(b"HDR", run), b"HDR")
    assert check_run(span, run, "x") == b"HDR" + run
    for bad in (run[:-1], run + b"!", b"0123456780"):
        with pytest.raises(SpanMismatch):
            check_run(span, bad, "x")
    with pytest.raises(SpanMismatch):  # the prefix is checked too: a stored table's is untrusted
        check_run(span._replace(prefix=b"HDX"), run, "x")


def test_empty_runs_need_no_block() -> None:
    codec = BlockCodec(CompressionStrategy.STANDARD_COMPRESSION, None)
    header = b"\x93NUMPYhdr"
    assert read_span(b"not even a frame", Span(0, 0, run_check(header, b""), header), codec, "x") == header
    with pytest.raises(SpanMismatch):
        read_span(b"not even a frame", Span(0, 0, 0, header), codec, "x")


# ---------------------------------------------------------------- small files, inline


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
def test_small_files_are_inline_and_tied_to_their_block(tmp_path: Path, strategy: int) -> None:
    root = _write(tmp_path / "old", _same_layout(1), strategy, 2)
    other = AtlasDataset(_write(tmp_path / "new", _same_layout(2), strategy, 2), cache_bytes=0)
    inline = 0
    for shard, block, raw, payload, fields in _blocks(root):
        fingerprint = block_fingerprint(raw, shard.codec.strategy)
        assert fingerprint is not None  # small blocks: every strategy has one
        for files, found in zip(fields, file_locators(payload, fields, fingerprint)):
            for (suffix, value), locator in zip(files, found):
                expected = encode_as(suffix, value)
                if len(expected) <= INLINE_MAX:
                    assert locator is not None and locator.inline, suffix
                if locator is None:
                    continue
                assert locator.size == len(expected)
                assert read_span(raw, locator, shard.codec, "ds") == expected
                if locator.inline:
                    inline += 1
                    changed = other.shards[0].read_raw(block)
                    with pytest.raises(SpanMismatch):  # the same place in a block that changed
                        read_span(changed, locator, shard.codec, "ds")
                    with pytest.raises(SpanMismatch):  # bytes that are not the recorded ones
                        read_span(raw, locator._replace(prefix=b"x" * locator.size), shard.codec, "ds")
    assert inline


def test_big_blocks_without_a_frame_checksum_get_inline_files_tied_by_their_stored_crc() -> None:
    payload = pickle.dumps([{"jpg": os.urandom(300 << 10), "cls": 3, "json": {"id": 3, "url": "http://x/3"}}],
                           protocol=4)
    fields = _fields(pickle.loads(payload))
    fingerprint = block_fingerprint(payload, CompressionStrategy.NO_COMPRESSION)
    assert fingerprint == zlib.crc32(payload)  # its stored bytes are its pickle: any size
    codec = BlockCodec(CompressionStrategy.NO_COMPRESSION, None)
    inline = [(suffix, locator) for files, found in zip(fields, file_locators(payload, fields, fingerprint))
              for (suffix, _), locator in zip(files, found) if locator is not None and locator.inline]
    assert [suffix for suffix, _ in inline] == ["cls", "json"]
    changed = bytearray(payload)
    changed[len(changed) // 2] ^= 1  # one bit of the JPEG's bytes, far from the small files
    for suffix, locator in inline:
        assert read_span(payload, locator, codec, "ds") == locator.prefix
        assert read_span(BlockReader(lambda offset, size: payload[offset:offset + size], len(payload)),
                         locator, codec, "ds") == locator.prefix
        with pytest.raises(SpanMismatch, match="ds: the block is not the one"):
            read_span(bytes(changed), locator, codec, "ds")
        with pytest.raises(SpanMismatch):  # past what a block may store: not read at all
            read_span(payload, locator, BlockCodec(codec.strategy, None, max_block_bytes=len(payload) - 1), "ds")
        # A fingerprint given by the caller (remembered) is the one compared.
        assert read_span(bytes(changed), locator, codec, "ds", fingerprint=lambda: fingerprint) == locator.prefix
        with pytest.raises(SpanMismatch):
            read_span(payload, locator, codec, "ds", fingerprint=lambda: None)
    spans_only = file_locators(payload, fields, None)[0]  # without a fingerprint: the JPEG's span alone
    assert [locator is not None and not locator.inline for locator in spans_only] == [False, True, False]


# ---------------------------------------------------------------- columns


def test_columns_round_trip_and_share_prefixes() -> None:
    batch = [{"npy": np.zeros(4, "<f4"), "txt": "t" * i, "x.npy": np.zeros((2, 2), "<i8")} for i in range(5)]
    payload = pickle.dumps(batch, protocol=4)
    fields = _fields(pickle.loads(payload))
    spans = [span for found in find_spans(payload, fields) for span in found]
    spans.append(Span(0, 0, 7, b"inline!", True))
    spans.append(None)
    columns = Locators.build(spans)
    assert columns is not None
    assert len(columns.prefixes) == 2  # one per array shape and dtype, however many files
    assert columns.offset.dtype == columns.check.dtype == np.uint32 and columns.prefix.dtype == np.uint16
    assert columns.offset[-1] == NO_LOCATOR
    assert columns.inline == b"inline!"


def test_columns_keep_prefixes_up_to_their_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("atlasfs.tree.table.filetable.MAX_PREFIXES", 2)
    spans = [Span(i, 1, 0, b"\x93NUMPY" + bytes([i])) for i in range(4)] + [Span(9, 1, 0, b"\x93NUMPY\x00")]
    columns = Locators.build(spans)
    assert columns is not None and list(columns.offset != NO_LOCATOR) == [True, True, False, False, True]
    monkeypatch.setattr("atlasfs.tree.table.filetable.MAX_PREFIXES", 100)
    monkeypatch.setattr("atlasfs.tree.table.filetable.MAX_PREFIX_BYTES", 15)  # room for two 7-byte prefixes
    columns = Locators.build(spans)
    assert columns is not None and list(columns.offset != NO_LOCATOR) == [True, True, False, False, True]
