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

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator

#: Bytes of a pass kept behind what it made last, for requests served out of order.
WINDOW = 4 << 20
#: How far past what a pass made a request may start and still be served by it (the kernel's
#: read-ahead keeps a few requests in flight, answered by threads in any order).
AHEAD = 4 << 20
#: How far past a request a pass goes on by itself, on a thread, while the reader takes it in
#: (0: only as far as asked). Within WINDOW: what it makes ahead is kept for the next requests.
LEAD = 2 << 20
#: Passes kept at once, the least recently used dropped (at most WINDOW + a request each).
STREAMS = 4


class Stream:
    """One pass over a tar's pieces from its start, with a window of the pieces it made."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._pieces = pieces
        # The pieces made and where each starts, in order; those before _first are let go of
        # (dropped from the lists now and then: a request finds its first piece by bisection).
        self._at: list[int] = []
        self._kept: list[bytes] = []
        self._first = 0
        self._start = 0  # where the first kept piece starts
        self.end = 0  # where what the pass made so far ends
        self.lock = threading.Lock()
        self.failed = False
        self.leading = False  # a thread of lead() under way

    def serves(self, offset: int) -> bool:
        """Whether a request at ``offset`` is this pass's to serve."""
        return not self.failed and self._start <= offset <= self.end + AHEAD

    def read(self, offset: int, stop: int) -> list[bytes] | None:
        """Bytes ``[offset, stop)`` of the tar in pieces, the pass going on as far as ``stop``; None if
        the request is not this pass's (lock held by the caller). An error of the pass (a
        block that fails) marks it failed and is raised no further: None."""
        if not self.serves(offset):
            return None
        while self.end < stop:
            if not self._next():
                break
        if self.failed:
            return None
        at, kept = self._at, self._kept
        i = bisect.bisect_right(at, offset, self._first) - 1
        parts = []
        while i < len(kept) and at[i] < stop:
            piece = kept[i]
            start, end = max(offset - at[i], 0), stop - at[i]
            parts.append(piece if start == 0 and end >= len(piece) else piece[start:end])
            i += 1
        self._trim()
        return parts

    def _next(self) -> bool:
        """Make the pass's next piece (lock held): False at the tar's end or if the pass failed
        (an error of the tree: the random read says what fails, for the ranges over it)."""
        try:
            piece = next(self._pieces, None)
        except Exception:  # noqa: BLE001
            self.failed = True
            return False
        if piece is None:
            return False
        if piece:
            self._at.append(self.end)
            self._kept.append(piece)
            self.end += len(piece)
        return True

    def _trim(self) -> None:
        """Let go of the pieces that end more than WINDOW before what the pass made."""
        at, kept, first = self._at, self._kept, self._first
        while first < len(kept) and at[first] + len(kept[first]) < self.end - WINDOW:
            kept[first] = b""
            first += 1
        if first > 1024 and first * 2 > len(kept):
            del at[:first], kept[:first]
            first = 0
        self._first = first
        self._start = at[first] if first < len(kept) else self.end

    def lead(self, target: int) -> None:
        """Go on with the pass as far as ``target``, a piece at a time (requests go between):
        made on a thread of its own while the reader takes what was served (kernel, copy,
        reader), so that the next request finds its bytes made."""
        try:
            while not self.failed:
                with self.lock:
                    if self.end >= target or not self._next():
                        break
                    self._trim()
        finally:
            self.leading = False


class Streams:
    """The passes under way, keyed by whatever names a tar (at most :data:`STREAMS`)."""

    def __init__(self) -> None:
        self._streams: OrderedDict[object, list[Stream]] = OrderedDict()
        self._count = 0
        self._lock = threading.Lock()

    def read(self, key: object, offset: int, stop: int,
             pieces: Callable[[], Iterator[bytes]]) -> list[bytes] | None:
        """Bytes ``[offset, stop)`` of tar ``key`` in pieces from a pass that serves them, a new pass
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
            parts = stream.read(offset, stop)
            start_lead = parts is not None and LEAD > 0 and stream.end < stop + LEAD and not stream.leading
            if start_lead:
                stream.leading = True
        if start_lead:
            threading.Thread(target=stream.lead, args=(stop + LEAD,), name="atlasfs-tar-lead", daemon=True).start()
        return parts

    def forget(self, key: object) -> None:
        """Drop the passes of tar ``key`` (its layout was let go of)."""
        with self._lock:
            self._count -= len(self._streams.pop(key, ()))
