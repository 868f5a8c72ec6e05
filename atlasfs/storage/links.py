"""Which symbolic links atlasfs follows to a dataset's files: the rule against a confused deputy.

A dataset's links are followed (datasets are assembled from links: Hugging Face's cache is).
But a process of another user than the link's owner (root mounting a user's dataset with
``allow_other``, from ``/etc/fstab`` or systemd) would otherwise serve what the link's owner
could not read: a link to ``/root/secret`` or to another user's private file. So, as the
kernel's ``fs.protected_symlinks`` does for sticky folders, a link met on the way to a file is
followed only if the process runs as the link's owner (a user mounting their own dataset: no
change), the link is root's (trusted), or the link's owner owns the file it leads to (they
could read it anyway). Anything else is one :class:`~atlasfs.storage.UnfitFileError` naming the
link, and fails only what needs that file. On a FUSE file system another user mounted, that
user answers for every owner it shows (:mod:`atlasfs.storage.mounts`): its server could say
that its link is root's.

:func:`approved` resolves the path one component at a time (``lstat``, ``readlink``), as the
kernel would, and returns the ``stat`` of what it leads to; the caller opens the path and
checks that its descriptor is that same file (device and inode), so that a link swapped in
between is refused, never followed.
"""

from __future__ import annotations

import errno
import os
import stat

from atlasfs.storage.mounts import answering_user

#: Links followed on one path at most, as the kernel's limit (ELOOP past it).
MAX_LINKS = 40


def approved(path: str) -> os.stat_result:
    """The ``stat`` of what ``path`` leads to, if every symbolic link on the way (from ``/``)
    may be followed by this process (the rule above); else
    :class:`~atlasfs.storage.UnfitFileError` naming the link. ``OSError`` as ``os.stat``
    raises it (``FileNotFoundError``, ``NotADirectoryError``, ``PermissionError``: its
    ``filename`` is ``path``)."""
    links, st = _resolve(path)
    if links:
        me = os.geteuid()
        target_owner = answering_user(st)
        for link, link_st in links:
            owner = answering_user(link_st)
            if owner not in (0, me, target_owner):
                _refuse(path, link, owner, target_owner, st, me, link_st.st_uid)
    return st


def _resolve(path: str) -> tuple[list[tuple[str, os.stat_result]], os.stat_result]:
    """``(links met (path, lstat), stat of the end)``, resolving ``path`` as the kernel does."""
    # not os.path.abspath: it would fold "link/.." before the link is read, as the kernel does not
    full = path if path.startswith("/") else os.path.join(os.getcwd(), path)
    pending = full.split("/")[::-1]  # a stack: the next component last
    resolved = "/"
    links: list[tuple[str, os.stat_result]] = []
    st = None
    try:
        while pending:
            part = pending.pop()
            if part in ("", "."):
                continue
            if part == "..":
                resolved = os.path.dirname(resolved)
                st = None
                continue
            here = os.path.join(resolved, part)
            st = os.lstat(here)
            if stat.S_ISLNK(st.st_mode):
                if len(links) >= MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
                target = os.readlink(here)
                links.append((here, st))
                if target.startswith("/"):
                    resolved = "/"
                pending.extend(target.split("/")[::-1])
                st = None
            else:
                if pending and not stat.S_ISDIR(st.st_mode):
                    raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
                resolved = here
        if st is None:  # ended on "/", "..", or a link's target ending in "/"
            st = os.stat(resolved)
    except OSError as exc:  # named by the path asked for, as os.stat(path) would
        raise OSError(exc.errno, exc.strerror, path) from None
    return links, st


def _refuse(path: str, link: str, owner: int, target_owner: int, st: os.stat_result, me: int, claimed: int) -> None:
    from atlasfs.storage import UnfitFileError

    kind = "a folder" if stat.S_ISDIR(st.st_mode) else "a file"
    link_of = f"a symbolic link of uid {owner}"
    if claimed != owner:
        link_of += f" (the user of its FUSE file system, which says uid {claimed})"
    if link == os.path.abspath(path):
        what = f"{link_of} to {kind} of uid {target_owner}"
    else:
        what = f"{kind} of uid {target_owner} reached through {link}, {link_of}"
    raise UnfitFileError(path, f"{what}, not followed when atlasfs runs as uid {me}", errno.EACCES)


class Approvals:
    """Paths :func:`approved`, each with the file it led to (device, inode, owner): a ``stat``
    of the path that finds that same file again needs no new walk (the rule's walk costs an
    ``lstat`` a component; a shard's change check stats its files at every read). Another file
    there (a link swapped, the file replaced or given away) is walked again. At most
    :data:`MAX_REMEMBERED` paths (then forgotten all at once: walked again, never wrong)."""

    #: Paths remembered at most (about 200 bytes each).
    MAX_REMEMBERED = 1 << 16

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, int, int]] = {}

    def check(self, path: str, st: os.stat_result) -> None:
        """Return if ``st`` (``os.stat(path)`` just now) is of a file ``path`` may lead to by
        the rule; else :class:`~atlasfs.storage.UnfitFileError` naming the link (or, the path
        having changed between the two looks, naming that). ``OSError`` as :func:`approved`."""
        key = (st.st_dev, st.st_ino, st.st_uid)
        if self._known.get(path) == key:  # one dict look-up: atomic under the GIL
            return
        found = approved(path)
        if (found.st_dev, found.st_ino, found.st_uid) != key:
            from atlasfs.storage import UnfitFileError

            raise UnfitFileError(path, "replaced while it was looked at (a symbolic link on its way changed?)",
                                 errno.ESTALE)
        if len(self._known) >= self.MAX_REMEMBERED:
            self._known = {}
        self._known[path] = key
