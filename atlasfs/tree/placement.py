"""Where a source's shards sit in the tree: one folder per shard, and the folders
above shards whose names hold slashes (a Dolma documents file in a sub-folder).

A shard whose name is not a safe folder path, repeats another's, or is also the
folder of other shards is left out with one log line: no name may hide another.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from atlasfs.formats.naming import MAX_NAME_BYTES
from atlasfs.formats.source import SourceShard
from atlasfs.tree.base import Entry, not_found, split_path
from atlasfs.tree.table.layout import ROOT, shard_ino

log = logging.getLogger("atlasfs")


class ShardPlacement:
    """Shard names to positions, the folders above shards, and their entries."""

    def __init__(self, shards: Sequence[SourceShard], mtime: float) -> None:
        self.by_name: dict[str, int] = {}
        # Folders above shards named with slashes: path -> its children's names, in shard order.
        self.above: dict[str, list[str]] = {"": []}
        self._place(shards)
        self.root = Entry(True, 0, mtime, ROOT)
        self.shard_entries = [Entry(True, 0, shard.mtime, shard_ino(s)) for s, shard in enumerate(shards)]
        # Folders above shards: inode numbers below any shard's (which start at 1 << 32).
        self.above_entries = {path: Entry(True, 0, mtime, 2 + i)
                              for i, path in enumerate(p for p in self.above if p)}

    def _place(self, shards: Sequence[SourceShard]) -> None:
        folders = set()  # every folder above a shard
        for shard in shards:
            parts = shard.name.split("/")
            folders.update("/".join(parts[:k]) for k in range(1, len(parts)))
        for s, shard in enumerate(shards):
            parts = shard.name.split("/")
            problem = None
            if any(part in ("", ".", "..") or len(part.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES
                   for part in parts):
                problem = "is not a safe folder path"
            elif shard.name in self.by_name:
                problem = "repeats another shard's name"
            elif shard.name in folders:
                problem = "is also the folder of other shards"
            if problem:
                log.error("%s: its folder %r %s; it is left out", shard.path, shard.name, problem)
                continue
            self.by_name[shard.name] = s
            for k in range(1, len(parts) + 1):
                parent, child = "/".join(parts[:k - 1]), "/".join(parts[:k])
                children = self.above.setdefault(parent, [])
                if parts[k - 1] not in children:
                    children.append(parts[k - 1])
                if k < len(parts):
                    self.above.setdefault(child, [])

    def split(self, path: str) -> tuple[int | None, str, str]:
        """``(shard position, path inside its folder, folder above shards)`` of a tree path:
        the position None if the path is the root or a folder above shards (named by the
        third item); raises ENOENT if there is no such shard."""
        if path.startswith("/") and "//" not in path and not path.endswith("/"):  # as the kernel asks
            shard, _, rest = path[1:].partition("/")
        else:
            parts = split_path(path)
            shard, rest = (parts[0], "/".join(parts[1:])) if parts else ("", "")
        if not shard:
            return None, "", ""
        s = self.by_name.get(shard)
        if s is not None:
            return s, rest, ""
        while shard in self.above:  # a folder above shards: go down its path
            if not rest:
                return None, "", shard
            head, _, rest = rest.partition("/")
            shard = f"{shard}/{head}"
            s = self.by_name.get(shard)
            if s is not None:
                return s, rest, ""
        raise not_found(path)

    def entry_above(self, folder: str) -> Entry:
        """The entry of the root (``""``) or of a folder above shards."""
        return self.above_entries[folder] if folder else self.root

    def list_above(self, folder: str) -> list[tuple[str, Entry]]:
        """The children of the root or of a folder above shards: shards and such folders."""
        prefix = f"{folder}/" if folder else ""
        children = []
        for name in self.above[folder]:
            path = prefix + name
            s = self.by_name.get(path)
            children.append((name, self.shard_entries[s] if s is not None else self.above_entries[path]))
        return children
