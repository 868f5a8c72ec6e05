"""Tar members for the tests: one added to a tar, and a sample without webdataset's own keys."""

from __future__ import annotations

import io
import tarfile


def fields_of(sample: dict) -> dict:
    """A sample without webdataset's own ``__url__`` / ``__local_path__``."""
    return {k: v for k, v in sample.items() if k not in ("__url__", "__local_path__")}


def add(tar: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE) -> None:
    """Add a member of this type (a symbolic link points at a.txt)."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    if kind == tarfile.SYMTYPE:
        info.linkname = "a.txt"
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
