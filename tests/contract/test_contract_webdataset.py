"""The format contract (tests/contract/contract.py) for WebDataset tar shards written by webdataset's ShardWriter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import webdataset

from contract import FormatContract

#: Samples as a producer writes them: keys of digits only (webdataset's common kind, which
#: must keep their names), fields of several kinds, one in upper case. (Keys with folders:
#: tests/unit/formats/test_webdataset_source.py, the contract's listing checks are of flat folders.)
SAMPLES = [{"__key__": f"{n:06d}", "txt": f"text {n}".encode() * (n % 7), "json": json.dumps({"n": n}).encode(),
            **({"seg.png": bytes(range(n % 256)) * 3} if n % 3 == 0 else {"CLS": str(n % 5).encode()})}
           for n in range(400)]


def read_back(paths: list[str]) -> list[dict]:
    """What ``webdataset.WebDataset`` yields for ``paths``, without decoders, in order."""
    return list(webdataset.WebDataset(paths, shardshuffle=False, empty_check=False))


class TestWebDatasetContract(FormatContract):
    kind = "webdataset"

    def write(self, root: Path) -> Path:
        root.mkdir(parents=True)
        with webdataset.ShardWriter(str(root / "part-%06d.tar"), maxcount=250, verbose=0) as sink:
            for sample in SAMPLES:
                sink.write(sample)
        return root

    def expected(self, dataset: Path) -> dict[str, dict[str, bytes]]:
        """Each tar's files as webdataset's own reader yields them: ``<key>.<field>`` -> bytes."""
        out = {}
        for name in sorted(os.listdir(dataset)):
            files = {}
            for sample in read_back([str(dataset / name)]):
                for field, value in sample.items():
                    if not field.startswith("__"):
                        files[f"{sample['__key__']}.{field}"] = value
            out[name[:-len(".tar")]] = files
        return out

    def damage(self, dataset: Path) -> str:
        path = dataset / "part-000001.tar"
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)  # inside a member of a sample part-way through
        return "part-000001"
