"""The format contract (tests/contract/contract.py) for Dolma documents with attribute sets."""

from __future__ import annotations

import shutil
from pathlib import Path

from contract import FormatContract
from dolmadata import expected_files, make_dataset

MADE: dict[Path, dict] = {}


class TestDolmaContract(FormatContract):
    kind = "dolma"

    def write(self, root: Path) -> Path:
        MADE[root] = make_dataset(root, n=600)
        shutil.rmtree(root / "attributes" / "bad")  # expected_files knows the tox set only
        return root

    def expected(self, dataset: Path) -> dict[str, dict[str, bytes]]:
        return expected_files(dataset, MADE[dataset])

    def damage(self, dataset: Path) -> str:
        (dataset / "documents" / "cc" / "b.jsonl.zst").write_bytes(b"not zstd at all")
        return "cc/b"
