"""What a reader remembers of a shard's blocks' fingerprints: the CRC-32 of a block's stored
bytes (:func:`~.find.block_fingerprint` of a block whose frame has no content checksum:
strategy 0) costs a read of the whole block, so it is computed once a block and remembered
while ``data.bin`` stays the same file (:class:`StoredFingerprints`). ``located.c`` does the
same in C, by the same rules."""

from __future__ import annotations

import os
import struct
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

#: A fingerprint read from a file changed less than this long ago (its ctime or mtime) is not
#: remembered: a file system stamps changes with a coarse clock (a tick of 1-10 ms; whole
#: seconds on some), so a second change within the same tick could leave the file's identity
#: as it was when the block was read ("racy git"'s problem). Past it, any change stamps a
#: later time.
RACY_NS = 2_000_000_000


def file_identity(path: str, storage: Any) -> int | None:
    """A nonzero 32-bit token of what file ``path`` is now, or None if what is read from it
    now must not be remembered (it changed within :data:`RACY_NS`, or it cannot be stat'ed).

    A local file's token is a hash of its device, inode, size, mtime and ctime: a write
    changes the ctime, and so does setting the mtime back (``utime``); only the superuser
    can set a ctime. It is of the descriptor ``storage`` reads ``path`` through
    (:meth:`~atlasfs.storage.LocalStorage.held_stat`), as ``located.c`` fstats its own: a
    file renamed over ``path`` since is not what the reads see, so its token is not theirs.
    Only before ``storage`` holds one (its first read) is ``path`` stat'ed. A store's object's
    is its listed size, mtime and ETag: its reads are of that object (its ETag checked where
    the store can)."""
    if storage.remote:
        found = storage.stat(path)
        if found is None:
            return None
        etag = getattr(storage, "etag", lambda _: None)(path)
        key = f"{found[0]}\0{found[1]}\0{etag or ''}".encode()
    else:
        now = time.time_ns()  # before the read that is remembered
        try:
            held = getattr(storage, "held_stat", None)
            st = held(path) if held is not None else None
            if st is None:
                st = os.stat(path)
        except OSError:
            return None
        if now - max(st.st_ctime_ns, st.st_mtime_ns) < RACY_NS:
            return None
        key = struct.pack("<QQqqq", st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return zlib.crc32(key) | 1  # nonzero: an entry that was made


class StoredFingerprints:
    """Blocks' stored CRC-32s of one shard, each remembered with the :func:`file_identity` of
    ``data.bin`` it was read under and used only while that identity holds: 8 bytes a block
    (as much as the shard's index), made at the first fingerprint remembered, so that shards
    whose frames carry checksums never have one."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._entries: np.ndarray | None = None  # identity << 32 | crc; 0: none

    def get(self, block: int, identity: int | None, compute: Callable[[], int | None]) -> int | None:
        """Block ``block``'s fingerprint: remembered under ``identity``, else ``compute()``d
        (None: the block could not be read whole) and remembered if ``identity`` is not None."""
        entries = self._entries
        if identity is not None and entries is not None and 0 <= block < len(entries):
            entry = int(entries[block])
            if entry >> 32 == identity:
                return entry & 0xFFFFFFFF
        crc = compute()
        if crc is not None and identity is not None and 0 <= block < self.num_blocks:
            if entries is None:
                entries = self._entries = np.zeros(self.num_blocks, dtype=np.uint64)
            entries[block] = identity << 32 | crc
        return crc
