"""Running requests to a store: retries with backoff, one deadline, and the store's health.

Every request runs on fsspec's event loop thread under ``asyncio.wait_for``, so a
request that hangs (a network that drops packets silently) is abandoned at its
attempt's timeout, never waited on forever. A request that times out, is refused,
reset, throttled (429, SlowDown) or answered with a 5xx (:func:`.errors.is_transient`)
is tried again with exponential backoff and jitter until its deadline; then it fails
with :class:`StorageUnavailableError`. The deadline is the store's
(:meth:`.health.StoreHealth.budget`): shorter while the store is down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import time
from typing import Any, Awaitable, Callable

from atlasfs.storage import StorageChangedError, StorageOptions, StorageUnavailableError
from atlasfs.storage.errors import describe_error, is_transient, permanent_error, precondition_failed
from atlasfs.storage.health import StoreHealth

log = logging.getLogger(__name__)

#: Backoff between attempts: starts here, doubles, never above the cap (then jittered).
BACKOFF_FIRST = 0.05
BACKOFF_CAP = 2.0


class RequestRunner:
    """Runs one store's requests on an event loop, retrying transient failures until the
    deadline. ``loop()`` gives the loop to run them on (fsspec's, made again after a
    fork). :attr:`retries` counts the attempts that failed and were retried;
    :attr:`health` is the store's up or down state, shared by all its requests."""

    def __init__(self, name: str, options: StorageOptions,
                 loop: Callable[[], asyncio.AbstractEventLoop]) -> None:
        self.options = options
        self.health = StoreHealth(name, options.deadline)
        self.retries = 0
        self._loop = loop

    def run(self, make: Callable[[], Awaitable[Any]], what: str,
            local: Callable[[], Awaitable[Any]] | None = None) -> Any:
        """Run request ``make()`` on the loop, retrying transient failures until
        its deadline (:attr:`health`); raise :class:`StorageUnavailableError` then.
        ``local()``, if given, is asked first: a result other than None is the answer."""
        future, until = self.start(make, what, local)
        return self.wait(future, what, until)

    def start(self, make: Callable[[], Awaitable[Any]], what: str,
              local: Callable[[], Awaitable[Any]] | None = None) -> tuple[concurrent.futures.Future[Any], float]:
        """Request ``make()`` (after ``local()``, see :meth:`run`) started on the loop
        with its deadline; the future and when it is due, for :meth:`wait`."""
        budget = self.health.budget()
        until = time.monotonic() + budget

        async def request() -> Any:
            if local is not None:  # a hit is no answer from the store: it stays down, or up
                found = await local()
                if found is not None:
                    return found
            refused = self.health.refuse_now(what)
            if refused is not None:
                raise refused
            return await self._retrying(make, what, until, budget)

        return asyncio.run_coroutine_threadsafe(request(), self._loop()), until

    def wait(self, future: concurrent.futures.Future[Any], what: str, until: float) -> Any:
        """The result of a request future, waiting until ``until`` (monotonic) at most.
        The retry loop keeps its own deadline; the margin here only guards against a
        loop that stopped answering."""
        try:
            return future.result(timeout=max(until - time.monotonic(), 0) + 1.0)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise StorageUnavailableError(
                f"{what}: the store did not answer within {self.options.deadline:g} s") from None

    async def _retrying(self, make: Callable[[], Awaitable[Any]], what: str, until: float,
                        budget: float) -> Any:
        attempt = 0
        last = ""
        while True:
            left = until - time.monotonic()
            if left <= 0:
                raise self.health.failed(what, budget, attempt, last or "timed out")
            step = min(self.options.attempt_timeout, left)
            try:
                result = await asyncio.wait_for(make(), step)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if precondition_failed(exc):
                    self.health.answered()
                    raise StorageChangedError(
                        f"{what}: changed in the store since it was listed (ETag differs); remount") from None
                if not is_transient(exc):
                    self.health.answered()
                    raise permanent_error(exc) from None
                # An attempt cut short by the deadline says less than the answer before it.
                if not (last and step < self.options.attempt_timeout
                        and isinstance(exc, (asyncio.TimeoutError, TimeoutError))):
                    last = describe_error(exc)
            else:
                self.health.answered()
                return result
            attempt += 1
            self.retries += 1
            left = until - time.monotonic()
            if left <= 0.01:
                raise self.health.failed(what, budget, attempt, last)
            # The last pause is cut short so that one more attempt fits before the deadline.
            pause = min(BACKOFF_CAP, BACKOFF_FIRST * 2 ** (attempt - 1), left / 2) * random.uniform(0.5, 1.0)
            log.debug("%s: %s; retrying in %.2f s", what, last, pause)
            await asyncio.sleep(pause)
