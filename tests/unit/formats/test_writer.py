"""AtlasWriter: round trips, the reference's fall-backs and layout, atomicity."""

from __future__ import annotations

import json
import os
import pickle
import random
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.formats.atlas.writer import MIN_BLOCKS_FOR_DICTIONARY, index_dtype
from helpers import REFERENCE, deep_equal, expected_examples, reference_manifest

DICT = "zstd_dict.bin"


def make_example(i: int) -> Any:
    """Examples of mixed types, like real datasets (WebDataset-style dicts,
    bare arrays, plain values). The text repeats enough for zstd to train
    a dictionary on a handful of blocks."""
    rng = np.random.default_rng(i)
    kind = i % 5
    if kind == 0:
        return {"__key__": f"shard/sample{i:05d}", "txt": f"a photo of object number {i} " * 4,
                "cls": i, "jpg": bytes(rng.integers(0, 256, 40, dtype=np.uint8)),
                "json": {"tags": ["x", "y", i], "score": i / 7, "ok": i % 2 == 0, "none": None}}
    if kind == 1:
        return rng.standard_normal((3, i % 4 + 1)).astype(np.float32)
    if kind == 2:
        return {"__key__": f"shard/sample{i:05d}", "npy": np.full((2, 3), i, dtype=np.int16),
                "mask": np.arange(6, dtype=np.uint8).reshape(2, 3) > 2, "flags": (i, "t", b"b"),
                "big": 2**70 + i, "nan": float("nan")}
    if kind == 3:
        return f"plain string example {i} with unicode ü€ {'-' * (i % 9)}"
    return [i, -i, b"bytes" * (i % 3), {"nested": np.int64(i)}]


def make_examples(n: int) -> list[Any]:
    return [make_example(i) for i in range(n)]


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def write(path: Path, examples: list[Any], **kwargs: Any) -> Path:
    with AtlasWriter(path, **kwargs) as w:
        w.add_examples(examples)
    return path


