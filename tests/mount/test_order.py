"""Example order everywhere: listings, `atlasfs export`, and `tar` over the mount keep the
order the dataset yields its examples in (datasets are often shuffled when written)."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

import pytest
import webdataset as wds

from atlasfs import AtlasDataset, AtlasWriter
from atlasfs.tree.blocktree import BlockTree
from fusemount import atlasfs, mounted
from helpers import REFERENCE, contract_files, expected_examples, reference_names, shard_sizes

#: Unsorted keys, and keys in folders that come back after other samples.
KEYS = ["zeta", "alpha", "mid", "beta", "d/9", "omega", "d/1", "e/f/2", "gamma", "d/5", "e/0", "a0"]


def _shuffled(path: Path) -> Path:
    with AtlasWriter(path, shard_size=len(KEYS), block_size=5, compression_strategy=1) as writer:
        writer.add_examples({"__key__": key, "txt": f"text of {key}", "cls": i} for i, key in enumerate(KEYS))
    return path


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
    tree = BlockTree(AtlasDataset(_shuffled(tmp_path / "ds")))
    # samples in example order, each sample's files adjacent; a folder where its first example is
    assert [name for name, _, _ in tree.names("/0")] == [
        "zeta.cls", "zeta.txt", "alpha.cls", "alpha.txt", "mid.cls", "mid.txt", "beta.cls", "beta.txt", "d",
        "omega.cls", "omega.txt", "e", "gamma.cls", "gamma.txt", "a0.cls", "a0.txt"]
    assert [name for name, _ in tree.listdir("/0/d")] == ["9.cls", "9.txt", "1.cls", "1.txt", "5.cls", "5.txt"]
    assert [name for name, _, _ in tree.names("/0/e")] == ["f", "0.cls", "0.txt"]
    assert _sample_keys([name for name, _ in tree.members("/0")]) == KEYS


def test_export_writes_samples_in_example_order_with_full_key_paths(tmp_path: Path) -> None:
    dataset = _shuffled(tmp_path / "ds")
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


def test_readdir_and_the_readme_tar_recipe_keep_example_order(tmp_path: Path) -> None:
    dataset = _shuffled(tmp_path / "ds")
    with mounted(dataset) as mnt:
        # os.listdir returns entries in readdir order
        assert os.listdir(mnt / "0")[:4] == ["zeta.cls", "zeta.txt", "alpha.cls", "alpha.txt"]
        assert os.listdir(mnt / "0" / "d") == ["9.cls", "9.txt", "1.cls", "1.txt", "5.cls", "5.txt"]
        tar = tmp_path / "0.tar"
        # the README's recipe, verbatim but for the paths
        subprocess.run(f"find {mnt}/0 -type f -printf '%P\\n' | tar cf {tar} -C {mnt}/0 --no-recursion -T -",
                       shell=True, check=True)
    samples = list(wds.WebDataset(str(tar), shardshuffle=False).decode())
    keys = [s["__key__"] for s in samples]
    assert not any(key.startswith("./") for key in keys)
    # find walks folders depth first: a folder's samples come together, at its first example
    assert keys == ["zeta", "alpha", "mid", "beta", "d/9", "d/1", "d/5", "omega", "e/f/2", "e/0", "gamma", "a0"]
    assert all(s["txt"] == f"text of {s['__key__']}" for s in samples)
