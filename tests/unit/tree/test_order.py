"""Example order everywhere: listings, `atlasfs export`, and `tar` over the mount keep the
order the dataset yields its examples in (datasets are often shuffled when written)."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from atlasfs import AtlasDataset
from atlasfs.tree.blocktree import BlockTree
from fusemount import atlasfs
from helpers import REFERENCE, contract_files, expected_examples, reference_names, shard_sizes
from orderdata import KEYS, shuffled_dataset


def _sample_keys(names: list[str]) -> list[str]:
    """The sample keys of member names in order of first appearance (WebDataset's grouping:
    a file's key is its path up to the first dot of its last component)."""
    keys: list[str] = []
    for name in names:
        folder, _, base = name.rpartition("/")
        key = f"{folder}/{base.split('.')[0]}" if folder else base.split(".")[0]
        if not keys or keys[-1] != key:
            keys.append(key)
    return keys


def test_listings_follow_example_order(tmp_path: Path) -> None:
    tree = BlockTree(AtlasDataset(shuffled_dataset(tmp_path / "ds")))
    # samples in example order, each sample's files adjacent; a folder where its first example is
    assert [name for name, _, _ in tree.names("/0")] == [
        "zeta.cls", "zeta.txt", "alpha.cls", "alpha.txt", "mid.cls", "mid.txt", "beta.cls", "beta.txt", "d",
        "omega.cls", "omega.txt", "e", "gamma.cls", "gamma.txt", "a0.cls", "a0.txt"]
    assert [name for name, _ in tree.listdir("/0/d")] == ["9.cls", "9.txt", "1.cls", "1.txt", "5.cls", "5.txt"]
    assert [name for name, _, _ in tree.names("/0/e")] == ["f", "0.cls", "0.txt"]
    assert _sample_keys([name for name, _ in tree.members("/0")]) == KEYS


def test_export_writes_samples_in_example_order_with_full_key_paths(tmp_path: Path) -> None:
    dataset = shuffled_dataset(tmp_path / "ds")
    result = atlasfs("export", str(dataset), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    with tarfile.open(tmp_path / "out" / "0.tar") as archive:
        names = archive.getnames()
    assert _sample_keys(names) == KEYS
    assert not any(name.startswith("./") for name in names)
    samples = list(wds.WebDataset(str(tmp_path / "out" / "0.tar"), shardshuffle=False).decode())
    assert [s["__key__"] for s in samples] == KEYS
    assert [s["cls"] for s in samples] == list(range(len(KEYS)))


@pytest.mark.parametrize("name", reference_names())
def test_export_of_every_reference_fixture_is_in_example_order(tmp_path: Path, name: str) -> None:
    result = atlasfs("export", str(REFERENCE / name / "dataset"), str(tmp_path / "out"))
    assert result.returncode == 0, result.stderr
    expected = contract_files(expected_examples(name), shard_sizes(name))
    dataset = AtlasDataset(REFERENCE / name / "dataset")
    for shard, files in zip(dataset.shards, expected):
        with tarfile.open(tmp_path / "out" / f"{shard.name}.tar") as archive:
            names = archive.getnames()
        assert _sample_keys(names) == _sample_keys(list(files)), shard.name
        assert sorted(names) == sorted(files)
