"""The format contract (tests/contract/contract.py) for Atlas, on data written by AtlasWriter."""

from __future__ import annotations

import os
from pathlib import Path

from atlasfs import AtlasWriter
from contract import FormatContract
from helpers import contract_files

EXAMPLES = [{"__key__": f"sample{i:03d}", "txt": f"text {i} ü", "cls": i % 7, "jpg": bytes([i % 256]) * (i * 13 % 500)}
            for i in range(90)]
SHARD_SIZE = 40


class TestAtlasContract(FormatContract):
    kind = "atlas"

    def write(self, root: Path) -> Path:
        with AtlasWriter(root, shard_size=SHARD_SIZE, block_size=8, compression_strategy=2) as writer:
            for example in EXAMPLES:
                writer.add_example(example)
        return root

    def expected(self, dataset: Path) -> dict[str, dict[str, bytes]]:
        folders = sorted(name for name in os.listdir(dataset) if (dataset / name / "meta.json").exists())
        sizes = [min(SHARD_SIZE, len(EXAMPLES) - s * SHARD_SIZE) for s in range(len(folders))]
        return {folder: {name: data for name, (data, _) in files.items()}
                for folder, files in zip(folders, contract_files(EXAMPLES, sizes))}

    def damage(self, dataset: Path) -> str:
        folder = sorted(name for name in os.listdir(dataset) if (dataset / name / "meta.json").exists())[1]
        data = dataset / folder / "data.bin"
        os.truncate(data, data.stat().st_size // 2)
        return folder
