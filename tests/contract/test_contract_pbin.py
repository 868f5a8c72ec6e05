"""The format contract (tests/contract/contract.py) for Modalities .pbin token files."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from atlasfs.formats.pbin import write_pbin
from contract import FormatContract

DOCS = {f"part{k}": [list(range(k, k + n)) for n in range(0, 300)] for k in range(2)}


class TestPbinContract(FormatContract):
    kind = "pbin"

    def write(self, root: Path) -> Path:
        root.mkdir(parents=True)
        for stem, docs in DOCS.items():
            write_pbin(str(root / f"{stem}.pbin"), docs, token_width=2)
        return root

    def expected(self, dataset: Path) -> dict[str, dict[str, bytes]]:
        out = {}
        for stem, docs in DOCS.items():
            files = {}
            for n, doc in enumerate(docs):
                buffer = io.BytesIO()
                np.save(buffer, np.array(doc, dtype="<u2"))
                files[f"{n:06d}.npy"] = buffer.getvalue()
            out[stem] = files
        return out

    def damage(self, dataset: Path) -> str:
        (dataset / "part1.pbin").write_bytes(b"\x10" + bytes(30))
        return "part1"
