"""Example order through a real mount: readdir and the README's tar recipe keep the order the
dataset yields its examples in (listings and export: tests/unit/tree/test_order.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import webdataset as wds

from fusemount import mounted
from orderdata import shuffled_dataset


def test_readdir_and_the_readme_tar_recipe_keep_example_order(tmp_path: Path) -> None:
    dataset = shuffled_dataset(tmp_path / "ds")
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
