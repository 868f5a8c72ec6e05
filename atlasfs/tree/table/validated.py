"""The user's record of stored table files found valid, kept between mounts (issue #39, point 5).

Mapping a stored table checks every page of it (:mod:`atlasfs.tree.table.ondisk`): at 200,000
files a shard, a tenth of a second of the daemon's time per table, most of what a second
mount's ``find`` costs it. A file found valid is remembered by its identity (device, inode,
size, mtime and ctime in ns) with the limits it was checked against; this module keeps those in
``$XDG_CACHE_HOME/atlasfs/validated-tables``, one line a file, appended as tables are checked
(by a mount or by ``atlasfs index``), so that the next mount maps them after the header's
checks only.

Only the daemon's user's own table files are ever mapped, and atlasfs replaces them by rename,
never in place: a file of a remembered identity still holds what was checked. The record is
used only if it is a regular file of the user's own that no one else can write; a line that
is not eight integers is skipped.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable

from atlasfs.tree.table import ondisk
from atlasfs.tree.table.filetable import Limits, TableError

log = logging.getLogger("atlasfs")

#: The record's file name, beside the user's table cache (store.validated_root).
RECORD_NAME = "validated-tables"
#: Files remembered at most; the record is rewritten with the last ones when it holds twice that.
KEPT = 4096
#: The most of the record read (its end): ~50 bytes a line.
_READ_MAX = 2 * KEPT * 96

_lock = threading.Lock()
_loaded: set[str] = set()


def load(root: str, current: Callable[[], str]) -> int:
    """Read the record in the user's folder ``root`` (once a process) into ondisk's files found
    valid, and record from now on there every file checked in full while ``current()`` (the
    user's folder now) is ``root``; returns the files taken."""
    path = os.path.join(root, RECORD_NAME)

    def record(identity: tuple[int, ...], limits: Limits) -> None:
        if current() == root:
            _append(root, path, identity, limits)

    ondisk.on_validated = record
    with _lock:
        if path in _loaded:
            return 0
        _loaded.add(path)
    lines = _read(path)
    taken = 0
    for line in lines[-KEPT:]:
        fields = line.split()
        if len(fields) != 8 or not all(f.isdigit() for f in fields):
            continue
        values = [int(f) for f in fields]
        ondisk.remember(tuple(values[:5]), Limits(*values[5:]))
        taken += 1
    if len(lines) > 2 * KEPT:
        _rewrite(root, path, lines[-KEPT:])
    return taken


def _read(path: str) -> list[str]:
    """The record's lines, or none if it is missing or not to be trusted (logged)."""
    try:
        fd = ondisk.open_table(path)  # never through a symbolic link, never blocking
    except TableError:
        return []
    if fd is None:
        return []
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            log.info("ignoring %s: not a file of this user's that only they can change", path)
            return []
        start = max(0, st.st_size - _READ_MAX)
        data = os.pread(fd, st.st_size - start, start)
    except OSError:
        return []
    finally:
        os.close(fd)
    lines = data.decode("ascii", "replace").split("\n")
    if start:
        lines = lines[1:]  # the first may be cut
    return [line for line in lines if line]


def _append(root: str, path: str, identity: tuple[int, ...], limits: Limits) -> None:
    """Add one file found valid to the record (one short write, O_APPEND: whole lines)."""
    line = " ".join(str(v) for v in (*identity, limits.blocks, limits.block_size, limits.max_file_bytes)) + "\n"
    try:
        os.makedirs(root, mode=0o700, exist_ok=True)
        fd = os.open(path, ondisk.OPEN_FLAGS | os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode("ascii"))
        finally:
            os.close(fd)
    except OSError as exc:  # a read-only cache: the next mount checks the tables again
        log.debug("%s: not written (%s)", path, exc.strerror or exc)


def _rewrite(root: str, path: str, lines: list[str]) -> None:
    """Replace the record by ``lines`` (a temporary file, then a rename)."""
    try:
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{RECORD_NAME}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write("".join(line + "\n" for line in lines))
            os.replace(tmp, path)
        except OSError:
            os.unlink(tmp)
            raise
    except OSError as exc:
        log.debug("%s: not rewritten (%s)", path, exc.strerror or exc)
