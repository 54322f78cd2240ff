"""The live worker set: who is there (a static list or discovery), whether each serves (probes), what
each holds (the prefix index, fed by the workers' KV events), and the context length learned from them.

It keeps :class:`~.pool.Pool` and the per-role :class:`~.index.PrefixIndex` current; the decision
(:mod:`.decision`) only reads them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import aiohttp
import zmq.asyncio

from disagg.api import metrics as m
from disagg.api.names import ROLE_DECODE, ROLE_FLEX, ROLE_PREFILL

from . import adapters as lora
from .adapters import Declared, FileWatch
from .calls import Calls, WorkerError, read
from .config import MAX_ANSWER_BYTES, MAX_ERROR_BODY_BYTES, FlexEndpoint, RouterConfig
from .events import Subscriber
from .index import PrefixIndex
from .pool import Hold, Pool, Worker

log = logging.getLogger("disagg.router")
# /health timeouts in a row before a worker that still accepts connections counts as unhealthy: under a
# burst of thousands of streams a busy (but serving) worker or router may answer a probe late, and taking
# every worker out at once turned that into 503s for everyone (bench/router_vs_vllm_router.py, 2,000 streams)
PROBE_TIMEOUTS_TO_UNHEALTHY = 3
# how often an adapters file (RouterConfig.adapters_file) is checked for a change
ADAPTER_FILE_POLL_S = 1.0
# passes of one adapter sync while the declared adapters keep changing under it
MAX_SYNC_PASSES = 3
T = TypeVar("T")


class PrefillLost(WorkerError):
    """The prefill worker holding a decode's KV was found unhealthy before the decode answered (its
    stream's first token, or a non-streaming request's whole answer)."""


class Fleet:
    """``departed`` is told of each worker that leaves discovery, so that what others keep per worker
    (the decision's counts) goes with it."""

    def __init__(self, config: RouterConfig, metrics, pool: Pool, index: dict[str, PrefixIndex], calls: Calls,
                 departed: Callable[[Worker], None] = lambda w: None, discovery=None,
                 declared: Declared | None = None) -> None:
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
        # LoRA adapters (router/adapters.py): declared here, loaded onto each worker by sync_adapters
        self.declared = declared or Declared(config.model)
        self._adapter_locks: dict[str, asyncio.Lock] = {}
        self._adapter_tasks: set[asyncio.Task] = set()
        self._adapter_file = FileWatch(config.adapters_file) if config.adapters_file else None
        self._adapter_file_task: asyncio.Task | None = None
        # flex workers draining for a switch, by name (update_flex)
        self._switches: dict[str, asyncio.Task] = {}
        self._flex_file_task: asyncio.Task | None = None
        for role in self.index:
            for state in ("serving", "draining"):
                self.metrics.flex_workers.labels(role, state).set_function(
                    lambda role=role, draining=state == "draining": sum(
                        (w.switching_to is not None) == draining for w in self.pool.flex.values() if w.role == role))
        self.update_flex(config.flex)

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
            if hasattr(self._discovery, "on_adapters"):
                self._discovery.on_adapters = self.set_adapters
                self._discovery.adapter_status = self.adapter_status
            self._discovery_task = asyncio.create_task(self._discovery.run(self.update_workers))
        if self.config.flex_roles_file:
            self._flex_file_task = asyncio.create_task(self._follow_flex_roles_file())
        if self._adapter_file is not None:
            self._adapter_file_task = asyncio.create_task(self._watch_adapter_file())
        elif self.declared.paths:
            self._sync_all()

    def update_workers(self, role: str, endpoints) -> None:
        """Replace a role's workers (discovery); departed workers leave the prefix index too."""
        if role == ROLE_FLEX:
            return self.update_flex(endpoints)
        added, removed = self.pool.set(role, endpoints)
        for w in added:
            self._watch(w)
            if self._lora_on(w) and self._health_task is not None:   # its adapters now, not at its next probe
                self._spawn_sync(w)
        for w in removed:
            if role in self._subscribers:
                self._subscribers[role].unwatch(w.name)
            else:
                self.index[role].cleared(w.name)
            self._forget(w)
        if added or removed:
            log.info("%s workers: +%s -%s", role, [w.name for w in added], [w.name for w in removed])

    # ---- flex workers (spec.flex): one engine, either role, switched after a drain

    def update_flex(self, endpoints: list[FlexEndpoint]) -> None:
        """The flex workers now, each with the role it should serve. A new one serves its role at once; one
        whose role changed drains first (:meth:`_switch`); one asked back to the role it still serves before
        its drain ended keeps serving it (the switch is cancelled)."""
        wanted = {e.url.rstrip("/"): e for e in endpoints}
        for name in [n for n in self.pool.flex if n not in wanted]:
            w = self.pool.flex.pop(name)
            if name in self._switches:
                self._switches.pop(name).cancel()
            self.pool.workers[w.role].pop(name, None)
            self._unwatch(w)
            self._forget(w)
            log.info("flex worker %s left (%s)", name, w.role)
        for name, e in wanted.items():
            w = self.pool.flex.get(name)
            if w is None:
                for role, ws in self.pool.workers.items():   # listed as a dedicated worker until now
                    if name in ws:
                        gone = ws.pop(name)
                        self._unwatch(gone)
                        self._forget(gone)
                w = self.pool.flex[name] = Worker(name=name, role=e.role, url=name, kv_events=e.kv_events,
                                                  kv_replay=e.kv_replay, flex=True)
                self.pool.workers[e.role][name] = w
                self._watch(w)
                log.info("flex worker %s serves %s", name, e.role)
            w.revision, w.revision_generation = e.revision, e.revision_generation
            if w.switching_to is not None and e.role == w.role:
                self._switches.pop(name).cancel()
            elif e.role != w.role and w.switching_to is None:
                self._switches[name] = asyncio.create_task(self._switch(w, e.role))

    def _drain_left(self, w: Worker) -> float | None:
        """None once ``w`` has nothing of its old role left: no request in flight and no KV held for a
        decode; else how long until that may change by itself (a hold's lease running out), at most."""
        if w.active:
            return math.inf
        now = time.monotonic()
        w.holds = {h for h in w.holds if h.deadline is None or h.deadline > now}
        if not w.holds:
            return None
        if any(h.deadline is None for h in w.holds):
            return math.inf
        return min(h.deadline for h in w.holds) - now

    async def _switch(self, w: Worker, to: str) -> None:
        """Stop the old role's new work now (Pool.healthy leaves a switching worker out), wait until its
        requests ended and the KV it holds for decodes was pulled or its lease ran out, then serve ``to``.
        A drain past flex_drain_seconds is given up: the worker serves ``to`` anyway, counted and logged;
        nothing is cut by that (the engine serves both roles: its last requests finish, a decode still
        pulls its KV)."""
        frm, t0 = w.role, time.monotonic()
        w.switching_to, w.settled = to, asyncio.Event()
        outcome = m.SWITCH_SWITCHED
        log.info("flex worker %s: switching %s -> %s, draining (%d in flight, %d KV held)", w.name, frm, to,
                 w.active, len(w.holds))
        try:
            while (wait := self._drain_left(w)) is not None:
                left = t0 + self.config.flex_drain_seconds - time.monotonic()
                if left <= 0:
                    outcome = m.SWITCH_ABANDONED
                    log.warning("flex worker %s: drain for %s -> %s given up after %.0f s (%d in flight, %d KV "
                                "held): it serves %s now", w.name, frm, to, time.monotonic() - t0, w.active,
                                len(w.holds), to)
                    break
                w.settled.clear()
                try:
                    await asyncio.wait_for(w.settled.wait(), min(wait, left))
                except TimeoutError:
                    pass
        except asyncio.CancelledError:
            w.switching_to, w.settled = None, None
            self.metrics.role_switches.labels(frm, to, m.SWITCH_CANCELLED).inc()
            log.info("flex worker %s: switch %s -> %s cancelled, it serves %s", w.name, frm, to, frm)
            raise
        self._switches.pop(w.name, None)
        self._unwatch(w)
        self._departed(w)       # the decision's per-(role, worker) counts
        self.pool.workers[frm].pop(w.name, None)
        w.role, w.switching_to, w.settled = to, None, None
        self.pool.workers[to][w.name] = w
        self._watch(w)
        drained = time.monotonic() - t0
        self.metrics.role_switches.labels(frm, to, outcome).inc()
        self.metrics.switch_drain.labels(outcome).observe(drained)
        log.info("flex worker %s serves %s (drained %s in %.2f s)", w.name, to, frm, drained)

    def hold(self, w: Worker) -> Hold | None:
        """KV blocks ``w`` now holds for a decode (its prefill answered), on flex workers: their switch
        waits for these. Until a decode waits for them, they are freed by the lease alone."""
        if not w.flex:
            return None
        h = Hold(time.monotonic() + self.config.kv_lease_seconds)
        w.holds.add(h)
        return h

    def _released(self, w: Worker, h: Hold, pulled: bool) -> None:
        if pulled:
            w.holds.discard(h)
        else:       # the decode gave up waiting: NixlConnector frees the blocks when the lease runs out
            h.deadline = time.monotonic() + self.config.kv_lease_seconds
        if w.settled is not None:
            w.settled.set()

    async def _follow_flex_roles_file(self) -> None:
        """Local runs: the flex workers' roles from flex_roles_file ({url: role}), as a pod's serving-role
        label gives them in Kubernetes. An unreadable file keeps the roles as they are."""
        path, last = self.config.flex_roles_file, None
        while True:
            try:
                with open(path) as f:
                    roles = json.load(f)
            except (OSError, ValueError) as e:
                if last is not None:
                    log.warning("flex roles file %s unreadable (%s): roles kept", path, e)
            else:
                if roles != last:
                    last = roles
                    self.update_flex([e.model_copy(update={"role": roles.get(e.url, e.role)})
                                      for e in self.config.flex])
            await asyncio.sleep(self.config.health_interval_s)

    async def close(self) -> None:
        for task in (self._health_task, self._discovery_task, self._flex_file_task, self._adapter_file_task,
                     *self._switches.values(), *self._adapter_tasks):
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
        self._adapter_locks.pop(w.name, None)
        # a decode still waiting for this prefill's KV holds the event itself; no probe sets it any more,
        # so that decode ends at its first-token timeout, as it would have before the worker left
        self.prefill_lost.pop(w.name, None)
        try:
            self.metrics.active.remove(w.role, w.name)
        except KeyError:        # never watched
            pass
        self._departed(w)
        self.calls.forget(w)

    def _unwatch(self, w: Worker) -> None:
        """Takes ``w`` out of its role's KV event subscription and prefix index, and its role's gauges."""
        if w.role in self._subscribers:
            self._subscribers[w.role].unwatch(w.name)
        else:
            self.index[w.role].cleared(w.name)
        for gauge in (self.metrics.active, self.metrics.kv_held):
            try:
                gauge.remove(w.role, w.name)
            except KeyError:
                pass

    def _watch(self, w: Worker) -> None:
        self.metrics.active.labels(w.role, w.name).set_function(lambda: w.active)
        if w.flex:
            self.metrics.kv_held.labels(w.role, w.name).set_function(
                lambda: sum(h.deadline is None or h.deadline > time.monotonic() for h in w.holds))
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
        if w.healthy and self._lora_on(w):
            # beside the probes, not inside them: a slow adapter load must not hold up every worker's probe
            self._spawn_sync(w)

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

    # ---------------------------------------------------------------- LoRA adapters
    def set_adapters(self, sources: dict[str, str]) -> None:
        """The declared adapters (name -> source) replaced: one removed (or moved to another source) is no
        longer routed to at once, and every worker is brought in line now, not at its next probe."""
        changed, removed = self.declared.set(sources)
        if not changed and not removed:
            return
        log.info("adapters: +%s -%s", sorted(changed), sorted(removed))
        for w in self.pool.all():
            w.adapters -= changed | removed
        self._adapters_changed()
        self._sync_all()

    def _sync_all(self) -> None:
        for w in self.pool.all():
            if w.healthy:
                self._spawn_sync(w)

    def _spawn_sync(self, w: Worker) -> None:
        lock = self._adapter_locks.get(w.name)
        if lock is not None and lock.locked():      # one sync per worker at a time; the next probe retries
            return
        task = asyncio.create_task(self.sync_adapters(w))
        self._adapter_tasks.add(task)
        task.add_done_callback(self._adapter_tasks.discard)

    async def _watch_adapter_file(self) -> None:
        while True:
            sources = self._adapter_file.changed()
            if sources is not None:
                self.set_adapters(sources)
            await asyncio.sleep(ADAPTER_FILE_POLL_S)

    def _lora_on(self, w: Worker) -> bool:
        return bool(self.config.max_loras is not None or self.declared.paths or w.adapters)

    async def sync_adapters(self, w: Worker, timeout: float = 30) -> None:
        """Loads the declared adapters ``w`` lacks and unloads those it holds that are no longer declared (or
        from another source), then records what it holds: what its /v1/models lists, so a worker that
        restarted (and lost its adapters) is found out and reloaded. One sync per worker at a time."""
        if not self._lora_on(w):
            return
        lock = self._adapter_locks.setdefault(w.name, asyncio.Lock())
        if lock.locked():
            return
        async with lock:
            # again while the declared adapters changed during a pass (set_adapters skips a worker whose
            # sync is under way): a removal is carried out now, not at the next probe
            for _ in range(MAX_SYNC_PASSES):
                want = dict(self.declared.paths)
                if not await self._sync_once(w, want, timeout) or self.declared.paths == want:
                    break
            if self.declared.paths:
                await self._read_lora_requests(w, timeout)

    async def _read_lora_requests(self, w: Worker, timeout: float) -> None:
        """``w.lora_running`` and ``w.lora_waiting`` from its engine's /metrics (vLLM serves it on the API port,
        which the router reaches under the deployment's NetworkPolicy); both emptied when it does not answer
        or reports none, so a stale queue never keeps a worker in a lower tier."""
        running, waiting = set(), set()
        try:
            async with self.calls.session.get(f"{w.url}/metrics", timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status == 200:
                    now = lora.lora_requests((await read(r, MAX_ANSWER_BYTES))[0].decode(errors="replace"))
                    if now is not None:
                        running, waiting = now
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
            pass
        w.lora_running, w.lora_waiting = running, waiting

    async def _sync_once(self, w: Worker, want: dict[str, str], timeout: float) -> bool:
        """One pass of :meth:`sync_adapters` towards ``want``; False when the worker did not answer."""
        loaded = await self._loaded_adapters(w, timeout)
        if loaded is None:
            return False
        for name, path in list(loaded.items()):
            if want.get(name) != path:
                status, _ = await self._post(w, "/v1/unload_lora_adapter", {"lora_name": name}, timeout)
                if status in (200, 404):
                    loaded.pop(name)
                    self.metrics.adapter_loads.labels(m.ADAPTER_UNLOADED).inc()
        for name, path in want.items():
            if loaded.get(name) == path:
                continue
            status, message = await self._post(w, "/v1/load_lora_adapter",
                                               {"lora_name": name, "lora_path": path}, timeout)
            if status == 200:
                loaded[name] = path
                w.adapter_errors.pop(name, None)
                self.metrics.adapter_loads.labels(m.ADAPTER_LOADED).inc()
            else:
                w.adapter_errors[name] = message
                self.metrics.adapter_loads.labels(m.ADAPTER_LOAD_FAILED).inc()
                log.warning("adapter %s failed to load on %s: %s", name, w.name, message)
        now = self.declared.paths      # declared again: it may have changed while the calls were out
        held = {n for n, p in loaded.items() if now.get(n) == p}
        if held != w.adapters:
            log.info("%s holds adapters %s", w.name, sorted(held))
        w.adapters = held
        for name in list(w.adapter_errors):
            if name not in now:
                del w.adapter_errors[name]
        self._adapters_changed()
        return True

    async def _loaded_adapters(self, w: Worker, timeout: float) -> dict[str, str] | None:
        """The adapters ``w`` lists on /v1/models (vLLM's cards with a parent), name -> path; None when it
        does not answer."""
        try:
            async with self.calls.session.get(f"{w.url}/v1/models",
                                              timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                if r.status != 200:
                    return None
                cards = json.loads((await read(r, MAX_ANSWER_BYTES))[0]).get("data") or []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError):
            return None
        return {c["id"]: c.get("root") for c in cards if isinstance(c, dict) and c.get("parent")
                and c.get("id") != self.config.model}

    async def _post(self, w: Worker, path: str, body: dict, timeout: float) -> tuple[int, str]:
        try:
            async with self.calls.session.post(f"{w.url}{path}", json=body,
                                               timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                raw = (await read(r, MAX_ERROR_BODY_BYTES))[0]
                status = r.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            return 0, f"{path}: {e or type(e).__name__}"
        text = raw.decode(errors="replace")
        try:
            text = json.loads(text)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        return status, text

    def _adapters_changed(self) -> None:
        for name in self.declared.paths:
            for role in self.index:
                self.metrics.adapter_workers.labels(name, role).set(
                    sum(name in w.adapters for w in self.pool.workers[role].values()))

    def adapter_status(self) -> list[dict]:
        """Per declared adapter, the workers of each role holding it (status.adapters)."""
        out = []
        for name in sorted(self.declared.paths):
            counts = {role: sum(name in w.adapters and w.healthy for w in self.pool.workers[role].values())
                      for role in self.index}
            errors = sorted({f"{w.name}: {w.adapter_errors[name]}" for w in self.pool.all()
                             if name in w.adapter_errors})
            out.append({"name": name, **counts, "ready": counts.get(ROLE_DECODE, 0) > 0,
                        "message": "; ".join(errors)[:4096]})
        return out

    async def _check_health(self) -> None:
        while True:
            await asyncio.gather(*(self.probe(w) for w in self.pool.all()))
            for role in self.index:
                ws = self.pool.workers[role].values()
                self.metrics.workers.labels(role, "healthy").set(sum(w.healthy for w in ws))
                self.metrics.workers.labels(role, "unhealthy").set(sum(not w.healthy for w in ws))
            await asyncio.sleep(self.config.health_interval_s)

    async def unless_prefill_lost(self, work: Awaitable[T], kv_from: Worker | None, hold: Hold | None = None,
                                  pulled: Callable[[T], bool] = lambda out: True) -> T:
        """``work`` (a decode request: its answer, or its stream's first token); for a decode that has to
        pull its KV from ``kv_from`` first, given up (:class:`PrefillLost`) once that prefill worker is
        found unhealthy (refused, or its probes timing out): ``work`` is cancelled, which closes the
        connection, and vLLM aborts a request whose client went away. vLLM fails a pull from a dead engine
        by itself (kv_load_failure_policy "fail"), but a pull from one that is alive and not answering
        (hung, or its node unreachable) waits, streamed or not.

        ``hold`` (:meth:`hold`, a flex prefill's): the blocks count as held while ``work`` runs, as pulled
        once it returned what ``pulled`` accepts (a first token: the decode had them), and otherwise as
        freed by the lease from now (the decode gave up on them)."""
        if kv_from is None:
            return await work
        if hold is None:
            return await self._unless_lost(work, kv_from)
        hold.deadline = None        # the decode holds the request now: its heartbeats keep the blocks
        got = False
        try:
            out = await self._unless_lost(work, kv_from)
            got = pulled(out)
            return out
        finally:
            self._released(kv_from, hold, got)

    async def _unless_lost(self, work: Awaitable[T], kv_from: Worker) -> T:
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
