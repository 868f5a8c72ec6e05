"""A Dolma dataset folder as a source: a shard (:class:`.shard.DolmaFile`) per documents file."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from atlasfs.formats.dolma.scan import LINES_PER_BLOCK
from atlasfs.formats.dolma.seek import DolmaError, OpenFiles
from atlasfs.formats.dolma.shard import SUFFIXES, DolmaFile, strip_suffix
from atlasfs.formats.source import Source

if TYPE_CHECKING:
    from atlasfs.formats.factory import SourceOptions


class DolmaSource(Source):
    """A Dolma dataset folder: its documents files (sorted by path), each a shard with the
    attribute sets that have a file at the same relative path."""

    kind = "dolma"

    def __init__(self, root: str) -> None:
        self.root = os.fspath(root)
        documents = os.path.join(self.root, "documents")
        if not os.path.isdir(documents):
            raise DolmaError(f"{self.root}: no documents/ folder (not a Dolma dataset)")
        self.sets_folder = os.path.join(self.root, "attributes")
        try:
            self.sets = sorted(n for n in os.listdir(self.sets_folder)
                               if not n.startswith(".") and os.path.isdir(os.path.join(self.sets_folder, n)))
        except OSError:
            self.sets = []
        files = OpenFiles()
        self.files: list[DolmaFile] = []
        for relative in _document_files(documents):
            attributes = {}
            for name in self.sets:
                path = os.path.join(self.sets_folder, name, relative)
                if os.path.isfile(path):
                    attributes[name] = path
            self.files.append(DolmaFile(self.root, relative, attributes, files))
        if not self.files:
            raise DolmaError(f"{documents}: no {', '.join('*' + s for s in SUFFIXES)} files")
        _unique_names(self.files)

    @property
    def shards(self) -> Sequence[DolmaFile]:
        """Its documents files."""
        return self.files

    def problems(self) -> list[str]:
        """Attributes files with no documents file at their path (no shard would show them)."""
        found = []
        relatives = {file.relative for file in self.files}
        for name in self.sets:
            folder = os.path.join(self.sets_folder, name)
            for relative in _document_files(folder):
                if relative not in relatives:
                    found.append(f"{os.path.join(folder, relative)}: no documents file "
                                 f"documents/{relative} (attribute set {name!r})")
        return found

    def info(self) -> list[str]:
        """The dataset, its documents files and attribute sets."""
        sets = ", ".join(self.sets) or "none"
        return [f"format       dolma: {len(self.files)} documents files ({sum(f.data_size for f in self.files)} bytes "
                f"with their attributes); attribute sets: {sets}; {LINES_PER_BLOCK} lines per block"]


def _unique_names(files: Sequence[DolmaFile]) -> None:
    """Give the files whose names clash (``a.jsonl.gz`` and ``a.jsonl``), or whose name is a
    folder of another's (``a.jsonl.gz`` and ``a/b.jsonl.gz``), their full relative path
    instead: two files cannot have one path, nor a file and a folder."""
    while True:
        seen: dict[str, list[DolmaFile]] = {}
        for file in files:
            seen.setdefault(file.name, []).append(file)
        folders = {"/".join(file.name.split("/")[:i]) for file in files for i in range(1, file.name.count("/") + 1)}
        clashing = [f for name, group in seen.items() for f in group
                    if (len(group) > 1 or name in folders) and f.name != f.relative]
        if not clashing:
            return
        for file in clashing:
            file.name = file.relative


def _document_files(documents: str) -> list[str]:
    found = []
    for folder, dirs, names in os.walk(documents):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if strip_suffix(name) is not None and not name.startswith("."):
                found.append(os.path.relpath(os.path.join(folder, name), documents).replace(os.sep, "/"))
    return sorted(found)


def looks_like(path: str) -> bool:
    """A folder with a ``documents/`` folder (no file is opened)."""
    return os.path.isdir(os.path.join(path, "documents"))


def open_source(path: str, options: "SourceOptions") -> DolmaSource:
    """The Dolma dataset at ``path`` (``options`` change nothing for this format)."""
    return DolmaSource(path)
