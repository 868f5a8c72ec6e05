"""Exceptions raised by the Atlas format layer."""

from __future__ import annotations


class AtlasFormatError(Exception):
    """A dataset (or part of one) is malformed.

    The message always starts with the path of the offending file or folder,
    so that it can be shown to a user as one line.
    """


class UnsafePickleError(AtlasFormatError):
    """A block's pickle refers to a global outside the allow-list.

    Raised instead of running code from an untrusted pickle; pass
    ``trust_pickle=True`` (``--trust-pickle`` on the command line) to allow it.
    """

    def __init__(self, message: str, global_name: str) -> None:
        super().__init__(message)
        self.global_name = global_name
