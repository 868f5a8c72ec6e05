"""Whose word a file's owner is: on a FUSE file system a user mounted, that user's.

A FUSE server answers ``stat`` for its files, owner included: a user's server (mounted with
``allow_other``, which ``user_allow_other`` in /etc/fuse.conf lets any user ask for) can say
that its symbolic link is root's. The kernel records who mounted it (the mount's ``user_id``),
and that user is who answers for every file there: :func:`answering_user`.
"""

from __future__ import annotations

import os

#: Where the kernel lists this process's mounts.
MOUNTINFO = "/proc/self/mountinfo"


def answering_user(st: os.stat_result) -> int:
    """The uid that answers for the file ``st`` is of: its owner, unless it lies on a FUSE file
    system mounted by another user than root, whose ``user_id`` then answers. Read from
    :data:`MOUNTINFO` each time (a device number is reused once its file system is unmounted);
    only files on devices with no block device behind them (major 0: FUSE, tmpfs, NFS, ...)
    can be on such a mount, so others need no look."""
    if os.major(st.st_dev) != 0:
        return st.st_uid
    user = _fuse_user(os.major(st.st_dev), os.minor(st.st_dev))
    return st.st_uid if user is None or user == 0 else user


def _fuse_user(major: int, minor: int) -> int | None:
    """The ``user_id`` of the FUSE mount of device ``major:minor``; None if it is none."""
    device = f"{major}:{minor}"
    try:
        with open(MOUNTINFO, encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3 or fields[2] != device or " - " not in line:
                    continue
                after = line.split(" - ", 1)[1].split()
                if len(after) < 3 or not (after[0] == "fuse" or after[0].startswith("fuse.")):
                    return None
                for option in after[2].split(","):
                    if option.startswith("user_id="):
                        return int(option[len("user_id="):])
                return None
    except (OSError, ValueError):
        return None
    return None
