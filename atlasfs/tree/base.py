"""The tree interface every mountable source answers.

A source maps slash-separated paths ("/", "/00", "/00/000001.jpg") to
entries and reads bytes from files. The FUSE engine and ``atlasfs export``
only ever talk to this interface, so a new source (another format, several
datasets joined) plugs in without touching either.

Errors are ``OSError`` with an errno: ENOENT for unknown paths, ENOTDIR,
EIO for data that cannot be read (:class:`Unreadable` when the data itself is bad).
"""

from __future__ import annotations

import errno
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple


class Entry(NamedTuple):
    """One file or folder. ``ref`` is the source's own handle for reading it.

    A named tuple because the mount creates one per request.
    """

    is_dir: bool
    size: int
    mtime: float
    ino: int
    ref: Any = None


class Tree(ABC):
    """A read-only tree of folders and files."""

    @abstractmethod
    def lookup(self, path: str) -> Entry:
        """The entry at ``path``; raises ``OSError(ENOENT)`` if there is none."""

    @abstractmethod
    def listdir(self, path: str) -> list[tuple[str, Entry]]:
        """``(name, entry)`` of each child of the folder ``path``, in the order the source gives
        its samples (the dataset's example order): a listing keeps a dataset's order."""

    def names(self, path: str) -> Sequence[tuple[str, bool, int]]:
        """``(name, is_dir, ino)`` of each child of the folder ``path``, in :meth:`listdir`
        order: what a directory listing shows. A source that must work to know
        its file sizes overrides this to skip that work (and may hand out the
        same immutable sequence to every caller)."""
        return [(name, entry.is_dir, entry.ino) for name, entry in self.listdir(path)]

    def known_entries(self, path: str, start: int = 0, stop: int | None = None) -> Sequence[Entry | None]:
        """For the children ``start:stop`` of the folder ``path``, in :meth:`names` order:
        each one's entry if the source knows it without work, else None.

        A listing that carries attributes (FUSE's READDIRPLUS) spares the kernel a
        lookup per file for ``ls -l``, ``find`` or ``tar``; a source that would
        have to work out sizes answers None for those files, which are then
        looked up when needed. The default takes them from :meth:`listdir`: a
        source that overrides :meth:`names` to skip work overrides this too."""
        return [entry for _, entry in self.listdir(path)[start:stop]]

    @abstractmethod
    def read(self, entry: Entry, offset: int, size: int) -> bytes:
        """Up to ``size`` bytes of the file ``entry`` from ``offset``."""

    def shard_folders(self) -> list[str]:
        """The folders that are shards, as paths without a leading slash, in the dataset's
        order: each is one ``<shard>.tar`` of the tar view and of ``atlasfs export``. The
        default: the top-level folders."""
        return [name for name, is_dir, _ in self.names("/") if is_dir]

    def total_bytes(self) -> int:
        """Bytes the tree's data occupies on disk (for ``statfs``); 0 if unknown."""
        return 0

    def walk(self, path: str = "/") -> Iterator[tuple[str, Entry]]:
        """Every file below ``path`` as ``(path relative to it, entry)``, depth first in
        listing order: the order ``tar`` archives a folder in."""
        for name, entry in self.listdir(path):
            child = f"{path.rstrip('/')}/{name}"
            if entry.is_dir:
                for sub, sub_entry in self.walk(child):
                    yield f"{name}/{sub}", sub_entry
            else:
                yield name, entry

    def members(self, path: str) -> Iterator[tuple[str, Entry]]:
        """Every file below the folder ``path`` as ``(path relative to it, entry)``, in the
        order of the samples they belong to, a sample's files adjacent: what a tar of the
        folder holds (``atlasfs export``). The default is :meth:`walk`'s order, which is the
        same for a folder without sub-folders; a source whose sub-folders regroup samples
        overrides it."""
        return self.walk(path)


    def member_files(self, path: str) -> Iterator[tuple[str, Entry, bytes | None]]:
        """:meth:`members` with each file's bytes where the source has them at hand without a
        read per file (None: read them with :meth:`read`). What one pass over every file
        uses (``atlasfs export``); the bytes must be the ones :meth:`read` gives."""
        for name, entry in self.members(path):
            yield name, entry, None


class Unreadable(OSError):
    """EIO for data that is bad (a shard that cannot be opened, a block that cannot be
    decoded), as opposed to a read that failed for a while (a store that did not answer):
    what fails this way keeps failing, and only the shard or block it names.

    ``cause`` says what is wrong in one line naming the file, in no command's words:
    the mount's log, ``export``, ``index`` and the tar view's ``shards.json`` each word
    what it means for them."""

    def __init__(self, cause: str) -> None:
        super().__init__(errno.EIO, cause)
        self.cause = cause


def split_path(path: str) -> list[str]:
    """Components of an absolute tree path; ``"/"`` has none."""
    if not path.startswith("/"):
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), path)
    return [part for part in path.split("/") if part]


def not_found(path: str) -> OSError:
    """The error for a path that is not in the tree."""
    return OSError(errno.ENOENT, os.strerror(errno.ENOENT), path)
