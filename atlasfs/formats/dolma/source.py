"""A Dolma dataset folder as a source: a shard (:class:`.shard.DolmaFile`) per documents file."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from atlasfs.formats.dolma.scan import LINES_PER_BLOCK
from atlasfs.formats.dolma.seek import DolmaError, OpenFiles
from atlasfs.formats.dolma.names import READ, folder_name, is_documents_file, why_not_read
from atlasfs.formats.dolma.shard import DolmaFile
from atlasfs.formats.source import Source, shown_names
from atlasfs.storage import LOCAL, Storage
from atlasfs.storage.files import listdir_or_empty, relative, walk

if TYPE_CHECKING:
    from atlasfs.formats.factory import SourceOptions

log = logging.getLogger("atlasfs")


class DolmaSource(Source):
    """A Dolma dataset folder: its documents files (sorted by path), each a shard with the
    attribute sets that have a file at the same relative path."""

    kind = "dolma"

    def __init__(self, root: str, storage: Storage = LOCAL) -> None:
        self.root = os.fspath(root)
        self.storage = storage
        documents = os.path.join(self.root, "documents")
        if not storage.isdir(documents):
            raise DolmaError(f"{self.root}: no documents/ folder (not a Dolma dataset)")
        self.sets_folder = os.path.join(self.root, "attributes")
        self.sets = sorted(n for n, is_dir in listdir_or_empty(storage, self.sets_folder)
                           if is_dir and not n.startswith("."))
        files = OpenFiles()
        self.files: list[DolmaFile] = []
        found, self.layout_problems = _walk(storage, documents)
        #: set name -> documents files (relative) with no file in that set, for verify's warnings
        self.untagged: dict[str, list[str]] = {}
        documents_files = [rel for rel in found if is_documents_file(os.path.basename(rel))]
        for rel in found:
            if not is_documents_file(os.path.basename(rel)):
                self.layout_problems.append(why_not_read(os.path.join(documents, rel)))
        named = [(os.path.join(documents, rel), folder_name(rel)) for rel in documents_files]
        self.layout_problems.extend(shown_names(named, logged=False))  # logged below with the others
        shown = {path for path, _ in named}
        for rel in documents_files:
            if os.path.join(documents, rel) not in shown:
                continue
            attributes = {}
            for name in self.sets:
                # dolma's rule: the documents path with documents/ replaced by attributes/<set>/
                path = os.path.join(self.sets_folder, name, rel)
                if storage.stat(path) is not None:  # a FIFO there too: its shard fails naming it
                    attributes[name] = path
                else:
                    self.untagged.setdefault(name, []).append(rel)
            self.files.append(DolmaFile(self.root, rel, attributes, files, storage))
        for problem in self.layout_problems:
            log.warning("%s", problem)
        for name, missing in sorted(self.untagged.items()):
            log.info("attribute set %r has no file for %d of %d documents files (first: %s); their documents show "
                     "without <id>.%s.json (atlasfs verify lists them)", name, len(missing),
                     len(self.files), os.path.join(self.sets_folder, name, missing[0]), name)
        if not self.files:
            raise DolmaError(f"{documents}: no documents files ({', '.join(READ)})"
                             + (f"; {self.layout_problems[0]}" if self.layout_problems else ""))
        _unique_names(self.files)

    @property
    def shards(self) -> Sequence[DolmaFile]:
        """Its documents files."""
        return self.files

    def problems(self) -> list[str]:
        """Files under ``documents/`` that are not read (a name that is not a documents
        file's, a folder that cannot be listed), and files in an attribute set with no
        documents file at their path (no shard would show them)."""
        found = list(self.layout_problems)
        relatives = {file.relative for file in self.files}
        for name in self.sets:
            folder = os.path.join(self.sets_folder, name)
            files, unlisted = _walk(self.storage, folder)
            found += unlisted
            for rel in files:
                if rel not in relatives:
                    found.append(f"{os.path.join(folder, rel)}: no documents file "
                                 f"documents/{rel} (attribute set {name!r})")
        return found

    def warnings(self) -> list[str]:
        """Documents files with no file in an attribute set: they serve without that set."""
        return [f"{os.path.join(self.root, 'documents', relative)}: no attributes file "
                f"{os.path.join(self.sets_folder, name, relative)} (attribute set {name!r}); "
                f"its documents show without <id>.{name}.json"
                for name, missing in sorted(self.untagged.items()) for relative in missing]

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


def _walk(storage: Storage, folder: str) -> tuple[list[str], list[str]]:
    """Every file under ``folder`` (relative paths, sorted; hidden files and folders left
    out: partial downloads and the like, which dolma's globs do not match either), and a line
    per folder that cannot be listed."""
    found: list[str] = []
    unlisted: list[str] = []

    def failed(exc: OSError) -> None:
        unlisted.append(f"{exc.filename or folder}: cannot be listed ({exc.strerror}); the files in it are not read")

    for here, dirs, names in walk(storage, folder, onerror=failed):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in names:
            if not name.startswith("."):
                found.append(relative(os.path.join(here, name), folder))
    return sorted(found), unlisted


def looks_like(path: str, storage: Storage = LOCAL) -> bool:
    """A folder with a ``documents/`` folder (no file is opened)."""
    return storage.isdir(os.path.join(path, "documents"))


def open_source(path: str, options: "SourceOptions", storage: Storage = LOCAL) -> DolmaSource:
    """The Dolma dataset at ``path``, read through ``storage`` (``options`` change nothing for this format)."""
    return DolmaSource(path, storage)
