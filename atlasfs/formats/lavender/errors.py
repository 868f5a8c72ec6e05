"""Lavender's error, and how a failure of a shard file becomes one (a store that did not answer
stays the store's own error: the file is not bad)."""

from __future__ import annotations

from atlasfs.errors import AtlasFormatError
from atlasfs.storage.files import transient_failure


class LavenderError(AtlasFormatError):
    """A shardset, shard, row or uid that breaks the rules; the message names it."""


def failed(exc: BaseException, message: str) -> Exception:
    """What to raise for ``exc``: the store's own error if it did not answer (transient:
    the file is not bad), else a :class:`LavenderError` saying ``message``."""
    return transient_failure(exc) or LavenderError(message)


def reason(exc: BaseException) -> str:
    """An exception as a few words on one line."""
    text = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
    return " ".join(str(text).split())[:300]
