"""Read-ahead: work a sequential reader will ask for next, done on a background thread.

A reader that goes through a shard in order (``tar``, ``cp -r``, a training
loop) spends most of its time in FUSE round trips, during which the daemon's
CPU idles. Decoding and encoding the next blocks meanwhile, on one
background thread, takes that work off the reader's path: with two cores,
cold ``tar`` of small files through the mount got a fifth to a quarter
faster (docs/performance.md).

This module knows nothing of blocks: it runs ``load(key)`` for hinted keys,
oldest hint first, each key once while it is pending. Hints are only hints:
past ``max_pending`` the oldest are dropped, and a failing load is logged at
debug level and forgotten (the reader meets the same failure itself and
reports it). The thread exists only while there is work, so an idle mount
(or a program holding many trees) keeps no thread for it.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable

log = logging.getLogger("atlasfs")


class ReadAhead:
    """Runs ``load(key)`` for hinted keys on a background thread."""

    def __init__(self, load: Callable[[Hashable], None], max_pending: int = 8) -> None:
        self._load = load
        self._max_pending = max_pending
        self._pending: OrderedDict[Hashable, None] = OrderedDict()
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self.loaded = 0  # loads done, for tests and curiosity

    def hint(self, keys: Iterable[Hashable]) -> None:
        """Ask for ``keys`` to be loaded soon, in this order (keys already pending keep their place)."""
        with self._lock:
            for key in keys:
                self._pending[key] = None
            while len(self._pending) > self._max_pending:
                self._pending.popitem(last=False)
            if self._pending and self._worker is None:
                self._worker = threading.Thread(target=self._run, name="atlasfs-readahead", daemon=True)
                self._worker.start()

    def idle(self) -> bool:
        """True when nothing is pending or being loaded."""
        with self._lock:
            return self._worker is None

    def _run(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._worker = None
                    return
                key, _ = self._pending.popitem(last=False)
            try:
                self._load(key)
            except Exception as exc:  # the reader will meet it and report it
                log.debug("read-ahead of %r failed: %s", key, exc)
            self.loaded += 1
