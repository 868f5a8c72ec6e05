"""The conformance corpus (tests/fixtures/<format>/): datasets written by each real producer
tool with that tool's own reading in expected.json (scripts/make-fixtures.py made them)."""

from __future__ import annotations

import base64
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

#: Format folder -> the producer's distribution name and pinned version (as in its README).
FORMATS: dict[str, tuple[str, str]] = {
    "dolma": ("dolma", "1.2.1"),
    "lavender": ("lavender-data", "0.1.10"),
    "modalities": ("modalities", "0.5.0"),
    "webdataset": ("webdataset", "1.0.2"),
}


def decode(value: Any) -> Any:
    """expected.json data with its tagged values restored: {"$bytes"} -> bytes, {"$npy"} ->
    numpy array, {"$float": "nan"} -> NaN (scripts/make-fixtures.py's encoding)."""
    if isinstance(value, dict):
        if len(value) == 1:
            (tag, payload), = value.items()
            if tag == "$bytes":
                return base64.b64decode(payload, validate=True)
            if tag == "$npy":
                return np.load(io.BytesIO(base64.b64decode(payload, validate=True)),
                               allow_pickle=False)
            if tag == "$float":
                return float(payload)
        return {k: decode(v) for k, v in value.items()}
    if isinstance(value, list):
        return [decode(v) for v in value]
    return value


def expected(fmt: str, fixture: str) -> Any:
    """The decoded expected.json of tests/fixtures/<fmt>/<fixture>/."""
    return decode(json.loads((FIXTURES / fmt / fixture / "expected.json").read_text("utf-8")))


def fixture_names(fmt: str) -> list[str]:
    """The fixtures of a format: its sub-folders that have an expected.json."""
    return sorted(p.parent.name for p in (FIXTURES / fmt).glob("*/expected.json"))


def copy_data(fmt: str, fixture: str, tmp_path: Path) -> Path:
    """A copy of a fixture's data folder at tmp_path/source, for a test to read or damage."""
    return Path(shutil.copytree(FIXTURES / fmt / fixture / "data", tmp_path / "source"))
