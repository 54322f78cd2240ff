"""Admission control: at most ``maxInFlight`` requests at once per router, then a short queue with a
timeout, then 429 with Retry-After. Without it an overloaded router queues without bound and every
client's latency grows together; with it the excess is refused early and the planner sees it
(queue depth and rejections are metrics)."""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from disagg.api import metrics as m

from .errors import Overloaded


class Admission:
    def __init__(self, limit: int, max_queued: int, queue_timeout_s: float, metrics) -> None:
        self.limit, self.max_queued, self.queue_timeout_s = limit, max_queued, queue_timeout_s
        self.metrics = metrics
        self.in_flight = 0
        self._waiters: deque[asyncio.Future] = deque()
        # a client told to come back when one queue wait would have run out, at least a second
        self.retry_after_s = max(1, math.ceil(queue_timeout_s))
        # read at scrape time: no metric call on the request path
        metrics.in_flight.set_function(lambda: self.in_flight)
        metrics.queued.set_function(lambda: len(self._waiters))

    async def enter(self) -> None:
        """A slot, or Overloaded; the caller gives it back with :meth:`leave` (a plain try/finally: no
        context-manager generator per request)."""
        if self.in_flight < self.limit and not self._waiters:
            self.in_flight += 1
            self.metrics.queue_wait.observe(0.0)
            return
        if len(self._waiters) >= self.max_queued or self.queue_timeout_s <= 0:
            self._reject(m.REJECT_QUEUE_FULL, "queue is full")
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        queued_at = time.monotonic()
        try:
            # leave() hands its slot over by resolving the future: in_flight already counts this request
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout_s)
            self.metrics.queue_wait.observe(time.monotonic() - queued_at)
        except TimeoutError:
            if fut.done() and not fut.cancelled():    # granted just as the wait ran out: keep the slot
                self.metrics.queue_wait.observe(time.monotonic() - queued_at)
                return
            fut.cancel()
            self._reject(m.REJECT_QUEUE_TIMEOUT, f"queue wait ran out ({self.queue_timeout_s:g} s)")
        except asyncio.CancelledError:                 # the client went away while queued
            if fut.done() and not fut.cancelled():
                self.leave()
            fut.cancel()
            raise
        finally:
            try:
                self._waiters.remove(fut)
            except ValueError:
                pass

    def leave(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)                   # the slot passes to the oldest waiter
                return
        self.in_flight -= 1

    def _reject(self, reason: str, why: str) -> None:
        self.metrics.rejected.labels(reason).inc()
        self.metrics.requests.labels(m.OUTCOME_REJECTED, "none").inc()
        raise Overloaded(f"The router is at its limit of {self.limit} requests in flight and its {why}; "
                         f"retry after {self.retry_after_s} s.", self.retry_after_s)
