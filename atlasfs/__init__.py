"""atlasfs: read, write, verify and mount Atlas datasets."""

from __future__ import annotations

import importlib
from typing import Any

#: The public names, and the module each comes from. They are imported on first use: the
#: ``atlasfs`` command imports this package before it can install its Ctrl-C handling, and
#: numpy with the format layer take ~90 ms, a window in which Ctrl-C printed a traceback.
_EXPORTS = {
    "AtlasDataset": "atlasfs.formats.atlas.dataset",
    "AtlasFormatError": "atlasfs.errors",
    "AtlasWriter": "atlasfs.formats.atlas.writer",
    "CompressionStrategy": "atlasfs.formats.atlas.meta",
    "Shard": "atlasfs.formats.atlas.dataset",
    "UnsafePickleError": "atlasfs.errors",
    "wids_in_place": "atlasfs.wids_in_place",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'atlasfs' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
