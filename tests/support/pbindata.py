"""Modalities' own files for the tests (tests/fixtures/modalities/): a fixture copied, and what
atlasfs says of a file its merge wrote."""

from __future__ import annotations

import shutil
from pathlib import Path

from corpus import FIXTURES


MODALITIES = FIXTURES / "modalities"
#: What the finding says, whatever the file: the writer and that its offsets were shifted.
FINDING = "offsets shifted by Modalities' merge (join_embedded_stream_data)"


def copy_modalities(fixture: str, tmp_path: Path) -> Path:
    """The fixture's data/ folder, copied (the tests never touch the corpus)."""
    return Path(shutil.copytree(MODALITIES / fixture / "data", tmp_path / fixture))
