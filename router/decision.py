"""The routing decision: which decode and which prefill serve a request's token ids.

Pure: it reads the workers (:mod:`.pool`: health, load, KV revision) and the prefix index (:mod:`.index`)
and answers, with no HTTP and no event loop, so that a caller which only picks endpoints (an endpoint
picker in front of the workers) decides exactly as the router does. Carrying the request out is
:mod:`.handoff`'s.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from disagg.api import metrics as m
from disagg.api.names import ROLE_DECODE, ROLE_PREFILL
from disagg.api.v1alpha1 import Disaggregation

from . import adapters as lora
from . import pairing, policies
from .config import RouterConfig
from .errors import NoWorkers
from .index import PrefixIndex, block_keys
from .pool import Hold, Pool, Worker

# A request's prefix counts as held by the worker it was sent to from the decision on, not only once that
# worker's KV events arrive (after its prefill): a session's next turn, sent while the last is still being
# prefilled, then follows it instead of going wherever the load says (the Gateway API Inference
# Extension's reference picker routes on its own decisions alone; bench/picker_vs_reference_epp.py). The
# predictions expire after a TTL (the real events have long replaced them by then), and at most
# MAX_PREDICTED_BLOCKS are kept (the oldest go first). RouterConfig.prefix_prediction_s sets the TTL (0: off). A predicted prefix counts as cached (Plan.cached_tokens,
# and conditional disaggregation's uncached length): by the time the engine schedules the later request,
# the earlier one has computed those blocks into its prefix cache, or is computing them.
MAX_PREDICTED_BLOCKS = 1_000_000
# A worker counts an adapter as active (in its batch: lora_affinity's 1.0) for this long after the router last
# sent it a request of that adapter: the router's own decisions, joined with what the engine last reported in
# vllm:lora_requests_info (Worker.lora_running/lora_waiting, read every adapter sync, a probe interval apart),
# which alone would miss a request routed since; a busy adapter is re-sent within it.
ADAPTER_ACTIVE_S = 10.0


@dataclass
class Plan:
    decode: Worker
    prefill: Worker | None
    prompt_tokens: int
    cached_tokens: int
    # why: m.REASON_REMOTE with a prefill, else why the decode prefills itself (m.LOCAL_*)
    reason: str = m.REASON_REMOTE
    adapter: str | None = None      # the LoRA adapter both legs run (None: the base model)


@dataclass
class Route:
    """Which way a request went, returned to the client as ``x-disagg-*`` headers so that a
    fallback is never silent: path (remote_prefill, local_prefill, fallback), the workers, and
    the fallback reason."""
    path: str
    decode: str
    prefill: str | None = None
    fallback: str | None = None
    revision: str | None = None     # the workers' KV revision (prefill and decode share it: pairing.py)
    local_reason: str | None = None  # why the decode prefilled, on a local_prefill route (Plan.reason)
    # the request's trace (tracing.Trace) when tracing is on: every part handling the request opens its
    # spans under it; None (tracing off): no tracer work anywhere
    trace: Any = field(default=None, repr=False, compare=False)
    kv_hold: Hold | None = None      # the KV its prefill holds for its decode, on a flex prefill (Fleet.hold)
    adapter: str | None = None       # the LoRA adapter both legs ran (Plan.adapter)

    def headers(self) -> dict[str, str]:
        h = {"x-disagg-path": self.path, "x-disagg-decode": self.decode}
        if self.prefill:
            h["x-disagg-prefill"] = self.prefill
        if self.fallback:
            h["x-disagg-fallback"] = self.fallback
        if self.local_reason and self.path == m.PATH_LOCAL_PREFILL:
            h["x-disagg-local-reason"] = self.local_reason
        if self.revision:
            h["x-disagg-revision"] = self.revision
        if self.trace is not None:
            h.update(self.trace.response_headers())
        if self.adapter:
            h["x-disagg-adapter"] = self.adapter
        return h


class Decider:
    """Plans requests over ``pool`` and ``index`` (one :class:`~.index.PrefixIndex` per role), both shared
    with whoever keeps them current, and counts its decisions in ``metrics``."""

    def __init__(self, config: RouterConfig, pool: Pool, index: dict[str, PrefixIndex], metrics) -> None:
        self.config = config
        self.pool = pool
        self.index = index
        self.metrics = metrics
        spec = config.spec
        self.policy = policies.create(spec.policy, spec)
        # made once, not per request (the one-stream profile: label lookups and timeout objects add up)
        self._routing_seconds = {role: metrics.routing_seconds.labels(spec.policy, role)
                                 for role in (ROLE_PREFILL, ROLE_DECODE)}
        self._decisions: dict[tuple[str, str], object] = {}
        # token ids before the first token only where routing uses them (prefix overlap, conditional
        # disaggregation's uncached length, a prefill's pick by overlap); round-robin or least-loaded
        # with disaggregation never skips tokenizing (a sixth of the router's CPU before the first token):
        # the worker refuses an over-long prompt or a bad one itself, and a migration tokenizes then
        self.needs_ids = not (spec.policy in ("round-robin", "least-loaded")
                              and spec.disaggregation == Disaggregation.NEVER)
        self.kv_aware = spec.policy == "kv-aware"
        self.prediction_ttl_s = config.prefix_prediction_s
        self.predicted = {role: PrefixIndex() for role in (ROLE_PREFILL, ROLE_DECODE)}
        self._predictions: deque[tuple[float, str, str, list[int]]] = deque()   # (expiry, role, worker, keys)
        self._predicted_blocks = 0
        # (role, worker) -> adapter -> until when it counts as active there (ADAPTER_ACTIVE_S)
        self._adapter_active: dict[tuple[str, str], dict[str, float]] = {}

    def active_adapters(self, w: Worker, now: float | None = None) -> set[str]:
        """The adapters the router sent ``w`` requests of within ADAPTER_ACTIVE_S."""
        recent = self._adapter_active.get((w.role, w.name))
        if not recent:
            return set()
        now = time.monotonic() if now is None else now
        for name in [n for n, until in recent.items() if until <= now]:
            del recent[name]
        return set(recent)

    def with_adapter(self, adapter: str | None, workers: list[Worker]) -> list[Worker]:
        """Of ``workers``, those that can run ``adapter``: holding it, and of those the best lora_affinity
        tier (adapter active there, then a free slot, then queued, then full). Every worker for the base
        model."""
        if adapter is None:
            return workers
        holding = [w for w in workers if adapter in w.adapters]
        if not holding:
            return []
        now = time.monotonic()
        scores = {}
        for w in holding:
            active = self.active_adapters(w, now) | w.lora_running
            scores[w.name] = lora.lora_affinity(adapter, active, w.lora_waiting - active, self.config.max_loras)
        best = max(scores.values())
        return [w for w in holding if scores[w.name] == best]

    def pick(self, role: str, keys: list[int], exclude: set[str] = frozenset(),
             workers: list[Worker] | None = None, notes: dict | None = None,
             adapter: str | None = None) -> tuple[Worker, int]:
        """A worker of ``role`` (of ``workers`` when given, else any healthy one not in ``exclude``) that
        holds ``adapter`` (None: the base model). ``notes`` (a traced request's): gets ``notes[role] =
        (candidates as (name, active), overlap per worker in blocks, the policy's Decision)``."""
        if workers is None:
            workers = self.pool.healthy(role, exclude)
        if adapter is not None:
            workers = self.with_adapter(adapter, workers)
            if not workers:
                raise lora.AdapterNotReady(f"The adapter `{adapter}` is not loaded on any healthy {role} worker "
                                           "yet; retry later.")
        if not workers:
            raise NoWorkers(f"no healthy {role} workers are available")
        t0 = time.perf_counter()
        overlap: dict[str, int] = {}
        if self.kv_aware:
            overlap = self._with_predictions(role, keys, self.index[role].match(keys))
        d = self.policy.choose([policies.Candidate(w.name, w.active) for w in workers],
                               policies.Request(blocks=len(keys), overlap=overlap))
        if notes is not None:
            notes[role] = ([(w.name, w.active) for w in workers], overlap, d)
        if self.kv_aware and keys and self.prediction_ttl_s > 0:
            self._predict(role, d.worker, keys)
        self._routing_seconds[role].observe(time.perf_counter() - t0)
        if adapter is not None:
            self._adapter_active.setdefault((role, d.worker), {})[adapter] = time.monotonic() + ADAPTER_ACTIVE_S
        decisions = self._decisions.get((role, d.worker))
        if decisions is None:
            decisions = self._decisions[role, d.worker] = self.metrics.decisions.labels(
                self.config.spec.policy, role, d.worker)
        decisions.inc()
        if d.load_bounded:
            self.metrics.load_bounded.labels(role).inc()
        return self.pool.workers[role][d.worker], d.overlap_blocks

    def _with_predictions(self, role: str, keys: list[int], held: dict[str, int]) -> dict[str, int]:
        """``held`` (the KV events' overlap per worker), raised where a recent decision sent the same
        prefix to a worker whose events have not come yet."""
        now = time.monotonic()
        q = self._predictions
        while q and (q[0][0] <= now or self._predicted_blocks > MAX_PREDICTED_BLOCKS):
            _, r, worker, old = q.popleft()
            self.predicted[r].removed(worker, old)
            self._predicted_blocks -= len(old)
        if not q:
            return held
        guessed = self.predicted[role].match(keys)
        if not guessed:
            return held
        merged = dict(held)
        for worker, n in guessed.items():
            if n > merged.get(worker, 0):
                merged[worker] = n
        return merged

    def _predict(self, role: str, worker: str, keys: list[int]) -> None:
        self.predicted[role].add_keys(worker, keys)
        self._predictions.append((time.monotonic() + self.prediction_ttl_s, role, worker, keys))
        self._predicted_blocks += len(keys)

    def plan(self, token_ids: list[int], exclude: set[str] = frozenset(),
             revision: str | None | pairing.Unset = pairing.UNSET, notes: dict | None = None,
             adapter: str | None = None) -> Plan:
        """``notes``: see :meth:`pick` (both roles' when both are picked). ``adapter``: the LoRA adapter the
        request names (None: the base model). Its blocks are keyed under the adapter (the same tokens under
        another adapter are other KV), and both legs go to workers holding it: a decode without it is never
        chosen (none: AdapterNotReady, a 503), and where no prefill holds it the decode prefills itself, so a
        prefill and its decode never run different adapters (the decode's body names the same adapter, which
        vLLM refuses with a 404 rather than answer with the base model should the worker have dropped it
        since)."""
        keys = block_keys(token_ids, self.config.block_size, lora.root(adapter))
        bs = self.config.block_size
        # prefill and decode of one KV revision only: the newest complete one for a new request, the
        # request's own for one under way (pairing.py)
        pair = pairing.choose(self.pool, exclude, revision)
        decode, decode_overlap = self.pick(ROLE_DECODE, keys, exclude, pair.decodes, notes=notes, adapter=adapter)
        mode = self.config.spec.disaggregation
        prefills = self.with_adapter(adapter, pair.prefills)
        remote = bool(prefills) and mode != Disaggregation.NEVER
        if pair.refused and mode != Disaggregation.NEVER:
            self.metrics.pairing_refusals.labels(m.PAIRING_OTHER_REVISION).inc()
        reason = m.LOCAL_NEVER if mode == Disaggregation.NEVER else m.LOCAL_NO_PREFILL
        if remote and mode == Disaggregation.CONDITIONAL:
            uncached = len(token_ids) - decode_overlap * bs
            if uncached < self.config.spec.local_prefill_threshold_tokens:
                remote, reason = False, m.LOCAL_SHORT
            elif min(w.active for w in prefills) >= self.config.max_prefill_active:
                remote, reason = False, m.LOCAL_SATURATED
        if not remote:
            return Plan(decode, None, len(token_ids), min(decode_overlap * bs, len(token_ids)), reason,
                        adapter=adapter)
        prefill, overlap = self.pick(ROLE_PREFILL, keys, workers=prefills, notes=notes, adapter=adapter)
        return Plan(decode, prefill, len(token_ids), min(overlap * bs, len(token_ids)), adapter=adapter)

    def another_decode(self, failed: Worker, ids: list[int], tried: list[str],
                       adapter: str | None = None) -> Worker | None:
        """A decode to retry on after ``failed``: one not yet ``tried`` first, else any healthy one (one
        that still looks healthy may be tried again when there is no other); None when none is left.
        Of those holding ``adapter``, the request's."""
        keys = block_keys(ids, self.config.block_size, lora.root(adapter))
        for exclude in (set(tried), set()):
            try:
                # a decode of the request's own KV revision: its body was made for that model
                return self.pick(ROLE_DECODE, keys, workers=pairing.choose(
                    self.pool, exclude, failed.revision).decodes, adapter=adapter)[0]
            except NoWorkers:
                continue
        return None

    def forget(self, w: Worker) -> None:
        """Drops the decision counts and predicted prefixes of a worker that left, so /metrics stops
        listing it and no request follows it."""
        self.predicted[w.role].cleared(w.name)
        self._adapter_active.pop((w.role, w.name), None)
        try:
            self.metrics.decisions.remove(self.config.spec.policy, w.role, w.name)
        except KeyError:        # never chosen
            pass
        self._decisions.pop((w.role, w.name), None)
