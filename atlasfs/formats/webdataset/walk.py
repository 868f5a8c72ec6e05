"""One pass over a tar shard's headers: where each member's bytes lie, nothing of them read.

Python's :mod:`tarfile` parses the headers (ustar, GNU long names, pax), in random-access
mode, so a member's data is skipped with a seek, never read. Every place it gives is
checked against the file's size here: tarfile does not check them, and it ends the
archive without a word at a header it cannot parse past the first one. Such an end (a tar
cut short, or damaged) is the walk's :attr:`Walk.cut`: the last sample read may lack files,
so its block fails alone (:mod:`.samples`), as does that of a member whose data runs past
the file's end. Data after the end-of-archive marker is a problem line.
"""

from __future__ import annotations

import re
import tarfile
from dataclasses import dataclass, field

import numpy as np

from atlasfs.errors import AtlasFormatError
from atlasfs.storage import LOCAL, Storage
from atlasfs.storage.files import transient_failure

#: Members webdataset skips as the archive's own metadata (``tar_file_iterator``'s ``meta_prefix``,
#: ``meta_suffix`` and ``skip_meta``): not samples' files, left out without a word.
_META = re.compile(r"__[^/]*__($|/)")
#: Magic numbers of compressed files: a shard that is one is refused saying so.
_COMPRESSED = {b"\x1f\x8b": "gzip", b"\x28\xb5\x2f\xfd": "zstd", b"BZh": "bzip2", b"\xfd7zXZ": "xz"}
#: Bytes read at a time while looking at what follows the archive's last member.
_TAIL_CHUNK = 1 << 20
#: Most bytes tarfile may read at once in a walk: a header (512), or the payload of a pax or
#: GNU long-name header, which tarfile reads whole by the size its header states.
MAX_HEADER_BYTES = 1 << 20


class _HeaderTooLarge(tarfile.TarError):
    pass


class _HeaderReads:
    """The tar file as :mod:`tarfile` reads it in a walk (headers only: it seeks over data),
    any read past :data:`MAX_HEADER_BYTES` refused. A pax or GNU long-name header stating
    1.5 GiB over a sparse tar was read whole (info, verify and the daemon at 1.6 GB, 30 s);
    now the walk stops there, the members before it kept, with one line naming the offset."""

    def __init__(self, f) -> None:  # noqa: ANN001 (a binary file)
        self._f = f

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or size > MAX_HEADER_BYTES:
            raise _HeaderTooLarge(f"a pax or long-name header of {size} bytes, more than {MAX_HEADER_BYTES}")
        return self._f.read(size)

    def __getattr__(self, name: str):  # noqa: ANN204 (seek, tell...: the file's own)
        return getattr(self._f, name)


class WebDatasetError(AtlasFormatError):
    """A tar shard (or a member of one) that cannot be read; the message names it."""


@dataclass
class Walk:
    """What a shard's headers say: its regular members in archive order, and what is wrong.

    ``offsets`` and ``sizes`` (int64) place each member's data in the file; ``problems``
    are one line each naming the file (and member); ``cut``, why the walk stopped before
    the archive's end, if it did."""

    names: list[str]
    offsets: np.ndarray
    sizes: np.ndarray
    problems: list[str] = field(default_factory=list)
    cut: str | None = None


def is_meta(name: str) -> bool:
    """Whether webdataset skips the member ``name`` as metadata (``__index__``, ``__x__/y``)."""
    return ("/" not in name and name.startswith("__") and name.endswith("__")) or _META.match(name) is not None


def walk(path: str, file_size: int, storage: Storage = LOCAL) -> Walk:
    """The members of the tar file ``path`` (``file_size`` bytes now), read through ``storage``
    (headers only: tarfile seeks over the members' data). Raises :class:`WebDatasetError` if
    it is not an uncompressed tar at all (its first header)."""
    names: list[str] = []
    offsets: list[int] = []
    sizes: list[int] = []
    problems: list[str] = []
    cut = None
    try:
        with storage.open(path) as f:
            try:
                tar = tarfile.open(fileobj=_HeaderReads(f), mode="r:")
            except tarfile.TarError as exc:
                if isinstance(exc, _HeaderTooLarge):
                    raise WebDatasetError(f"{path}: cut short or damaged at offset 0 ({exc})") from None
                f.seek(0)
                magic = f.read(6)
                for packed, kind in _COMPRESSED.items():
                    if magic.startswith(packed):
                        raise WebDatasetError(f"{path}: not an uncompressed tar file ({kind}-compressed); "
                                              "compressed shards are not read") from None
                raise WebDatasetError(f"{path}: not an uncompressed tar file ({exc})") from None
            while True:
                at = tar.offset
                try:
                    info = tar.next()
                except (tarfile.TarError, UnicodeError, ValueError) as exc:  # cut, or a bad pax or long-name header
                    cut = f"cut short or damaged at offset {at} ({exc})"
                    break
                if info is None:
                    cut = _tail(f, path, tar.offset, file_size, problems)
                    break
                tar.members.clear()  # kept by tarfile otherwise: a shard of millions of members
                name = info.name
                if info.isdir() or is_meta(name):
                    continue  # webdataset skips them too, and they are no sample's files
                if not info.isreg() or info.issparse():
                    what = "a sparse file" if info.issparse() else "a link or special file"
                    problems.append(f"{path} member {name!r}: {what}, not a regular file; left out "
                                    "(webdataset skips it too)")
                    continue
                names.append(name)
                offsets.append(info.offset_data)
                sizes.append(info.size)
    except OSError as exc:
        failure = transient_failure(exc)
        if failure is not None:  # the store did not answer: nothing about the file is learned
            raise failure from None
        raise WebDatasetError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    return Walk(names, np.array(offsets, dtype=np.int64), np.array(sizes, dtype=np.int64), problems, cut)


def _tail(f, path: str, end: int, file_size: int, problems: list[str]) -> str | None:  # noqa: ANN001 (a binary file)
    """Why the archive stops before its end at ``end``, where tarfile stopped without a word
    (a header it cannot parse, or cut short), or None: zero blocks (the end-of-archive marker
    and padding), or the file's end. Data after the marker is added to ``problems``."""
    if end >= file_size:
        return None
    f.seek(end)
    head = f.read(tarfile.BLOCKSIZE)
    if any(head):
        return f"cut short or damaged at offset {end} (not a tar header; {file_size - end} bytes left out)"
    at = end + len(head)
    while at < file_size:
        chunk = f.read(_TAIL_CHUNK)
        if not chunk:
            break
        if any(chunk):
            first = at + next(i for i, b in enumerate(chunk) if b)
            problems.append(f"{path}: data after the end-of-archive marker (from offset {first}) is left out")
            break
        at += len(chunk)
    return None
