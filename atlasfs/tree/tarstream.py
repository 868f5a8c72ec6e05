"""Reads of a tar from front to back served by one pass over its members, as export writes it.

A reader going through a ``<shard>.tar`` in order (``cat``, ``tar``, webdataset) asks for
it a request at a time (up to 1 MiB, several at once with the kernel's read-ahead). Placing
each request's members by path costs a lookup per file (most of a small-file tar's time);
a :class:`Stream` instead goes on with the tar's pieces in order (:meth:`TarLayout.pieces
<atlasfs.tree.tarview.TarLayout.pieces>`: the entries of the member pass, the bytes export
writes) and keeps the last :data:`WINDOW` bytes it made for requests that arrive a little
out of order. A request it cannot serve (before its window, or far past it) is left to the
caller's random-access read; so is any request once its pass failed (a bad block: the
random read then fails only the ranges over it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

#: Bytes of a pass kept behind what it made last, for requests served out of order.
WINDOW = 4 << 20
#: How far past what a pass made a request may start and still be served by it (the kernel's
#: read-ahead keeps a few requests in flight, answered by threads in any order).
AHEAD = 4 << 20
#: Passes kept at once, the least recently used dropped (at most WINDOW + a request each).
STREAMS = 4


class Stream:
    """One pass over a tar's pieces from its start, with a window of the pieces it made."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._pieces = pieces
        self._kept: deque[tuple[int, bytes]] = deque()  # (tar offset, piece), in order
        self._start = 0  # where the first kept piece starts
        self.end = 0  # where what the pass made so far ends
        self.lock = threading.Lock()
        self.failed = False

    def serves(self, offset: int) -> bool:
        """Whether a request at ``offset`` is this pass's to serve."""
        return not self.failed and self._start <= offset <= self.end + AHEAD

    def read(self, offset: int, stop: int) -> bytes | None:
        """Bytes ``[offset, stop)`` of the tar, the pass going on as far as ``stop``; None if
        the request is not this pass's (lock held by the caller). An error of the pass (a
        block that fails) marks it failed and is raised no further: None."""
        if not self.serves(offset):
            return None
        kept = self._kept
        try:
            while self.end < stop:
                piece = next(self._pieces, None)
                if piece is None:
                    break
                if piece:
                    kept.append((self.end, piece))
                    self.end += len(piece)
        except Exception:  # noqa: BLE001 (the random read says what fails, for the ranges over it)
            self.failed = True
            return None
        parts = []
        for at, piece in kept:  # at most WINDOW + a request of pieces
            if at >= stop:
                break
            if at + len(piece) > offset:
                parts.append(piece[max(offset - at, 0):stop - at])
        while kept and kept[0][0] + len(kept[0][1]) < self.end - WINDOW:
            kept.popleft()
        self._start = kept[0][0] if kept else self.end
        return parts[0] if len(parts) == 1 else b"".join(parts)


class Streams:
    """The passes under way, keyed by whatever names a tar (at most :data:`STREAMS`)."""

    def __init__(self) -> None:
        self._streams: OrderedDict[object, list[Stream]] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()

    def read(self, key: object, offset: int, stop: int, pieces: Callable[[], Iterator[bytes]]) -> bytes | None:
        """Bytes ``[offset, stop)`` of tar ``key`` from a pass that serves them, a new pass
        begun for a request at offset 0 (``pieces`` makes its pieces); None if no pass serves
        them (read them another way)."""
        with self._lock:
            found = [s for s in self._streams.get(key, ()) if s.serves(offset)]
            if found:
                self._streams.move_to_end(key)
            elif offset == 0:
                found = [Stream(pieces())]
                self._streams.setdefault(key, []).append(found[0])
                self._streams.move_to_end(key)
                self._count += 1
                while self._count > STREAMS:
                    oldest_key, oldest = next(iter(self._streams.items()))
                    oldest.pop(0)
                    self._count -= 1
                    if not oldest:
                        del self._streams[oldest_key]
            else:
                return None
        stream = found[0]
        with stream.lock:
            return stream.read(offset, stop)

    def forget(self, key: object) -> None:
        """Drop the passes of tar ``key`` (its layout was let go of)."""
        with self._lock:
            self._count -= len(self._streams.pop(key, ()))
