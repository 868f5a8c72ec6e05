"""Where shard file tables are kept between mounts.

Beside the dataset (``<dataset>/.atlasfs-tables/``, a hidden folder and so
never taken for a shard) when it is writable, else under the user's cache
folder (``$XDG_CACHE_HOME/atlasfs/<dataset id>/``). A table is used only if
it was built from exactly the same shard files (sizes and mtimes) and naming
rules; anything else is rebuilt.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from .filetable import FileTable, Limits

log = logging.getLogger("atlasfs")
BESIDE_DATASET = ".atlasfs-tables"


def _user_cache(root: str) -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    digest = hashlib.sha256(os.path.realpath(root).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(base, "atlasfs", digest)


def _writable(folder: str) -> bool:
    """Writable, and meant to be: root may write anywhere, but a folder without
    write permission bits is read-only by intent (a shared dataset)."""
    if not os.path.isdir(folder):
        return True  # the cache folder, created on demand
    return os.access(folder, os.W_OK) and bool(os.stat(folder).st_mode & 0o222)


class TableStore:
    """Loads and saves the file tables of one dataset's shards."""

    def __init__(self, dataset_root: str) -> None:
        self.folders = [os.path.join(dataset_root, BESIDE_DATASET), _user_cache(dataset_root)]

    def location(self) -> str:
        """Where new tables go: the first writable place."""
        return next((f for f in self.folders if _writable(os.path.dirname(f))), self.folders[-1])

    def load(self, shard: str, key: dict[str, Any], limits: Limits) -> FileTable | None:
        """The stored table of ``shard`` built from ``key``, if any is valid."""
        for folder in self.folders:
            table = FileTable.load(os.path.join(folder, f"{shard}.table"), key, limits)
            if table is not None:
                return table
        return None

    def save(self, shard: str, key: dict[str, Any], table: FileTable) -> str | None:
        """Store ``table`` in the first writable place; returns where, or None."""
        for folder in self.folders:
            if not _writable(os.path.dirname(folder)):
                continue
            try:
                os.makedirs(folder, exist_ok=True)
                path = os.path.join(folder, f"{shard}.table")
                table.save(path, key)
                return path
            except OSError as exc:
                log.debug("cannot store the file table of shard %s in %s: %s", shard, folder, exc)
        return None
