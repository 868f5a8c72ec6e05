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
#: Seconds a lead thread that went as far as asked waits for the next request before it ends.
IDLE = 1.0


class Stream:
    """One pass over a tar's pieces from its start, with a window of the pieces it made.

    One thread at a time makes pieces (the pass's maker): a request that finds its bytes
    not made yet makes them itself if no one is making, else waits for them; a thread of its
    own goes on :data:`LEAD` bytes past the furthest request. Making a piece holds no lock, so
    a request whose bytes are made is answered at once, between two pieces (a lock held
    while a piece is made would hold it up behind the whole lead: Python's locks are not fair)."""

    def __init__(self, pieces: Iterator[bytes]) -> None:
        self._pieces = pieces
        # The pieces made and where each starts, in order; those before _first are let go of
        # (dropped from the lists now and then: a request finds its first piece by bisection).
        self._at: list[int] = []
        self._kept: list[bytes] = []
        self._first = 0
        self._start = 0  # where the first kept piece starts
        self.end = 0  # where what the pass made so far ends
        self._cond = threading.Condition(threading.Lock())  # the lists, end, and the states below
        self._target = 0  # how far the pass is to go: the furthest request's end + LEAD
        self._making = False  # a thread is making pieces
        self._idle = False  # the maker is a lead thread waiting for a request to ask further
        self._waiting: list[int] = []  # where the requests waiting for pieces end
        self.failed = False
        self._done = False  # the last piece made
        self._dropped = False
        self._readers: list[int] = []  # where the requests under way start

    def serves(self, offset: int) -> bool:
        """Whether a request at ``offset`` is this pass's to serve."""
        return not self.failed and self._start <= offset <= self.end + AHEAD

    def read(self, offset: int, stop: int) -> list[bytes] | None:
        """Bytes ``[offset, stop)`` of the tar in pieces, the pass going on as far as ``stop``; None if
        the request is not this pass's. An error of the pass (a block that fails) marks it
        failed and is raised no further: None."""
        with self._cond:
            if not self.serves(offset):
                return None
            if stop + LEAD > self._target:
                self._target = stop + LEAD
                if self._idle:  # the lead goes on
                    self._cond.notify_all()
            self._readers.append(offset)  # its pieces kept until it has them, however far the pass goes
            # its bytes made, the pass short of the target and no one making: a lead goes on
            lead = self.end >= stop and self.end < self._target and not self._making and not self._over()
            if lead:
                self._making = True
        if lead:
            self._lead()
        try:
            with self._cond:
                while self.end < stop and not self._over():
                    if not self._making:  # no one making: this thread makes them
                        self._making = True
                        break
                    self._waiting.append(stop)
                    try:
                        self._cond.wait(1.0)  # (woken once its pieces are made: the time only guards against a bug)
                    finally:
                        self._waiting.remove(stop)
                else:
                    return self._parts(offset, stop)
            self._make(stop)
            with self._cond:
                return self._parts(offset, stop)
        finally:
            with self._cond:
                self._readers.remove(offset)

    def _over(self) -> bool:
        """Whether the pass makes no more pieces: made its last, failed, or dropped (lock held)."""
        return self.failed or self._done or self._dropped

    def _parts(self, offset: int, stop: int) -> list[bytes] | None:
        """The kept pieces over ``[offset, stop)`` (lock held), None unless all made and kept (the
        pass failed or was dropped first, or went too far past them)."""
        if offset < self._start or (self.end < stop and not self._done):
            return None
        at, kept = self._at, self._kept
        i = bisect.bisect_right(at, offset, self._first) - 1
        parts = []
        while i < len(kept) and at[i] < stop:
            piece = kept[i]
            start, end = max(offset - at[i], 0), stop - at[i]
            parts.append(piece if start == 0 and end >= len(piece) else piece[start:end])
            i += 1
        return parts

    def _make(self, limit: int | None) -> None:
        """Make pieces as far as ``limit``, this thread being the maker, then hand the making to a
        lead thread if the target is further, else let it go; None: this is the lead thread, which
        goes on as far as the target (raised by requests meanwhile) and waits up to
        :data:`IDLE` seconds for a request to raise it before it ends. An error of the tree marks
        the pass failed (the random read says what fails, for the ranges over it)."""
        lead = False
        try:
            while True:
                with self._cond:
                    if limit is None:
                        while not self._over() and self.end >= self._target:
                            self._idle = True
                            if not self._cond.wait(IDLE) and self.end >= self._target:
                                return
                        self._idle = False
                    if self._over():
                        return
                    if limit is not None and self.end >= limit:
                        lead = self.end < self._target
                        return
                try:
                    piece = next(self._pieces, None)
                except Exception:  # noqa: BLE001
                    piece = False
                with self._cond:
                    if piece is False:
                        self.failed = True
                    elif piece is None:
                        self._done = True
                    elif piece:
                        self._at.append(self.end)
                        self._kept.append(piece)
                        self.end += len(piece)
                        self._trim()
                    if self._waiting and (self._over() or min(self._waiting) <= self.end):
                        self._cond.notify_all()
        finally:
            if lead:  # made while the reader takes what was served (kernel, copy, reader): the
                self._lead()  # next request finds its bytes made
            else:
                with self._cond:
                    self._making = self._idle = False
                    self._cond.notify_all()

    def _lead(self) -> None:
        """Hand the making (this thread is the maker) to a thread of its own, which goes on as
        far as the target; if no thread can be started, let the making go (a request makes)."""
        try:
            threading.Thread(target=self._make, args=(None,), name="atlasfs-tar-lead", daemon=True).start()
        except RuntimeError:
            with self._cond:
                self._making = False
                self._cond.notify_all()

    def _trim(self) -> None:
        """Let go of the pieces that end more than WINDOW before what the pass made and before
        every request under way (lock held)."""
        at, kept, first = self._at, self._kept, self._first
        keep = min(self.end - WINDOW, *self._readers) if self._readers else self.end - WINDOW
        while first < len(kept) and at[first] + len(kept[first]) < keep:
            kept[first] = b""
            first += 1
        if first > 1024 and first * 2 > len(kept):
            del at[:first], kept[:first]
            first = 0
        self._first = first
        self._start = at[first] if first < len(kept) else self.end

    def drop(self) -> None:
        """Stop the pass (dropped from its :class:`Streams`): its maker stops after the piece under way."""
        with self._cond:
            self._dropped = True
            self._cond.notify_all()


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
        dropped = []
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
                    dropped.append(oldest.pop(0))
                    self._count -= 1
                    if not oldest:
                        del self._streams[oldest_key]
            else:
                return None
        for stream in dropped:
            stream.drop()
        return found[0].read(offset, stop)

    def forget(self, key: object) -> None:
        """Drop the passes of tar ``key`` (its layout was let go of)."""
        with self._lock:
            dropped = self._streams.pop(key, [])
            self._count -= len(dropped)
        for stream in dropped:
            stream.drop()
