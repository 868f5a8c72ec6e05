"""AtlasDataset against the reference fixtures: every example, every access path.

The fixtures were written by the reference implementation and ``expected.pkl``
holds exactly what its reader returns, so any difference here is a reader bug.
"""

from __future__ import annotations

import functools
import json
import os
import random
import shutil
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from atlasfs import AtlasDataset
from helpers import REFERENCE, deep_equal, expected_examples, reference_manifest, reference_names
from threadwait import wait_until_parked

NAMES = reference_names()
MANIFEST = reference_manifest()


@functools.lru_cache(maxsize=None)
def expected(name: str) -> tuple[Any, ...]:
    """expected.pkl, loaded once per fixture (read-only use in the tests)."""
    return tuple(expected_examples(name))


@functools.lru_cache(maxsize=None)
def expected_rows(name: str) -> tuple[dict[str, Any], ...]:
    with open(REFERENCE / name / "expected.jsonl", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def root(name: str) -> Path:
    return REFERENCE / name / "dataset"


def assert_same(got: Any, want: Any, what: str) -> None:
    assert deep_equal(got, want), f"{what}: got {got!r}, expected {want!r}"


@pytest.fixture(params=NAMES)
def name(request: pytest.FixtureRequest) -> str:
    return request.param


def test_manifest_is_not_empty() -> None:
    """Guard against the parametrised tests silently running over nothing."""
    assert len(NAMES) >= 12


def test_iteration_matches_expected(name: str) -> None:
    want = expected(name)
    with AtlasDataset(root(name)) as ds:
        assert len(ds) == len(want) == MANIFEST[name]["num_examples"]
        got = list(ds)
        assert len(got) == len(want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{name}[{i}] via iteration")
        # A second pass (now partly from the cache) is the same.
        assert all(deep_equal(g, w) for g, w in zip(ds, want))


def test_random_access_in_every_order(name: str) -> None:
    want = expected(name)
    n = len(want)
    shuffled = list(range(n))
    random.Random(42).shuffle(shuffled)
    for order_name, order in (("forwards", range(n)), ("backwards", range(n - 1, -1, -1)),
                              ("shuffled", shuffled)):
        # A fresh dataset per order, so each order starts from a cold cache.
        with AtlasDataset(root(name)) as ds:
            for i in order:
                assert_same(ds[i], want[i], f"{name}[{i}] {order_name}")


def test_negative_indices(name: str) -> None:
    want = expected(name)
    n = len(want)
    with AtlasDataset(root(name)) as ds:
        for k in range(1, n + 1):
            assert_same(ds[-k], want[-k], f"{name}[-{k}]")
        # numpy integers are indices too (e.g. from a sampler's arrays).
        if n:
            assert_same(ds[np.int64(n - 1)], want[-1], f"{name}[np.int64({n - 1})]")
            assert_same(ds[np.int32(-1)], want[-1], f"{name}[np.int32(-1)]")


def test_out_of_range_raises_index_error(name: str) -> None:
    n = len(expected(name))
    with AtlasDataset(root(name)) as ds:
        for bad in (n, n + 1, -n - 1, -n - 100, 10**30):
            with pytest.raises(IndexError):
                ds[bad]
            with pytest.raises(IndexError):
                ds.locate(bad)


@pytest.mark.parametrize("bad", ["0", 0.0, 1.5, None, slice(0, 1), (0,), [0], True])
def test_non_int_index_raises_type_error(bad: Any) -> None:
    # bool is refused on purpose: ds[True] silently meaning ds[1] hides bugs.
    with AtlasDataset(root("s2_shared_dict")) as ds:
        with pytest.raises(TypeError):
            ds[bad]


@pytest.mark.parametrize("bad", ["0", 0.0, 0.5, None, True])
def test_non_int_shard_index_raises_type_error(bad: Any) -> None:
    """Shards index like the dataset: shard[True] used to return shard[1] and
    shard[1.0] raised numpy's IndexError."""
    with AtlasDataset(root("s2_shared_dict")) as ds:
        shard = ds.shards[0]
        shard[0]  # block 0 cached: shard[0.5] must not find it under key 0.0
        with pytest.raises(TypeError):
            shard[bad]
        assert deep_equal(shard[np.int64(-1)], expected("s2_shared_dict")[len(shard) - 1])


def test_non_int_index_on_empty_dataset_is_type_error() -> None:
    """Type is checked before range: an empty dataset still says TypeError."""
    with AtlasDataset(root("empty_dataset")) as ds:
        with pytest.raises(TypeError):
            ds["x"]


def test_shards_match_manifest(name: str) -> None:
    entry = MANIFEST[name]
    with AtlasDataset(root(name)) as ds:
        assert [s.name for s in ds.shards] == entry["shard_dirs"]
        assert [int(s.meta.compression_strategy) for s in ds.shards] == entry["shard_strategies"]
        assert [str(s.index.dtype) for s in ds.shards] == entry["index_dtypes"]
        assert int(ds.meta.compression_strategy) == entry["root_compression_strategy"]
        assert ds.num_blocks == sum(s.num_blocks for s in ds.shards)


def test_per_shard_access(name: str) -> None:
    want = expected(name)
    with AtlasDataset(root(name)) as ds:
        start = 0
        for s, shard in enumerate(ds.shards):
            part = want[start:start + len(shard)]
            assert ds.shard_start(s) == start
            assert len(part) == len(shard)
            for j in range(len(shard)):
                assert_same(shard[j], part[j], f"{name} shard {shard.name}[{j}]")
            for j in range(1, len(shard) + 1):
                assert_same(shard[-j], part[-j], f"{name} shard {shard.name}[-{j}]")
            got = list(shard)
            assert len(got) == len(part)
            for j, (g, w) in enumerate(zip(got, part)):
                assert_same(g, w, f"{name} shard {shard.name} iteration [{j}]")
            for bad in (len(shard), -len(shard) - 1):
                with pytest.raises(IndexError):
                    shard[bad]
            start += len(shard)
        assert start == len(want)


def test_locate_agrees_with_expected_jsonl(name: str) -> None:
    rows = expected_rows(name)
    with AtlasDataset(root(name)) as ds:
        assert len(rows) == len(ds)
        for row in rows:
            i = row["index"]
            s, block, pos = ds.locate(i)
            assert (s, block, pos) == (row["shard"], row["block"], row["in_block"]), row
            assert ds.shards[s].name == row["shard_dir"]
            assert ds.locate(i - len(ds)) == (s, block, pos)


def test_mmap_index_off_gives_same_results(name: str) -> None:
    want = expected(name)
    with AtlasDataset(root(name), mmap_index=False) as ds, AtlasDataset(root(name)) as mapped:
        for a, b in zip(ds.shards, mapped.shards):
            assert not isinstance(a.index, np.memmap)
            assert isinstance(b.index, np.memmap)
            assert a.index.dtype == b.index.dtype
            assert np.array_equal(a.index, b.index)
        got = list(ds)
        assert len(got) == len(want)
        assert all(deep_equal(g, w) for g, w in zip(got, want))
        for i in range(len(want) - 1, -1, -1):
            assert_same(ds[i], want[i], f"{name}[{i}] mmap_index=False")


# --- thread safety ---------------------------------------------------------

N_THREADS = 16
ROUNDS = 3


def test_shared_dataset_many_threads_small_cache(name: str) -> None:
    """16 threads share one dataset whose 4 KiB cache evicts blocks constantly.

    Half the threads read every index in their own random order; the other
    half iterate the dataset and its shards. No read may be wrong or fail.
    """
    want = expected(name)
    n = len(want)
    errors: list[str] = []
    errors_lock = threading.Lock()

    def report(message: str) -> None:
        with errors_lock:
            errors.append(message)

    with AtlasDataset(root(name), cache_bytes=4096) as ds:
        barrier = threading.Barrier(N_THREADS)

        def worker(t: int) -> None:
            try:
                rng = random.Random(1000 + t)
                barrier.wait(timeout=30)
                for r in range(ROUNDS):
                    if t % 2 == 0:
                        order = list(range(n))
                        rng.shuffle(order)
                        for i in order:
                            if not deep_equal(ds[i], want[i]):
                                report(f"thread {t} round {r}: ds[{i}] wrong")
                    else:
                        got = list(ds) if r % 2 == 0 else [x for shard in ds.shards for x in shard]
                        if len(got) != n or not all(deep_equal(g, w) for g, w in zip(got, want)):
                            report(f"thread {t} round {r}: iteration wrong")
            except Exception as exc:  # noqa: BLE001 - any failure is a test failure
                report(f"thread {t}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(N_THREADS)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=60)
            assert not th.is_alive(), "reader thread hung"
        assert errors == []
        assert ds.cache.current_bytes <= 4096
        if ds.num_blocks > 1:
            # The cache really was too small: blocks were decoded more than once.
            assert ds.cache.misses > ds.num_blocks


def test_same_uncached_block_decoded_once() -> None:
    """Threads asking at once for examples of one uncached block share one decode.

    The decode is held until every other thread is blocked waiting for it, so
    a reader without single-flight loading would decode the block 16 times.
    """
    name = "s2_shared_dict"
    want = expected(name)
    with AtlasDataset(root(name)) as ds:
        s, block, _ = ds.locate(37)
        shard = ds.shards[s]
        first = ds.shard_start(s) + block * shard.meta.block_size
        indices = [first + k % shard.block_length(block) for k in range(N_THREADS)]
        assert {ds.locate(i)[:2] for i in indices} == {(s, block)}

        original = shard.decode_block
        calls: list[int] = []
        started = threading.Event()
        threads: list[threading.Thread] = []

        def counting_decode(b: int) -> tuple[list[Any], int]:
            calls.append(b)
            started.wait(10)
            wait_until_parked([t for t in threads if t is not threading.current_thread()])
            return original(b)

        shard.decode_block = counting_decode  # type: ignore[method-assign]
        results: list[Any] = [None] * N_THREADS

        def read(k: int) -> None:
            try:
                results[k] = ds[indices[k]]
            except Exception as exc:  # noqa: BLE001
                results[k] = exc

        threads.extend(threading.Thread(target=read, args=(k,), daemon=True) for k in range(N_THREADS))
        for th in threads:
            th.start()
        started.set()
        for th in threads:
            th.join(timeout=30)
            assert not th.is_alive(), "reader thread hung"

        assert calls == [block]
        assert ds.cache.misses == 1
        for k, i in enumerate(indices):
            assert_same(results[k], want[i], f"{name}[{i}] from thread {k}")
        # Same position in the block -> the very same decoded object.
        assert results[0] is results[shard.block_length(block)]


# --- shard folder naming ---------------------------------------------------


def test_shard_folders_ordered_by_number_not_name(tmp_path: Path) -> None:
    """Unpadded names 0..11 sort as strings to 0,1,10,11,2,...; the reader must
    order them by number and read the same examples as the padded original."""
    name = "s2_twelve_shards"
    copy = tmp_path / "ds"
    shutil.copytree(root(name), copy)
    padded = sorted(p.name for p in copy.iterdir() if p.is_dir())
    assert padded == [f"{k:02d}" for k in range(12)]
    for folder in padded:
        os.rename(copy / folder, copy / str(int(folder)))
    # A hidden folder (even one that looks like a shard) is not a shard.
    hidden = copy / ".cache"
    shutil.copytree(copy / "3", hidden)
    (hidden / "junk").write_bytes(b"\0" * 10)
    (copy / ".hidden_file").write_text("x")

    want = expected(name)
    with AtlasDataset(copy) as ds:
        assert [s.name for s in ds.shards] == [str(k) for k in range(12)]
        assert [s.number for s in ds.shards] == list(range(12))
        assert len(ds) == len(want)
        got = list(ds)
        assert all(deep_equal(g, w) for g, w in zip(got, want))
        for i in range(len(want) - 1, -1, -1):
            assert_same(ds[i], want[i], f"renamed {name}[{i}]")


def test_hidden_folder_ignored_in_padded_dataset(tmp_path: Path) -> None:
    name = "s1_dicts_without_key"
    copy = tmp_path / "ds"
    shutil.copytree(root(name), copy)
    (copy / ".cache").mkdir()
    (copy / ".cache" / "meta.json").write_text("not json")
    want = expected(name)
    with AtlasDataset(copy) as ds:
        assert [s.name for s in ds.shards] == MANIFEST[name]["shard_dirs"]
        assert all(deep_equal(g, w) for g, w in zip(list(ds), want))
        assert len(ds) == len(want)
