"""Whether a store answers: what bounds the time a user's read takes while it does not.

One read a user makes is often several requests to the store: the kernel splits a
``read()`` into FUSE requests and asks again for a page whose read-ahead failed; a
lookup in a shard never opened reads its file table, a read of a file then its
block. If each of these waited a full deadline, a ``cat`` would wait several (it
waited four before this module). So a request that runs out its full deadline on
failures worth retrying (refused, reset, silent, 5xx) marks the store *down*, and
while it is down (a circuit breaker):

* for :data:`QUIET` seconds after any request found it not answering, requests fail
  at once, without asking it (the kernel's second try of the same page, the next
  files of a ``tar``);
* after that, a request asks it again, but with :data:`PROBE_DEADLINE` seconds,
  retries included, instead of the full deadline;
* any answer (data, or an answer such as "no such key") ends it at once;
* :data:`WINDOW` seconds after the full deadline that marked it down, a request gets
  the full deadline again (so that a store that is only slow, slower than the probe's
  bound, is not taken for down for good).

A user's read therefore ends within about one deadline (plus :data:`PROBE_DEADLINE`
if a probe lands in it), and reads work again within :data:`QUIET` seconds of the
store answering, without a remount. Nothing is remembered about the data.
"""

from __future__ import annotations

import logging
import threading
import time

from atlasfs.storage import StorageUnavailableError

log = logging.getLogger(__name__)

#: While the store is down, a request that asks it gets this many seconds (never more than the deadline).
PROBE_DEADLINE = 2.0
#: While the store is down, requests fail at once for this long after one found it not answering.
QUIET = 1.0
#: The down state ends this long (at least the deadline) after the full deadline that began it.
WINDOW = 30.0


class StoreHealth:
    """The up or down state of one store, shared by every request to it (thread-safe)."""

    def __init__(self, name: str, deadline: float) -> None:
        self.name = name
        self.deadline = deadline
        self._lock = threading.Lock()
        self._until = 0.0  # monotonic end of the down state; 0: up
        self._since = 0.0  # when the request that found it down began
        self._failed_at = 0.0  # the last request that asked it while down and got nothing
        self._last = ""  # the last failure, as messages say it
        #: Requests failed without asking the store (for tests and curiosity).
        self.failed_fast = 0

    def down(self) -> bool:
        return time.monotonic() < self._until

    def budget(self) -> float:
        """Seconds a request starting now may take, retries included."""
        return min(PROBE_DEADLINE, self.deadline) if self.down() else self.deadline

    def refuse_now(self, what: str) -> StorageUnavailableError | None:
        """The error to fail a request with at once, without asking the store; None: ask it."""
        now = time.monotonic()
        with self._lock:
            if not (now < self._until and now - self._failed_at < QUIET):
                return None
            self.failed_fast += 1
            return StorageUnavailableError(
                f"{what}: the store has not answered for {now - self._since:.0f} s (last: {self._last}); "
                f"reads fail at once for {QUIET:g} s after each try, then ask it again")

    def answered(self) -> None:
        """The store answered a request: it is up."""
        if self._until:
            with self._lock:
                was, self._until = self._until, 0.0
            if was:
                log.info("%s: the store answers again", self.name)

    def failed(self, what: str, budget: float, attempts: int, last: str) -> StorageUnavailableError:
        """A request ran out of ``budget`` seconds after ``attempts`` tries: the error it
        raises. A full deadline run out marks the store down; a probe's, while it is down,
        starts another quiet spell (it does not prolong the down state)."""
        now = time.monotonic()
        with self._lock:
            self._failed_at = now
            self._last = last
            if budget >= self.deadline:
                if now >= self._until:
                    self._since = now - budget
                self._until = now + max(WINDOW, self.deadline)
                return StorageUnavailableError(f"{what}: the store did not answer within {budget:g} s "
                                               f"({attempts} attempts, last: {last})")
            since = now - self._since
        return StorageUnavailableError(
            f"{what}: the store has not answered for {since:.0f} s (last: {last}); while it does not, "
            f"reads fail within {budget:g} s, not {self.deadline:g} s")
