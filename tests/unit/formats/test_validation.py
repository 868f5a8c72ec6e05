"""Malformed datasets: every defect is one AtlasFormatError whose one-line message names the file.

Each test damages a dataset written by AtlasWriter (or writes a shard by hand)
and checks the exception type, that the message names the offending file or
folder by its full path, and what it says. Checks at open come first, then
checks when a block is decoded, then files changing after open.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np
import pytest
import zstandard

from atlasfs import AtlasDataset, AtlasFormatError, AtlasWriter

SHARD_SIZE = 21  # 7 blocks of 3: enough blocks for zstd to train a dictionary
BLOCK_SIZE = 3
EXAMPLES = 42  # two shards, "0" and "1"


def example(i: int) -> dict[str, Any]:
    return {"__key__": f"k{i:03d}", "txt": f"text {i} " * 8, "cls": i, "v": list(range(i % 7))}


def fails(culprit: Union[Path, str], action: Callable[[], Any], *fragments: str) -> str:
    """Run ``action``; it must raise AtlasFormatError naming ``culprit``, on one line,
    containing every fragment. Returns the message."""
    with pytest.raises(AtlasFormatError) as info:
        action()
    message = str(info.value)
    assert str(culprit) in message, message
    assert "\n" not in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ---------------------------------------------------------------- datasets to damage


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """One intact dataset per compression strategy, written once per module."""
    base = tmp_path_factory.mktemp("pristine")
    out = {}
    for strategy in range(4):
        path = base / f"s{strategy}"
        with AtlasWriter(path, shard_size=SHARD_SIZE, block_size=BLOCK_SIZE, compression_strategy=strategy) as w:
            w.add_examples(example(i) for i in range(EXAMPLES))
        ds = AtlasDataset(path)
        # the dictionary strategies must really have trained dictionaries
        assert [int(s.meta.compression_strategy) for s in ds.shards] == [strategy, strategy]
        out[strategy] = path
    return out


@pytest.fixture
def dataset(pristine: dict[int, Path], tmp_path: Path) -> Callable[[int], Path]:
    """A fresh copy of the pristine dataset with the given strategy."""
    def copy(strategy: int = 1) -> Path:
        target = tmp_path / f"ds{strategy}"
        shutil.copytree(pristine[strategy], target)
        return target
    return copy


def write_meta(path: Path, change: Union[bytes, Callable[[dict[str, Any]], None]]) -> None:
    """Replace a meta.json with raw bytes, or edit its object in place."""
    if isinstance(change, bytes):
        path.write_bytes(change)
        return
    data = json.loads(path.read_bytes())
    change(data)
    path.write_text(json.dumps(data))


def drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.pop(key)


def put(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda d: d.__setitem__(key, value)


def handmade(root: Path, blocks: list[bytes], *, strategy: int, stored: int,
             block_size: int = BLOCK_SIZE, dtype: Any = np.uint64) -> Path:
    """A one-shard dataset whose data.bin is exactly ``blocks``, with a correct
    index and metas; returns the path of data.bin."""
    root.mkdir()
    (root / "meta.json").write_text(json.dumps(
        {"version": 1, "shard_sizes": [stored], "compression_strategy": strategy}))
    shard = root / "0"
    shard.mkdir()
    (shard / "meta.json").write_text(json.dumps(
        {"version": 1, "block_size": block_size, "stored_examples": stored, "compression_strategy": strategy,
         "compression_level": 3, "compression_dict_size": 0.01}))
    np.save(shard / "index.npy", np.cumsum([0] + [len(b) for b in blocks]).astype(dtype))
    if blocks:
        (shard / "data.bin").write_bytes(b"".join(blocks))
    return shard / "data.bin"


def block_span(shard: Path, block: int) -> tuple[int, int]:
    index = np.load(shard / "index.npy")
    return int(index[block]), int(index[block + 1])


# ---------------------------------------------------------------- the dataset folder


def test_missing_root_folder(tmp_path: Path) -> None:
    fails(tmp_path / "nope", lambda: AtlasDataset(tmp_path / "nope"), "no such dataset folder")


def test_root_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    fails(tmp_path / "file", lambda: AtlasDataset(tmp_path / "file"))


# ---------------------------------------------------------------- root meta.json

ROOT_DAMAGE = [
    pytest.param(b"{", "not valid JSON", id="truncated-json"),
    pytest.param(b"", "not valid JSON", id="empty-file"),
    pytest.param(b"\xff\xfe\x00{", "not valid JSON", id="not-utf8"),
    pytest.param(b"{'version': 1}", "not valid JSON", id="python-syntax"),
    pytest.param(b"[1, [21, 21], 1]", "expected a JSON object", id="array"),
    pytest.param(b"null", "expected a JSON object", id="null"),
    pytest.param(b"1", "expected a JSON object", id="number"),
    pytest.param(b'"meta"', "expected a JSON object", id="string"),
    pytest.param(drop("version"), "missing key 'version'", id="missing-version"),
    pytest.param(drop("shard_sizes"), "missing key 'shard_sizes'", id="missing-shard_sizes"),
    pytest.param(drop("compression_strategy"), "missing key 'compression_strategy'", id="missing-strategy"),
    pytest.param(put("extra", 1), "unexpected key 'extra'", id="extra-key"),
    pytest.param(put("Version", 1), "unexpected key 'Version'", id="extra-key-case"),
    pytest.param(put("version", "1"), "'version' must be an integer", id="version-str"),
    pytest.param(put("version", True), "'version' must be an integer", id="version-bool"),
    pytest.param(put("version", 1.0), "'version' must be an integer", id="version-float"),
    pytest.param(put("version", None), "'version' must be an integer", id="version-null"),
    pytest.param(put("version", 2), "unsupported format version 2", id="version-2"),
    pytest.param(put("version", 0), "unsupported format version 0", id="version-0"),
    pytest.param(put("shard_sizes", "21"), "'shard_sizes'", id="sizes-str"),
    pytest.param(put("shard_sizes", [21, -1]), "'shard_sizes'", id="sizes-negative"),
    pytest.param(put("shard_sizes", [21, True]), "'shard_sizes'", id="sizes-bool"),
    pytest.param(put("shard_sizes", [21, 21.0]), "'shard_sizes'", id="sizes-float"),
    pytest.param(put("shard_sizes", {"0": 21}), "'shard_sizes'", id="sizes-object"),
    pytest.param(put("compression_strategy", 7), "unknown compression_strategy 7", id="strategy-7"),
    pytest.param(put("compression_strategy", -1), "unknown compression_strategy -1", id="strategy-negative"),
    pytest.param(put("compression_strategy", "1"), "'compression_strategy' must be an integer", id="strategy-str"),
    pytest.param(put("compression_strategy", 1.0), "'compression_strategy' must be an integer", id="strategy-float"),
    pytest.param(put("compression_strategy", False), "'compression_strategy' must be an integer", id="strategy-bool"),
]


@pytest.mark.parametrize(("change", "says"), ROOT_DAMAGE)
def test_bad_root_meta(dataset: Callable[[int], Path], change: Any, says: str) -> None:
    root = dataset(1)
    write_meta(root / "meta.json", change)
    message = fails(root / "meta.json", lambda: AtlasDataset(root), says)
    assert message.startswith(str(root / "meta.json"))


def test_missing_root_meta(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    (root / "meta.json").unlink()
    fails(root / "meta.json", lambda: AtlasDataset(root), "missing")


def test_root_meta_is_a_folder(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    (root / "meta.json").unlink()
    (root / "meta.json").mkdir()
    fails(root / "meta.json", lambda: AtlasDataset(root), "not a regular file (a folder)")


def test_huge_root_meta_is_not_read_whole(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    (root / "meta.json").write_bytes(b" " * (2 << 20) + b"{}")
    fails(root / "meta.json", lambda: AtlasDataset(root), "larger than")


# ---------------------------------------------------------------- shard meta.json

SHARD_DAMAGE = [
    pytest.param(b"{", "not valid JSON", id="truncated-json"),
    pytest.param(b"", "not valid JSON", id="empty-file"),
    pytest.param(b"[]", "expected a JSON object", id="array"),
    pytest.param(b"3", "expected a JSON object", id="number"),
    *[pytest.param(drop(key), f"missing key '{key}'", id=f"missing-{key}")
      for key in ("version", "block_size", "stored_examples", "compression_strategy",
                  "compression_level", "compression_dict_size")],
    pytest.param(put("extra", 0), "unexpected key 'extra'", id="extra-key"),
    pytest.param(put("version", "1"), "'version' must be an integer", id="version-str"),
    pytest.param(put("version", True), "'version' must be an integer", id="version-bool"),
    pytest.param(put("version", 1.0), "'version' must be an integer", id="version-float"),
    pytest.param(put("version", 2), "unsupported format version 2", id="version-2"),
    pytest.param(put("block_size", 0), "'block_size' must be >= 1", id="block_size-0"),
    pytest.param(put("block_size", -3), "'block_size' must be >= 1", id="block_size-negative"),
    pytest.param(put("block_size", 3.0), "'block_size' must be an integer", id="block_size-float"),
    pytest.param(put("block_size", "3"), "'block_size' must be an integer", id="block_size-str"),
    pytest.param(put("stored_examples", -1), "'stored_examples' must be >= 0", id="stored-negative"),
    pytest.param(put("stored_examples", True), "'stored_examples' must be an integer", id="stored-bool"),
    pytest.param(put("stored_examples", "21"), "'stored_examples' must be an integer", id="stored-str"),
    pytest.param(put("compression_strategy", 7), "unknown compression_strategy 7", id="strategy-7"),
    pytest.param(put("compression_strategy", "1"), "'compression_strategy' must be an integer", id="strategy-str"),
    pytest.param(put("compression_strategy", None), "'compression_strategy' must be an integer", id="strategy-null"),
    pytest.param(put("compression_level", 3.5), "'compression_level' must be an integer", id="level-float"),
    pytest.param(put("compression_level", "3"), "'compression_level' must be an integer", id="level-str"),
    pytest.param(put("compression_dict_size", "0.01"), "'compression_dict_size' must be a number", id="dict_size-str"),
    pytest.param(put("compression_dict_size", True), "'compression_dict_size' must be a number", id="dict_size-bool"),
    pytest.param(put("compression_dict_size", None), "'compression_dict_size' must be a number", id="dict_size-null"),
    pytest.param(put("compression_dict_size", [0.01]), "'compression_dict_size' must be a number", id="dict_size-list"),
]


@pytest.mark.parametrize(("change", "says"), SHARD_DAMAGE)
def test_bad_shard_meta(dataset: Callable[[int], Path], change: Any, says: str) -> None:
    root = dataset(1)
    write_meta(root / "1" / "meta.json", change)
    message = fails(root / "1" / "meta.json", lambda: AtlasDataset(root), says)
    assert message.startswith(str(root / "1" / "meta.json"))


def test_missing_shard_meta(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    (root / "0" / "meta.json").unlink()
    fails(root / "0" / "meta.json", lambda: AtlasDataset(root), "missing")


def test_empty_shard_folder(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    (root / "2").mkdir()
    fails(root / "2" / "meta.json", lambda: AtlasDataset(root), "missing")


@pytest.mark.parametrize("stored", [100, 0, 22])
def test_stored_examples_disagreeing_with_the_index(dataset: Callable[[int], Path], stored: int) -> None:
    root = dataset(1)
    write_meta(root / "0" / "meta.json", put("stored_examples", stored))
    # the index has 8 entries (7 blocks); the meta now implies another count
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "index has 8 entries", "stored_examples",
          str(root / "0" / "meta.json"))


def test_block_size_disagreeing_with_the_index(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    write_meta(root / "0" / "meta.json", put("block_size", 4))  # 6 blocks, the index has 7
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "expected 7")


def test_stored_examples_off_by_one_within_the_last_block(dataset: Callable[[int], Path]) -> None:
    # 20 examples still make 7 blocks, so only decoding the last block can tell
    root = dataset(1)
    write_meta(root / "0" / "meta.json", put("stored_examples", 20))
    ds = AtlasDataset(root)
    assert ds[17] == example(17)
    fails(root / "0" / "data.bin", lambda: ds[18], "block 6", "holds 3 examples, expected 2")


# ---------------------------------------------------------------- shard folders


@pytest.mark.parametrize("name", ["abc", "1a", "-1", "1.0", " 1", "0x1", "\uff11", "1_0"])
def test_shard_folder_not_named_by_a_number(dataset: Callable[[int], Path], name: str) -> None:
    root = dataset(1)
    shutil.copytree(root / "1", root / name)
    message = fails(root / name, lambda: AtlasDataset(root), "not a number")
    assert message.startswith(str(root / name))


@pytest.mark.parametrize(("existing", "twin"), [("1", "01"), ("0", "00"), ("1", "001")])
def test_two_folders_with_the_same_number(dataset: Callable[[int], Path], existing: str, twin: str) -> None:
    root = dataset(1)
    shutil.copytree(root / existing, root / twin)
    # whichever is listed second is reported, naming the first as well
    fails(root / twin, lambda: AtlasDataset(root), "same shard number", str(root / existing))
    fails(root / existing, lambda: AtlasDataset(root))


def test_hidden_folders_and_plain_files_are_not_shards(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    (root / ".cache").mkdir()
    (root / "notes.txt").write_text("not a shard")
    (root / "7").write_text("a file named by a number is not a shard folder")
    assert len(AtlasDataset(root)) == EXAMPLES


# ---------------------------------------------------------------- index.npy


def save_index(root: Path, values: Any, dtype: Any = None) -> None:
    np.save(root / "0" / "index.npy", np.asarray(values, dtype=dtype), allow_pickle=True)


def original_index(root: Path) -> np.ndarray:
    return np.load(root / "0" / "index.npy")


def test_missing_index(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    (root / "0" / "index.npy").unlink()
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "missing")


@pytest.mark.parametrize("content", [
    pytest.param(b"", id="empty"),
    pytest.param(b"not an npy file at all", id="text"),
    pytest.param(b"\x93NUMPY", id="magic-only"),
    pytest.param(b"\x93NUMPY\x03\x00" + b"\x00" * 64, id="npy-version-3"),
    pytest.param(b"\x93NUMPY\x01\x00\x10\x00{'descr': '<u8',}\n", id="header-missing-keys"),
    pytest.param(b"\x93NUMPY\x01\x00\xff\xff" + b"x" * 100, id="header-truncated"),
    pytest.param(pickle.dumps([0, 10, 20]), id="pickle"),
])
def test_index_not_a_npy_file(dataset: Callable[[int], Path], content: bytes) -> None:
    root = dataset(1)
    (root / "0" / "index.npy").write_bytes(content)
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "not a valid .npy file")


def test_index_is_an_npz_archive(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    index = original_index(root)
    with open(root / "0" / "index.npy", "wb") as f:
        np.savez(f, index=index)
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "not a valid .npy file")


@pytest.mark.parametrize("dtype", ["<f8", "<f4", "<i8", "<i2", "|i1", "|b1", "<c16", "<M8[s]"])
def test_index_dtype_not_unsigned(dataset: Callable[[int], Path], dtype: str) -> None:
    root = dataset(1)
    index = original_index(root)
    save_index(root, index.astype("i8").astype(dtype) if dtype != "<M8[s]" else index.astype("i8").view(dtype))
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "expected an unsigned integer type")


def test_index_of_objects_is_refused_without_unpickling(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    save_index(root, list(original_index(root)), dtype=object)
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "expected an unsigned integer type")


def test_structured_index(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    index = original_index(root)
    save_index(root, np.array([(int(v),) for v in index], dtype=[("offset", "<u8")]))
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "expected an unsigned integer type")


@pytest.mark.parametrize("shape", [(1, 8), (8, 1), (2, 4)])
def test_index_not_one_dimensional(dataset: Callable[[int], Path], shape: tuple[int, int]) -> None:
    root = dataset(1)
    save_index(root, original_index(root).reshape(shape))
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "1-D")


def test_index_zero_dimensional(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    save_index(root, np.uint64(0))
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "1-D")


@pytest.mark.parametrize("mmap_index", [True, False])
def test_index_not_starting_at_zero(dataset: Callable[[int], Path], mmap_index: bool) -> None:
    root = dataset(1)
    index = original_index(root)
    index[0] = 1
    save_index(root, index)
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root, mmap_index=mmap_index), "starts at 1")


@pytest.mark.parametrize("mmap_index", [True, False])
@pytest.mark.parametrize("how", ["repeated", "decreasing"])
def test_index_not_strictly_increasing(dataset: Callable[[int], Path], mmap_index: bool, how: str) -> None:
    root = dataset(1)
    index = original_index(root)
    index[3] = index[2] if how == "repeated" else index[2] - 1
    save_index(root, index)
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root, mmap_index=mmap_index), "not increasing", "entry 3")


@pytest.mark.parametrize("extra", [-8, -1, 1, 1 << 20])
def test_index_header_disagreeing_with_the_file_size(dataset: Callable[[int], Path], extra: int) -> None:
    # cut or pad the entries after the header: the header's shape is not believed
    root = dataset(1)
    path = root / "0" / "index.npy"
    raw = path.read_bytes()
    path.write_bytes(raw[:extra] if extra < 0 else raw + b"\x00" * extra)
    fails(path, lambda: AtlasDataset(root), "bytes of data for 8 entries")


def test_index_header_claiming_a_huge_shape(dataset: Callable[[int], Path]) -> None:
    # a forged header: 2**40 entries, matching a forged meta, over a few bytes of data
    root = dataset(1)
    write_meta(root / "0" / "meta.json", put("stored_examples", (1 << 40) * BLOCK_SIZE))
    header = "{'descr': '<u8', 'fortran_order': False, 'shape': (%d,), }" % ((1 << 40) + 1)
    header += " " * (118 - len(header)) + "\n"
    (root / "0" / "index.npy").write_bytes(b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode()
                                            + b"\x00" * 64)
    fails(root / "0" / "index.npy", lambda: AtlasDataset(root), "bytes of data for")


@pytest.mark.parametrize("dtype", [">u4", "<u8", ">u8", "<u2"])
def test_any_unsigned_index_dtype_reads(dataset: Callable[[int], Path], dtype: str) -> None:
    # not an error: big-endian and wider dtypes than the writer's are valid indexes
    root = dataset(1)
    save_index(root, original_index(root).astype(dtype))
    for mmap_index in (True, False):
        ds = AtlasDataset(root, mmap_index=mmap_index)
        assert [ds[i] for i in range(EXAMPLES)] == [example(i) for i in range(EXAMPLES)]


# ---------------------------------------------------------------- data.bin against the index


def test_truncated_data_bin(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    data = root / "0" / "data.bin"
    size = data.stat().st_size
    os.truncate(data, size - 1)
    fails(data, lambda: AtlasDataset(root), "truncated", f"{size - 1} bytes", str(root / "0" / "index.npy"))


def test_trailing_data_in_data_bin(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    data = root / "1" / "data.bin"
    with open(data, "ab") as f:
        f.write(b"\x00")
    fails(data, lambda: AtlasDataset(root), "trailing data")


def test_missing_data_bin(dataset: Callable[[int], Path]) -> None:
    root = dataset(0)
    (root / "0" / "data.bin").unlink()
    fails(root / "0" / "data.bin", lambda: AtlasDataset(root), "missing")


def test_empty_data_bin_with_a_non_empty_index(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    (root / "0" / "data.bin").write_bytes(b"")
    fails(root / "0" / "data.bin", lambda: AtlasDataset(root), "0 bytes", "truncated")


def test_empty_shard_without_data_bin_is_valid(tmp_path: Path) -> None:
    data = handmade(tmp_path / "ds", [], strategy=1, stored=0, dtype=np.uint8)
    assert not data.exists()
    assert len(AtlasDataset(tmp_path / "ds")) == 0


def test_empty_shard_with_bytes_in_data_bin(tmp_path: Path) -> None:
    data = handmade(tmp_path / "ds", [], strategy=1, stored=0, dtype=np.uint8)
    data.write_bytes(b"stray")
    fails(data, lambda: AtlasDataset(tmp_path / "ds"), "trailing data")


# ---------------------------------------------------------------- dictionaries at open


def test_missing_shared_dictionary(dataset: Callable[[int], Path]) -> None:
    root = dataset(2)
    (root / "zstd_dict.bin").unlink()
    fails(root / "zstd_dict.bin", lambda: AtlasDataset(root), "missing", "strategy 2")


def test_shared_dictionary_replaced_by_a_folder(dataset: Callable[[int], Path]) -> None:
    root = dataset(2)
    (root / "zstd_dict.bin").unlink()
    (root / "zstd_dict.bin").mkdir()  # a folder not named by a number: reported as such
    fails(root / "zstd_dict.bin", lambda: AtlasDataset(root))


def test_missing_shard_dictionary(dataset: Callable[[int], Path]) -> None:
    root = dataset(3)
    (root / "1" / "zstd_dict.bin").unlink()
    fails(root / "1" / "zstd_dict.bin", lambda: AtlasDataset(root), "missing", "strategy 3")


def test_shard_strategy_2_without_a_shared_dictionary(dataset: Callable[[int], Path]) -> None:
    # the root says 1, so there is no root dictionary, but a shard says 2
    root = dataset(1)
    write_meta(root / "0" / "meta.json", put("compression_strategy", 2))
    fails(root / "zstd_dict.bin", lambda: AtlasDataset(root), "missing", "shard 0")


# ---------------------------------------------------------------- decoding: zstd frames


def other_dictionary() -> bytes:
    """A dictionary trained on unrelated data: a different dictionary id."""
    samples = [pickle.dumps([{"other": f"sample {i} " * (i % 13 + 3), "n": i * 7}]) for i in range(200)]
    return zstandard.train_dictionary(1024, samples).as_bytes()


def flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("strategy", [1, 2, 3])
def test_corrupt_frame(dataset: Callable[[int], Path], strategy: int) -> None:
    root = dataset(strategy)
    start, end = block_span(root / "0", 2)
    flip(root / "0" / "data.bin", (start + end) // 2)
    ds = AtlasDataset(root)
    fails(root / "0" / "data.bin", lambda: ds[7], "block 2", "corrupt zstd frame")


def test_frame_magic_damaged(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    start, _ = block_span(root / "1", 4)
    flip(root / "1" / "data.bin", start)
    ds = AtlasDataset(root)
    fails(root / "1" / "data.bin", lambda: ds[SHARD_SIZE + 13], "block 4", "not a zstd frame")


def test_uncompressed_blocks_in_a_strategy_1_shard(dataset: Callable[[int], Path]) -> None:
    root = dataset(0)
    write_meta(root / "0" / "meta.json", put("compression_strategy", 1))
    ds = AtlasDataset(root)
    fails(root / "0" / "data.bin", lambda: ds[0], "block 0", "not a zstd frame")


def test_compressed_blocks_in_a_strategy_0_shard(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    write_meta(root / "0" / "meta.json", put("compression_strategy", 0))
    ds = AtlasDataset(root)
    fails(root / "0" / "data.bin", lambda: ds[0], "block 0", "not a valid pickle")


@pytest.mark.parametrize("where", ["root", "shard"])
def test_dictionary_that_does_not_match_the_frames(dataset: Callable[[int], Path], where: str) -> None:
    root = dataset(2 if where == "root" else 3)
    dict_path = root / "zstd_dict.bin" if where == "root" else root / "0" / "zstd_dict.bin"
    dict_path.write_bytes(other_dictionary())
    ds = AtlasDataset(root)
    message = fails(root / "0" / "data.bin", lambda: ds[0], "block 0", "dictionary", str(dict_path))
    assert "frame needs zstd dictionary" in message


def test_dictionary_replaced_by_raw_bytes(dataset: Callable[[int], Path]) -> None:
    root = dataset(3)
    dict_path = root / "1" / "zstd_dict.bin"
    dict_path.write_bytes(b"just some bytes, no dictionary header")
    ds = AtlasDataset(root)
    fails(root / "1" / "data.bin", lambda: ds[SHARD_SIZE], str(dict_path), "is dictionary 0")


def test_empty_dictionary(dataset: Callable[[int], Path]) -> None:
    root = dataset(2)
    (root / "zstd_dict.bin").write_bytes(b"")
    ds = AtlasDataset(root)
    fails(root / "zstd_dict.bin", lambda: ds[0], "dictionary is empty")


def test_dictionary_with_the_right_id_but_broken_tables(dataset: Callable[[int], Path]) -> None:
    root = dataset(3)
    dict_path = root / "0" / "zstd_dict.bin"
    good = dict_path.read_bytes()
    dict_path.write_bytes(good[:8] + b"\x00" * (len(good) - 8))  # magic and id kept
    ds = AtlasDataset(root)
    fails(dict_path, lambda: ds[0], "not a usable zstd dictionary")


def test_frames_needing_a_dictionary_in_a_strategy_1_shard(dataset: Callable[[int], Path]) -> None:
    root = dataset(3)
    write_meta(root / "0" / "meta.json", put("compression_strategy", 1))
    ds = AtlasDataset(root)
    fails(root / "0" / "data.bin", lambda: ds[0], "block 0", "needs zstd dictionary", "uses none")


def test_block_over_max_block_bytes(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    ds = AtlasDataset(root, max_block_bytes=100)  # every block decodes to more
    fails(root / "0" / "data.bin", lambda: ds[0], "block 0", "over the 100-byte block limit")
    assert AtlasDataset(root)[0] == example(0)  # the default limit reads it


def raw_frame_claiming(size: int, payload: bytes) -> bytes:
    """A hand-made zstd frame: single segment, 8-byte Frame_Content_Size = ``size``,
    no checksum, no dictionary, then one raw last block holding ``payload``."""
    descriptor = 0b11100000  # FCS flag 3 (8 bytes), single segment
    block_header = (len(payload) << 3) | (0 << 1) | 1  # raw block, last
    return (struct.pack("<IB", 0xFD2FB528, descriptor) + struct.pack("<Q", size)
            + struct.pack("<I", block_header)[:3] + payload)


def test_handmade_frame_is_well_formed() -> None:
    # the frame builder is right: honest sizes decompress
    payload = pickle.dumps([1, 2, 3])
    assert zstandard.ZstdDecompressor().decompress(raw_frame_claiming(len(payload), payload)) == payload


@pytest.mark.parametrize("claimed", [1 << 40, (1 << 30) + 1, (1 << 64) - 2])
def test_frame_claiming_a_huge_content_size(tmp_path: Path, claimed: int) -> None:
    data = handmade(tmp_path / "ds", [raw_frame_claiming(claimed, pickle.dumps([0, 1, 2]))], strategy=1, stored=3)
    ds = AtlasDataset(tmp_path / "ds")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fails(data, lambda: ds[0], "block 0", f"claims {claimed} bytes", "block limit")
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 64 << 10  # nothing near the claimed size was allocated


def unknown_size_frame(payload: bytes) -> bytes:
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(payload)
    assert zstandard.get_frame_parameters(frame).content_size == zstandard.CONTENTSIZE_UNKNOWN
    return frame


def test_unknown_size_frame_expanding_past_the_limit(tmp_path: Path) -> None:
    block = pickle.dumps([b"\x00" * 50_000, 1, 2])
    data = handmade(tmp_path / "ds", [unknown_size_frame(block)], strategy=1, stored=3)
    ds = AtlasDataset(tmp_path / "ds", max_block_bytes=10_000)
    fails(data, lambda: ds[0], "block 0", "expands past the 10000-byte block limit")
    assert AtlasDataset(tmp_path / "ds")[1] == 1  # within the default limit it reads


def test_bytes_after_the_frame(tmp_path: Path) -> None:
    frame = zstandard.ZstdCompressor().compress(pickle.dumps([0, 1, 2]))
    data = handmade(tmp_path / "ds", [frame + b"trailing"], strategy=1, stored=3)
    fails(data, lambda: AtlasDataset(tmp_path / "ds")[0], "block 0", "corrupt zstd frame")


def test_two_frames_in_one_block(tmp_path: Path) -> None:
    frame = zstandard.ZstdCompressor().compress(pickle.dumps([0, 1, 2]))
    data = handmade(tmp_path / "ds", [frame + frame], strategy=1, stored=3)
    fails(data, lambda: AtlasDataset(tmp_path / "ds")[0], "block 0")


def test_skippable_frame_as_a_block(tmp_path: Path) -> None:
    data = handmade(tmp_path / "ds", [struct.pack("<II", 0x184D2A50, 4) + b"abcd"], strategy=1, stored=3)
    fails(data, lambda: AtlasDataset(tmp_path / "ds")[0], "block 0")


def test_truncated_frame(tmp_path: Path) -> None:
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(pickle.dumps(list(range(3))))
    data = handmade(tmp_path / "ds", [frame[:-5]], strategy=1, stored=3)
    fails(data, lambda: AtlasDataset(tmp_path / "ds")[0], "block 0", "corrupt zstd frame")


# ---------------------------------------------------------------- decoding: the block's pickle

NOT_A_LIST = [
    pytest.param({"0": 0, "1": 1, "2": 2}, "block is a dict", id="dict"),
    pytest.param((0, 1, 2), "block is a tuple", id="tuple"),
    pytest.param(None, "block is a NoneType", id="none"),
    pytest.param(b"012", "block is a bytes", id="bytes"),
    pytest.param(np.arange(3), "block is a ndarray", id="ndarray"),
]


@pytest.mark.parametrize("strategy", [0, 1])
@pytest.mark.parametrize(("value", "says"), NOT_A_LIST)
def test_block_not_a_list(tmp_path: Path, strategy: int, value: Any, says: str) -> None:
    pickled = pickle.dumps(value, protocol=4)
    block = pickled if strategy == 0 else zstandard.ZstdCompressor().compress(pickled)
    data = handmade(tmp_path / "ds", [block], strategy=strategy, stored=3)
    fails(data, lambda: AtlasDataset(tmp_path / "ds")[0], "block 0", says, "not a list of examples")


@pytest.mark.parametrize("strategy", [0, 1])
@pytest.mark.parametrize("length", [0, 2, 4])
def test_block_list_of_the_wrong_length(tmp_path: Path, strategy: int, length: int) -> None:
    good = pickle.dumps(["a", "b", "c"])
    bad = pickle.dumps(list(range(length)))
    blocks = [good, bad] if strategy == 0 else [zstandard.ZstdCompressor().compress(b) for b in (good, bad)]
    data = handmade(tmp_path / "ds", blocks, strategy=strategy, stored=6)
    ds = AtlasDataset(tmp_path / "ds")
    assert ds[2] == "c"
    fails(data, lambda: ds[3], "block 1", f"holds {length} examples, expected 3")


def test_short_last_block(tmp_path: Path) -> None:
    # the last block holds stored_examples % block_size examples, not block_size
    blocks = [pickle.dumps([0, 1, 2]), pickle.dumps([3, 4, 5])]
    data = handmade(tmp_path / "ds", blocks, strategy=0, stored=5)
    fails(data, lambda: AtlasDataset(tmp_path / "ds")[4], "block 1", "holds 3 examples, expected 2")


@pytest.mark.parametrize("payload", [
    pytest.param(b"garbage bytes, not a pickle", id="text"),
    pytest.param(b"\x80\x04\x95", id="truncated-frame"),
    pytest.param(pickle.dumps([0, 1, 2])[:-1], id="no-stop"),
    pytest.param(b"\x80\x05" + b"(" * 1000 + b".", id="marks"),
    pytest.param(bytes(range(256)), id="all-bytes"),
])
def test_block_not_a_pickle(tmp_path: Path, payload: bytes) -> None:
    data = handmade(tmp_path / "ds", [payload], strategy=0, stored=3)
    fails(data, lambda: AtlasDataset(tmp_path / "ds")[0], "block 0", "not a valid pickle")


def test_errors_are_per_block_and_not_remembered(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    start, end = block_span(root / "0", 3)
    flip(root / "0" / "data.bin", (start + end) // 2)
    ds = AtlasDataset(root)
    for _ in range(2):  # a failed block is not cached, and does not poison the shard's zstd context
        fails(root / "0" / "data.bin", lambda: ds[9], "block 3")
    assert [ds[i] for i in (8, 12, 0, 20)] == [example(i) for i in (8, 12, 0, 20)]
    with pytest.raises(AtlasFormatError):
        list(ds)


# ---------------------------------------------------------------- files changing after open


def test_data_bin_grown_after_open(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    ds = AtlasDataset(root)
    with open(root / "0" / "data.bin", "ab") as f:
        f.write(b"\x00")
    fails(root / "0" / "data.bin", lambda: ds[0], "changed since the dataset was opened")
    assert ds[SHARD_SIZE] == example(SHARD_SIZE)  # the other shard is untouched


def test_data_bin_touched_after_open(dataset: Callable[[int], Path]) -> None:
    root = dataset(0)
    ds = AtlasDataset(root)
    data = root / "1" / "data.bin"
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    fails(data, lambda: ds[SHARD_SIZE + 4], "changed since the dataset was opened")
    with pytest.raises(AtlasFormatError):
        list(ds.shards[1])


def test_data_bin_rewritten_with_other_bytes_after_open(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    ds = AtlasDataset(root)
    data = root / "0" / "data.bin"
    st = data.stat()
    data.write_bytes(b"\x00" * st.st_size)  # same size, new mtime
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    fails(data, lambda: ds[5], "changed since")


def test_index_touched_after_open(dataset: Callable[[int], Path]) -> None:
    root = dataset(1)
    ds = AtlasDataset(root)
    index = root / "0" / "index.npy"
    st = index.stat()
    os.utime(index, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    fails(index, lambda: ds[3], "changed since the dataset was opened")


_TRUNCATE_MAPPED_INDEX = """
import sys
from atlasfs import AtlasDataset, AtlasFormatError
ds = AtlasDataset(sys.argv[1], mmap_index=True)
open(sys.argv[1] + "/0/index.npy", "wb").close()  # truncated in place under the mapping
try:
    print(ACCESS)
except AtlasFormatError as exc:
    print(exc)
"""


@pytest.mark.parametrize("access", ["ds[4]", "ds.shards[0].data_size"])
def test_mapped_index_truncated_after_open_is_an_error_not_sigbus(dataset: Callable[[int], Path],
                                                                   access: str) -> None:
    root = dataset(1)
    result = subprocess.run([sys.executable, "-c", _TRUNCATE_MAPPED_INDEX.replace("ACCESS", access), str(root)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, (result.returncode, result.stderr)
    assert str(root / "0" / "index.npy") in result.stdout and "changed since" in result.stdout, result.stdout
