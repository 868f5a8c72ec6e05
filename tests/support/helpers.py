"""Shared test helpers: where the reference fixtures are, and deep equality."""

from __future__ import annotations

import atexit
import json
import pickle
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

REPO = Path(__file__).resolve().parents[2]
#: The reference fixtures as the repository keeps them (tests/fixtures/reference/README.md).
VENDORED = REPO / "tests" / "fixtures" / "reference"


def _session_copy() -> Path:
    """A copy of the reference fixtures in a temporary folder, made once per test process:
    tests read, mount, index and export it, so nothing they run can write into the repository."""
    folder = Path(tempfile.mkdtemp(prefix="atlasfs-test-fixtures-"))
    atexit.register(shutil.rmtree, folder, True)
    return Path(shutil.copytree(VENDORED, folder / "reference"))


REFERENCE = _session_copy()
#: The reference dataset whose shards share a zstd dictionary: the usual good dataset.
SHARED_DICT = REFERENCE / "s2_shared_dict" / "dataset"


def reference_names() -> list[str]:
    """Names of the reference fixtures, from their manifest."""
    with open(REFERENCE / "manifest.json") as f:
        return [entry["name"] for entry in json.load(f)]


def reference_manifest() -> dict[str, dict[str, Any]]:
    with open(REFERENCE / "manifest.json") as f:
        return {entry["name"]: entry for entry in json.load(f)}


def expected_examples(name: str) -> list[Any]:
    """The examples a reference fixture must yield (a trusted pickle)."""
    with open(REFERENCE / name / "expected.pkl", "rb") as f:
        return pickle.load(f)


def deep_equal(a: Any, b: Any) -> bool:
    """Equality with exact types; arrays by dtype, shape and values (NaN == NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        if a.dtype.kind == "O":
            return all(deep_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))
        if a.dtype.kind in "fc":
            return bool(np.array_equal(a, b, equal_nan=True))
        if a.dtype.kind == "M" or a.dtype.kind == "m":
            return bool(np.array_equal(a.view("i8"), b.view("i8")))
        return bool(np.array_equal(a, b))
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and deep_equal(a.tobytes(), b.tobytes())
    if isinstance(a, dict):
        return list(a) == list(b) and all(deep_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(deep_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, float):
        return (a != a and b != b) or (a == b and np.copysign(1, a) == np.copysign(1, b))
    if isinstance(a, complex):
        return deep_equal(a.real, b.real) and deep_equal(a.imag, b.imag)
    return bool(a == b)


# ---------------------------------------------------------------- the layout contract, as an oracle

#: Extensions webdataset's default decoder decodes; bytes under them do not come back as bytes.
WDS_DECODED_EXTS = frozenset(
    "txt text transcript cls cls2 index inx id json jsn pkl pickle pyd pth ten tb mp msg npy npz cbor".split())
#: Marks a file whose decoded value is not promised (only its bytes are).
BYTES_ONLY = object()


def contract_files(examples: list[Any], shard_sizes: list[int]) -> list[dict[str, tuple[bytes, Any]]]:
    """Per shard: relative path -> (bytes, value webdataset's .decode() must return or BYTES_ONLY).

    Built from the naming layer's primitives applied to the expected examples,
    independently of the dataset reader and the tree.
    """
    from atlasfs.formats.naming import (
        MAX_NAME_BYTES,
        KeyAssigner,
        declared_key,
        encode_field,
        example_files,
        index_key_width,
        is_metadata,
    )
    width = index_key_width(len(examples))
    shards = []
    start = 0
    for size in shard_sizes:
        assigner = KeyAssigner(width)
        files: dict[str, tuple[bytes, Any]] = {}
        for index in range(start, start + size):
            example = examples[index]
            encoded, note = example_files(example, MAX_NAME_BYTES - 1 - width)
            longest = max(len(s.encode()) for s, _ in encoded)
            key, _ = assigner.assign(declared_key(example), index, longest)
            if isinstance(example, dict) and note is None:
                pairs = [(encode_field(k, v), v) for k, v in example.items() if not is_metadata(k)]
            else:  # one file holding the whole example
                pairs = [(encoded[0], example)]
            for (suffix, data), value in pairs:
                ext = suffix.rsplit(".", 1)[-1].lower()
                promised: Any = value
                if value is None or (type(value) is bytes and ext in WDS_DECODED_EXTS):
                    promised = BYTES_ONLY
                files[f"{key}.{suffix}"] = (data, promised)
        shards.append(files)
        start += size
    return shards


def shard_sizes(name: str) -> list[int]:
    """stored_examples of each shard of a reference fixture, in order."""
    with open(REFERENCE / name / "info.json") as f:
        return [s["meta"]["stored_examples"] for s in json.load(f)["shards"]]


def in_threads(work: Callable[[int], object], count: int) -> None:
    """Run ``work(0)`` ... ``work(count - 1)`` on ``count`` threads at once and wait for all
    (the readers of the concurrency tests; each records its own failures)."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


#: wids imports torch at import time; these tests give it a minimal stand-in for the two
#: modules it imports (torch.distributed, torch.utils.data) rather than install torch.
TORCH_STANDIN = '''
import sys, types
torch = types.ModuleType("torch")
distributed = types.ModuleType("torch.distributed")
distributed.is_initialized = lambda: False
utils = types.ModuleType("torch.utils")
data = types.ModuleType("torch.utils.data")
from typing import Generic, TypeVar
T = TypeVar("T")
class Dataset(Generic[T]): pass
class Sampler(Generic[T]):
    def __init__(self, *args, **kwargs): pass
data.Dataset, data.Sampler = Dataset, Sampler
torch.distributed, torch.utils, utils.data = distributed, utils, data
sys.modules.update({"torch": torch, "torch.distributed": distributed, "torch.utils": utils, "torch.utils.data": data})
'''
