"""Lavender's error, and how a failure of a shard file becomes one (a store that did not answer
stays the store's own error: the file is not bad)."""

from __future__ import annotations

from atlasfs.errors import AtlasFormatError
from atlasfs.storage.files import transient_failure


class LavenderError(AtlasFormatError):
    """A shardset, shard, row or uid that breaks the rules; the message names it."""


class TooLarge(LavenderError):
    """Rows asked for take more bytes than the reader's bound (what is left of a block's); nothing
    more is read. The message names the file, the rows and their bytes."""


def too_wide(path: str, columns: int, max_columns: int) -> LavenderError:
    """The error of a shard file with more columns than ``max_columns`` (each a file of every sample)."""
    return LavenderError(f"{path}: {columns} columns, more than {max_columns} (a file each a sample); not read")


def failed(exc: BaseException, message: str) -> Exception:
    """What to raise for ``exc``: the store's own error if it did not answer (transient:
    the file is not bad), else a :class:`LavenderError` saying ``message``."""
    return transient_failure(exc) or LavenderError(message)


def reason(exc: BaseException) -> str:
    """An exception as a few words on one line."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())[:300]


#: Problem lines one pass keeps of one file (the rest are counted, in one line): a csv of 15 MiB,
#: 8 million rows of one cell, made 8 million lines, 4.3 GB and a saved state of 735 MB. Dolma
#: keeps as many.
MAX_PROBLEMS = 1000


class Problems:
    """Problem lines, one a broken rule, in the order found; past :data:`MAX_PROBLEMS` of one
    file, counted instead, and the count said in one line at the end (:meth:`lines`)."""

    def __init__(self) -> None:
        self._lines: list[str] = []
        self._counts: dict[str, int] = {}

    def add(self, path: str, line: str) -> None:
        """Keep ``line``, a problem of file ``path``, or count it once ``path`` has its share."""
        count = self._counts[path] = self._counts.get(path, 0) + 1
        if count <= MAX_PROBLEMS:
            self._lines.append(line)

    def lines(self) -> list[str]:
        """The lines kept, then one line a file with more."""
        return self._lines + [f"{path}: {count - MAX_PROBLEMS} more problems (the first {MAX_PROBLEMS} are listed)"
                              for path, count in self._counts.items() if count > MAX_PROBLEMS]
