"""The process-wide caches of decompressed Atlas blocks that located reads and table builds
share (:data:`PAYLOADS`, :data:`JUST_DECODED`), each a bounded :class:`PayloadCache`."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable


class PayloadCache:
    """Decompressed blocks (or their first bytes) kept for the located reads that follow:
    a random reader that comes back to a block finds its run there and pays a slice, not a
    decompression. Bounded in bytes (:data:`PAYLOAD_KEEP_BYTES`), least recently used
    first out; one for the process, like the zstd contexts' pool. What it holds is checked
    like anything else a span is read from, so a stale entry can only cost a fallback."""

    def __init__(self, max_bytes: int, max_items: int = 1 << 30) -> None:
        self.max_bytes = max_bytes
        self.max_items = max_items
        self._items: OrderedDict[Hashable, bytes] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> bytes | None:
        with self._lock:
            payload = self._items.get(key)
            if payload is not None:
                self._items.move_to_end(key)
            return payload

    def put(self, key: Hashable, payload: bytes) -> None:
        """Keep ``payload`` for ``key`` unless as much of the block is kept already."""
        if len(payload) > self.max_bytes // 4:
            return
        with self._lock:
            old = self._items.get(key)
            if old is not None:
                if len(old) >= len(payload):
                    return
                self._bytes -= len(old)
            self._items[key] = payload
            self._items.move_to_end(key)
            self._bytes += len(payload)
            while self._bytes > self.max_bytes or len(self._items) > self.max_items:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= len(evicted)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0


#: What :data:`PAYLOADS` keeps: part of the daemon's stated fixed overhead (docs/performance.md).
#: The mount's located reads keep what they decompress in the tree's cache instead (a
#: :class:`~atlasfs.formats.source.Scratch`); this holds the pickles decodes made for the
#: table builds that follow them, and serves library use.
PAYLOAD_KEEP_BYTES = 16 << 20
PAYLOADS = PayloadCache(PAYLOAD_KEEP_BYTES)
#: The pickles of the last blocks decoded, for the table build that searches them right after
#: (:meth:`LocatedReads.file_spans`): as many as blocks are decoded at once
#: (``blocks.DECODERS``), so that decodes made to serve reads do not push
#: :data:`PAYLOADS` out.
JUST_DECODED = PayloadCache(64 << 20, max_items=2)
