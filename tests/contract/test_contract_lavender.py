"""The format contract (tests/contract/contract.py) for Lavender shardsets joined by uid."""

from __future__ import annotations

from pathlib import Path

from contract import FormatContract
from lavenderdata import lavender_dataset


class TestLavenderContract(FormatContract):
    kind = "lavender"

    def write(self, root: Path) -> Path:
        lavender_dataset(root, shards=2, rows=10)
        return root

    def damage(self, dataset: Path) -> str:
        for shardset in ("images", "captions"):
            (dataset / shardset / "shard.00001.csv").write_bytes(b"\xff\xfe\x00 not csv")
        (dataset / "scores" / "shard.00001.parquet").write_bytes(b"PAR1 not really")
        return "shard.00001"