def split_sizes(n: int, shard_size: int) -> list[int]:
    """Shard sizes the writer must produce: full shards, then the rest; one
    empty shard for an empty dataset (as the reference does)."""
    if n == 0:
        return [0]
    return [shard_size] * (n // shard_size) + ([n % shard_size] if n % shard_size else [])


def expected_strategies(strategy: int, sizes: list[int], block_size: int) -> tuple[int, list[int]]:
    """(root strategy, per-shard strategies) by the reference's fall-back rules."""
    blocks = [-(-s // block_size) for s in sizes]
    if strategy in (0, 1):
        return strategy, [strategy] * len(sizes)
    if strategy == 2:
        if blocks[0] >= MIN_BLOCKS_FOR_DICTIONARY:
            return 2, [2] * len(sizes)
        return 1, [1] * len(sizes)
    return 3, [3 if b >= MIN_BLOCKS_FOR_DICTIONARY else 1 for b in blocks]


def assert_reads_back(path: Path, examples: list[Any]) -> AtlasDataset:
    ds = AtlasDataset(path)
    assert len(ds) == len(examples)
    got = list(ds)
    assert len(got) == len(examples)
    for i, (g, w) in enumerate(zip(got, examples)):
        assert deep_equal(g, w), f"example {i}: got {g!r}, wrote {w!r}"
    order = list(range(len(examples)))
    random.Random(7).shuffle(order)
    for i in order:
        assert deep_equal(ds[i], examples[i]), f"ds[{i}]"
    return ds


# (case id, shard_size, block_size, number of examples)
CASES = [
    ("empty", 10, 4, 0),
    ("one_block", 10, 4, 3),
    ("one_full_block", 10, 4, 4),
    ("six_blocks", 100, 2, 12),
    ("seven_blocks", 100, 2, 14),
    ("shard_not_multiple_of_block", 7, 3, 20),
    ("exact_shards", 6, 3, 12),
    ("twelve_shards", 14, 2, 160),
]


@pytest.mark.parametrize("strategy", [0, 1, 2, 3])
@pytest.mark.parametrize("case,shard_size,block_size,n", CASES, ids=[c[0] for c in CASES])
def test_round_trip(tmp_path: Path, strategy: int, case: str, shard_size: int, block_size: int, n: int) -> None:
    examples = make_examples(n)
    path = write(tmp_path / "ds", examples, shard_size=shard_size, block_size=block_size,
                 compression_strategy=strategy)
    sizes = split_sizes(n, shard_size)
    width = len(str(len(sizes) - 1))
    names = [str(k).zfill(width) for k in range(len(sizes))]
    root_strategy, shard_strategies = expected_strategies(strategy, sizes, block_size)

    root_meta = read_json(path / "meta.json")
    assert root_meta == {"version": 1, "shard_sizes": sizes, "compression_strategy": root_strategy}
    assert sorted(p.name for p in path.iterdir() if p.is_dir()) == names
    assert (path / DICT).exists() == (root_strategy == 2)

    with assert_reads_back(path, examples) as ds:
        assert [s.name for s in ds.shards] == names
        assert [len(s) for s in ds.shards] == sizes
        assert [int(s.meta.compression_strategy) for s in ds.shards] == shard_strategies
        for shard, own in zip(ds.shards, shard_strategies):
            assert shard.meta.block_size == block_size
            assert shard.num_blocks == -(-len(shard) // block_size)
            assert (Path(shard.path) / DICT).exists() == (own == 3)
            assert (Path(shard.path) / "data.bin").exists() == (len(shard) > 0)
            assert shard.index.dtype == np.dtype(index_dtype(shard.data_size))


def test_plain_int_strategy_written_as_json_integer(tmp_path: Path) -> None:
    """A plain int strategy is accepted and the root meta holds a JSON integer."""
    examples = make_examples(9)
    path = write(tmp_path / "ds", examples, shard_size=4, block_size=2, compression_strategy=1)
    assert (path / "meta.json").read_text().endswith('"compression_strategy": 1\n}')
    assert_reads_back(path, examples).close()


@pytest.mark.parametrize("dict_size,text", [(0, "0"), (1, "1"), (0.5, "0.5"), (0.01, "0.01")])
def test_dict_size_recorded_as_given(tmp_path: Path, dict_size: float, text: str) -> None:
    """The reference writes compression_dict_size exactly as passed (json.dumps),
    so an int stays an int in the shard meta.json."""
    path = write(tmp_path / "ds", make_examples(5), shard_size=5, block_size=2, compression_strategy=1,
                 compression_level=5, compression_dict_size=dict_size)
    meta_text = (path / "0" / "meta.json").read_text()
    assert f'"compression_dict_size": {text}\n' in meta_text
    assert '"compression_level": 5,' in meta_text
    assert_reads_back(path, make_examples(5)).close()


# --- fall-backs --------------------------------------------------------------


def shard_metas(path: Path) -> dict[str, dict[str, Any]]:
    return {p.name: read_json(p / "meta.json") for p in sorted(path.iterdir()) if p.is_dir()}


def dict_files(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob(DICT))


def test_strategy2_first_shard_too_small_falls_back_everywhere(tmp_path: Path) -> None:
    """6 blocks in shard 0: no dictionary can be trained, so root and every
    shard say 1 -- even later shards that would have had 7 blocks."""
    examples = make_examples(12 + 20 + 5)
    path = write(tmp_path / "ds", examples, shard_size=12, block_size=2, compression_strategy=2)
    # Shard 0 has 6 blocks; the others too (same shard size), the last fewer.
    assert read_json(path / "meta.json")["compression_strategy"] == 1
    assert {m["compression_strategy"] for m in shard_metas(path).values()} == {1}
    assert dict_files(path) == []
    assert_reads_back(path, examples).close()


def test_strategy2_shared_dictionary(tmp_path: Path) -> None:
    """7+ blocks in shard 0: its dictionary moves to the root and every shard
    (even a last one with only 2 blocks) says 2 and has no dictionary of its own."""
    examples = make_examples(16 + 16 + 3)
    path = write(tmp_path / "ds", examples, shard_size=16, block_size=2, compression_strategy=2)
    assert read_json(path / "meta.json")["compression_strategy"] == 2
    metas = shard_metas(path)
    assert list(metas) == ["0", "1", "2"]
    assert {m["compression_strategy"] for m in metas.values()} == {2}
    assert dict_files(path) == [DICT]
    with assert_reads_back(path, examples) as ds:
        dict_id = int.from_bytes((path / DICT).read_bytes()[4:8], "little")
        for shard in ds.shards:
            assert shard.codec.dictionary is not None
            assert shard.codec.dictionary.get().dict_id() == dict_id


def test_strategy3_small_shard_falls_back_alone(tmp_path: Path) -> None:
    """Shards with 7 blocks get their own dictionary; the last (3 blocks) says 1;
    the root keeps 3 and there is no root dictionary."""
    examples = make_examples(14 + 14 + 5)
    path = write(tmp_path / "ds", examples, shard_size=14, block_size=2, compression_strategy=3)
    assert read_json(path / "meta.json")["compression_strategy"] == 3
    metas = shard_metas(path)
    assert [m["compression_strategy"] for m in metas.values()] == [3, 3, 1]
    assert dict_files(path) == [f"0/{DICT}", f"1/{DICT}"]
    assert (path / "0" / DICT).read_bytes() != (path / "1" / DICT).read_bytes()
    assert_reads_back(path, examples).close()


def test_strategy3_all_shards_small(tmp_path: Path) -> None:
    examples = make_examples(14)
    path = write(tmp_path / "ds", examples, shard_size=6, block_size=1, compression_strategy=3)
    assert read_json(path / "meta.json")["compression_strategy"] == 3
    assert {m["compression_strategy"] for m in shard_metas(path).values()} == {1}
    assert dict_files(path) == []
    assert_reads_back(path, examples).close()


# --- layout identical to the reference writer ------------------------------

MANIFEST = reference_manifest()


def relative_paths(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@pytest.mark.parametrize("name", list(MANIFEST))
def test_layout_matches_reference(tmp_path: Path, name: str) -> None:
    """Same examples + same kwargs as the reference run -> the same files, folder
    names, byte-identical meta.json files and the same index dtypes.
    (data.bin may differ: re-pickling expected.pkl need not give the same bytes.)"""
    ref = REFERENCE / name / "dataset"
    ours = write(tmp_path / "ds", expected_examples(name), **MANIFEST[name]["writer_kwargs"])

    assert relative_paths(ours) == relative_paths(ref)
    shard_dirs = sorted(p.name for p in ours.iterdir() if p.is_dir())
    assert shard_dirs == MANIFEST[name]["shard_dirs"]

    def meta_pairs(path: Path) -> list[tuple[str, Any]]:
        return list(json.loads(path.read_text()).items())  # key order matters

    assert meta_pairs(ours / "meta.json") == meta_pairs(ref / "meta.json")
    assert (ours / "meta.json").read_bytes() == (ref / "meta.json").read_bytes()
    for shard in shard_dirs:
        assert meta_pairs(ours / shard / "meta.json") == meta_pairs(ref / shard / "meta.json"), shard
        assert (ours / shard / "meta.json").read_bytes() == (ref / shard / "meta.json").read_bytes(), shard
        ours_index = np.load(ours / shard / "index.npy")
        ref_index = np.load(ref / shard / "index.npy")
        assert ours_index.dtype.str == ref_index.dtype.str, shard
        assert len(ours_index) == len(ref_index), shard


@pytest.mark.parametrize("shards,width", [(1, 1), (10, 1), (11, 2), (100, 2), (101, 3)])
def test_shard_folder_padding_width(tmp_path: Path, shards: int, width: int) -> None:
    """Folders are padded to the width of the last shard's number, as the reference does."""
    path = write(tmp_path / "ds", list(range(shards)), shard_size=1, block_size=1, compression_strategy=0)
    names = sorted(p.name for p in path.iterdir() if p.is_dir())
    assert names == [str(k).zfill(width) for k in range(shards)]
    with AtlasDataset(path) as ds:
        assert list(ds) == list(range(shards))


# --- index dtype -------------------------------------------------------------


@pytest.mark.parametrize("size,dtype", [
    (0, np.uint8), (255, np.uint8), (256, np.uint16), (65535, np.uint16), (65536, np.uint32),
    (2**32 - 1, np.uint32), (2**32, np.uint64), (2**64 - 1, np.uint64),
])
def test_index_dtype_edges(size: int, dtype: type) -> None:
    assert np.dtype(index_dtype(size)) == np.dtype(dtype)


def test_index_dtype_too_large() -> None:
    with pytest.raises(ValueError):
        index_dtype(2**64)


def test_written_index_dtype_at_byte_edges(tmp_path: Path) -> None:
    """Uncompressed shards whose data.bin is exactly 255 / 256 bytes get uint8 / uint16."""
    overhead = len(pickle.dumps([b""], protocol=4))
    for size, dtype in ((255, np.uint8), (256, np.uint16)):
        # One single-example block whose pickle is exactly `size` bytes.
        payload = b"x" * (size - overhead)
        assert len(pickle.dumps([payload], protocol=4)) == size
        path = write(tmp_path / f"ds{size}", [payload], shard_size=1, block_size=1, compression_strategy=0)
        assert (path / "0" / "data.bin").stat().st_size == size
        index = np.load(path / "0" / "index.npy")
        assert index.dtype == np.dtype(dtype)
        assert index.tolist() == [0, size]


# --- atomicity -------------------------------------------------------------


def test_exception_in_with_body_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "ds"
    with pytest.raises(RuntimeError, match="stop"):
        with AtlasWriter(target, shard_size=5, block_size=2, compression_strategy=3) as w:
            w.add_examples(make_examples(23))  # several finished shards on disk already
            raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []


def test_unpicklable_example_in_with_body_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "ds"
    with pytest.raises(Exception):
        with AtlasWriter(target, shard_size=5, block_size=1, compression_strategy=1) as w:
            w.add_examples(make_examples(7))
            w.add_example(lambda: None)  # block_size 1: pickled (and fails) right here
    assert list(tmp_path.iterdir()) == []


def test_failure_inside_close_leaves_nothing(tmp_path: Path) -> None:
    """The bad example sits in a partial block that is only pickled by close()."""
    target = tmp_path / "ds"
    w = AtlasWriter(target, shard_size=50, block_size=10, compression_strategy=0)
    w.add_examples(make_examples(3))
    w.add_example(lambda: None)
    with pytest.raises(Exception):
        w.close()
    assert list(tmp_path.iterdir()) == []


def test_target_appears_only_after_close(tmp_path: Path) -> None:
    target = tmp_path / "ds"
    examples = make_examples(30)
    w = AtlasWriter(target, shard_size=8, block_size=3, compression_strategy=2)
    w.add_examples(examples)
    assert not target.exists()
    pending = list(tmp_path.iterdir())
    assert len(pending) == 1 and pending[0].name.startswith("."), pending  # hidden temp folder
    w.close()
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]
    w.close()  # a second close is a no-op
    with pytest.raises(ValueError):
        w.add_example(1)
    assert_reads_back(target, examples).close()


def test_abort_leaves_nothing(tmp_path: Path) -> None:
    w = AtlasWriter(tmp_path / "ds", shard_size=8, block_size=3, compression_strategy=3)
    w.add_examples(make_examples(30))
    w.abort()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["empty_dir", "full_dir", "file", "dangling_symlink"])
def test_existing_target_raises_file_exists(tmp_path: Path, kind: str) -> None:
    target = tmp_path / "ds"
    if kind == "empty_dir":
        target.mkdir()
    elif kind == "full_dir":
        target.mkdir()
        (target / "keep").write_text("precious")
    elif kind == "file":
        target.write_text("precious")
    else:
        target.symlink_to(tmp_path / "nowhere")
    before = relative_paths(tmp_path)
    with pytest.raises(FileExistsError):
        AtlasWriter(target, shard_size=4, block_size=2)
    assert relative_paths(tmp_path) == before  # untouched, no temp folder left


def test_target_created_while_writing_is_not_replaced(tmp_path: Path) -> None:
    """rename(2) would silently replace an empty folder; close() must refuse."""
    target = tmp_path / "ds"
    w = AtlasWriter(target, shard_size=4, block_size=2, compression_strategy=0)
    w.add_examples(make_examples(5))
    target.mkdir()
    with pytest.raises(FileExistsError):
        w.close()
    assert [p.name for p in tmp_path.iterdir()] == ["ds"]
    assert list(target.iterdir()) == []


@pytest.mark.parametrize("kwargs", [
    {"shard_size": 0, "block_size": 1},
    {"shard_size": 1, "block_size": 0},
    {"shard_size": 1, "block_size": 1, "compression_dict_size": 1.5},
    {"shard_size": 1, "block_size": 1, "compression_dict_size": -0.1},
    {"shard_size": 1, "block_size": 1, "compression_strategy": 4},
])
def test_bad_arguments_rejected_before_anything_is_created(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        AtlasWriter(tmp_path / "ds", **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_the_dataset_folder_gets_the_umask_mode_as_mkdir_gives(tmp_path: Path) -> None:
    """mkdtemp made the written dataset 0700, and other users' readers failed on it."""
    for mask, mode in ((0o022, 0o755), (0o002, 0o775), (0o077, 0o700)):
        out = tmp_path / f"ds{mask:o}"
        old = os.umask(mask)
        try:
            with AtlasWriter(out, shard_size=2, block_size=1) as writer:
                writer.add_examples([{"__key__": "a", "txt": "x"}, {"__key__": "b", "txt": "y"}])
        finally:
            os.umask(old)
        assert stat.S_IMODE(out.stat().st_mode) == mode, (oct(mask), oct(out.stat().st_mode))
