"""The live worker set: who is there (a static list or discovery), whether each serves (probes), what
each holds (the prefix index, fed by the workers' KV events), and the context length learned from them.

It keeps :class:`~.pool.Pool` and the per-role :class:`~.index.PrefixIndex` current; the decision
(:mod:`.decision`) only reads them.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import zmq.asyncio

from disagg.api.names import ROLE_PREFILL

from .calls import Calls, WorkerError, read
from .config import MAX_ANSWER_BYTES, RouterConfig
from .events import Subscriber
from .index import PrefixIndex
from .pool import Pool, Worker

log = logging.getLogger("disagg.router")
# /health timeouts in a row before a worker that still accepts connections counts as unhealthy: under a
# burst of thousands of streams a busy (but serving) worker or router may answer a probe late, and taking
# every worker out at once turned that into 503s for everyone (bench/router_vs_vllm_router.py, 2,000 streams)
PROBE_TIMEOUTS_TO_UNHEALTHY = 3
T = TypeVar("T")


class PrefillLost(WorkerError):
    """The prefill worker holding a decode's KV was found unhealthy before the decode answered (its
    stream's first token, or a non-streaming request's whole answer)."""


class Fleet:
    """``departed`` is told of each worker that leaves discovery, so that what others keep per worker
    (the decision's counts) goes with it."""

    def __init__(self, config: RouterConfig, metrics, pool: Pool, index: dict[str, PrefixIndex], calls: Calls,
                 departed: Callable[[Worker], None] = lambda w: None, discovery=None) -> None:
        self.config = config
        self.metrics = metrics
        self.pool = pool
        self.index = index
        self.calls = calls
        self._departed = departed
        self._zmq: zmq.asyncio.Context | None = None
        self._subscribers: dict[str, Subscriber] = {}
        self._health_task: asyncio.Task | None = None
        self._discovery = discovery
        self._discovery_task: asyncio.Task | None = None
        # the context refused beyond: configured (the engine args), else learned from a worker
        self.max_model_len: int | None = config.max_model_len
        self.probe_timeouts: dict[str, int] = {}
        # per prefill worker, set when it is found unhealthy: decodes waiting for its KV give up on it
        self.prefill_lost: dict[str, asyncio.Event] = {}

    def start(self) -> None:
        """Subscribes to the workers' KV events and starts the probes and discovery (after :meth:`Calls.start`)."""
        self._zmq = zmq.asyncio.Context()
        for role, idx in self.index.items():
            self._subscribers[role] = Subscriber(self._zmq, idx, self.config.kv_events_topic,
                                                 self.metrics.kv_event_batches.inc, self.config.block_size,
                                                 self.metrics.kv_resynced)
            self.metrics.indexed_blocks.labels(role).set_function(idx.blocks)
        for w in self.pool.all():
            self._watch(w)
        self._health_task = asyncio.create_task(self._check_health())
        if self._discovery is not None:
            self._discovery_task = asyncio.create_task(self._discovery.run(self.update_workers))

    def update_workers(self, role: str, endpoints) -> None:
        """Replace a role's workers (discovery); departed workers leave the prefix index too."""
        added, removed = self.pool.set(role, endpoints)
        for w in added:
            self._watch(w)
        for w in removed:
            if role in self._subscribers:
                self._subscribers[role].unwatch(w.name)
            else:
                self.index[role].cleared(w.name)
            self._forget(w)
        if added or removed:
            log.info("%s workers: +%s -%s", role, [w.name for w in added], [w.name for w in removed])

    async def close(self) -> None:
        for task in (self._health_task, self._discovery_task):
            if task:
                task.cancel()
        for sub in self._subscribers.values():
            await sub.close()
        if self._zmq:
            self._zmq.term()

    def _forget(self, w: Worker) -> None:
        """Drops what the router kept for a worker that left discovery: with workers coming and going
        (rollouts, scaling, restarts under new pod IPs) it would otherwise grow for as long as the router
        runs, and /metrics would list every worker it ever knew."""
        self.probe_timeouts.pop(w.name, None)
        # a decode still waiting for this prefill's KV holds the event itself; no probe sets it any more,
        # so that decode ends at its first-token timeout, as it would have before the worker left
        self.prefill_lost.pop(w.name, None)
        try:
            self.metrics.active.remove(w.role, w.name)
        except KeyError:        # never watched
            pass
        self._departed(w)
        self.calls.forget(w)

    def _watch(self, w: Worker) -> None:
        self.metrics.active.labels(w.role, w.name).set_function(lambda: w.active)
        if w.kv_events and w.role in self._subscribers:   # subscribers exist once started
            self._subscribers[w.role].watch(w.name, w.kv_events, w.kv_replay)

    async def probe(self, w: Worker, timeout: float = 2) -> None:
        try:
            async with self.calls.session.get(f"{w.url}/health", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                w.healthy = r.status == 200
            self.probe_timeouts.pop(w.name, None)
        except asyncio.TimeoutError:        # slow, not refused: out only after several in a row
            n = self.probe_timeouts[w.name] = self.probe_timeouts.get(w.name, 0) + 1
            if n >= PROBE_TIMEOUTS_TO_UNHEALTHY:
                w.healthy = False
        except aiohttp.ClientError:         # refused or reset: out until /health answers
            w.healthy = False
        if not w.healthy and w.role == ROLE_PREFILL and w.name in self.prefill_lost:
            self.prefill_lost.pop(w.name).set()
        if w.healthy and self.max_model_len is None:
            await self._learn_context(w, timeout)

    async def _learn_context(self, w: Worker, timeout: float) -> None:
        """The context length vLLM derived (no --max-model-len in the engine args), from the model card
        a serving worker lists on /v1/models; until one answers, the workers refuse over-long prompts."""
        try:
            async with self.calls.session.get(f"{w.url}/v1/models",
                                              timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                raw = (await read(r, MAX_ANSWER_BYTES))[0] if r.status == 200 else b"{}"
            cards = json.loads(raw).get("data") or []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return
        for card in cards if isinstance(cards, list) else []:
            if not isinstance(card, dict) or card.get("id") != self.config.model:
                continue
            length = card.get("max_model_len")
            if isinstance(length, int) and length > 0:
                self.max_model_len = length
                log.info("context length %d learned from %s /v1/models", length, w.name)
                return

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(w) for w in self.pool.all()))
            for role in self.index:
                ws = self.pool.workers[role].values()
                self.metrics.workers.labels(role, "healthy").set(sum(w.healthy for w in ws))
                self.metrics.workers.labels(role, "unhealthy").set(sum(not w.healthy for w in ws))
            await asyncio.sleep(self.config.health_interval_s)

    async def unless_prefill_lost(self, work: Awaitable[T], kv_from: Worker | None) -> T:
        """``work`` (a decode request: its answer, or its stream's first token); for a decode that has to
        pull its KV from ``kv_from`` first, given up (:class:`PrefillLost`) once that prefill worker is
        found unhealthy (refused, or its probes timing out): ``work`` is cancelled, which closes the
        connection, and vLLM aborts a request whose client went away. vLLM fails a pull from a dead engine
        by itself (kv_load_failure_policy "fail"), but a pull from one that is alive and not answering
        (hung, or its node unreachable) waits, streamed or not."""
        if kv_from is None:
            return await work
        lost = self.prefill_lost.setdefault(kv_from.name, asyncio.Event())
        task, gone = asyncio.ensure_future(work), asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():
                task.cancel()
        if task.done() and not task.cancelled():
            return task.result()
        await asyncio.wait((task,))        # its connection closed before the request is tried elsewhere
        raise PrefillLost(f"the prefill worker {kv_from.name} failed while the decode waited for its KV")
