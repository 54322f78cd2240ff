"""The serving model: queueing and batching on top of the performance model, with one set of constants.

:mod:`.model` says how long one prefill, one decode step and one KV transfer take. This module says
what that means for a deployment under load, and it is the only place that does: the planner
(:mod:`disagg.planner.decide`), the configurator (:mod:`disagg.configurator.estimate`) and the simulator's sizing
(:func:`disagg.simulator.simulate.static_peak`) all call it, so they cannot disagree about the same layout.

* **Prompts are a distribution**, not a representative length: :class:`PromptMix` is a lognormal fitted
  to the mean and one percentile of the prompt lengths (what Prometheus' token histogram gives; with the
  p99 as well, the wider of the two fits, which a heavy or multi-tenant tail needs), read at
  :data:`MIX_POINTS` equally likely lengths. Heavy-tailed prompts give prefill service times a large
  variance; a single length gives none.
* **Prefill is an M/G/c queue**: the prefill replicas serve one queue (the router hands a prompt to a free
  worker); Poisson arrivals; service time = prefill of the uncached part of a prompt drawn from the mix.
  Waiting time: Erlang C for the probability of waiting, Allen-Cunneen's ``(1 + cv2) / 2`` for the
  service variance: ``P(W > t) = C exp(-t (c mu - lambda) 2 / (1 + cv2))`` (exact for M/M/c).
* **TTFT at the percentile** is the percentile of the *sum* wait + own prefill + own KV transfer over the
  prompt mix (the wait independent of the prompt's own length), not a sum of percentiles: a long prompt
  waits as long as a short one, and only the long ones pay their long prefill.
* **Decode**: a batch per replica at :data:`DECODE_MAX_UTILIZATION` of what the ITL target and the KV
  cache allow; requests in flight by Little's law, plus a Poisson margin at the percentile.
* **Utilisation caps**: no prefill queue is planned above :data:`PREFILL_MAX_UTILIZATION`, no decode
  batch above :data:`DECODE_MAX_UTILIZATION` of its limit.
* **TP communication** is in every step (:meth:`.model.PerfModel.tp_comm_time`); **KV transfer** is
  charged per rank (:func:`.parallel.kv_transfer_seconds`): each rank has its own link, the slowest
  rank's bytes over it plus a latency per read (prefill TP 2 -> decode TP 1: the decode rank reads both
  shards over its one link; TP 1 -> TP 2: the prefill rank's link sends both halves). A profile that measured the P/D path through the router replaces it
  with the measured **hand-off** (router hops, KV pull, the frontends between). It adds to TTFT and not to
  any prefill queue's utilisation. The simulator also queues it, one hand-off at a time per serving decode
  replica (a burst's prompts reach decode one after another: measured on a CPU pair, 2026-12-04); this
  module does not charge that queue's wait: at a planned rate per decode replica it is a few per cent
  busy (a KV transfer of milliseconds, a few requests per second), and a burst is outside the Poisson
  arrivals every queue here assumes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist

from .model import PerfModel

PREFILL_MAX_UTILIZATION = 0.9   # no prefill queue is planned fuller than this (model error, burstiness)
DECODE_MAX_UTILIZATION = 0.85   # no decode batch is planned above this share of its ITL / KV-memory limit
MIX_POINTS = 64                 # equally likely prompt lengths a PromptMix is read at
TAIL_PERCENTILE = 99.0          # the prompt-length quantile read beside the SLO's to fit the mix's tail
MAX_PROMPT_SIGMA = 2.0          # the widest lognormal fitted (a p99/median of ~100x): a guard on the fit


def z(percentile: float) -> float:
    """The standard normal quantile at ``percentile`` (clamped to [50, 99.99])."""
    return NormalDist().inv_cdf(min(max(percentile / 100.0, 0.5), 0.9999))


# ---------------------------------------------------------------- queueing

def erlang_c(servers: int, offered: float) -> float:
    """Probability that an arrival waits in an M/M/c queue with ``offered`` = rate x service (Erlang C)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    term, total = 1.0, 1.0           # a^k / k!, summed for k < c
    for k in range(1, servers):
        term *= offered / k
        total += term
    last = term * offered / servers / (1.0 - offered / servers)
    return last / (total + last)


def wait_tail(rate: float, service: float, cv2: float = 0.0, servers: int = 1) -> tuple[float, float]:
    """``(C, theta)`` with ``P(W > t) = C exp(-theta t)`` for an M/G/c queue (Allen-Cunneen); ``theta`` is
    0 when the queue is unstable (every arrival waits forever)."""
    if service <= 0 or rate <= 0:
        return 0.0, math.inf
    if rate * service >= servers:
        return 1.0, 0.0
    return erlang_c(servers, rate * service), (servers / service - rate) * 2.0 / (1.0 + max(cv2, 0.0))


def queue_wait(rate: float, service: float, percentile: float, cv2: float = 0.0, servers: int = 1) -> float:
    """Waiting time at ``percentile`` of an M/G/c queue (mean service ``service``, squared coefficient of
    variation ``cv2``; 0 for prompts of one length); inf when the queue is unstable."""
    c, theta = wait_tail(rate, service, cv2, servers)
    if theta == 0.0:
        return math.inf
    tail = 1.0 - percentile / 100.0
    return math.log(c / tail) / theta if c > tail else 0.0


# ---------------------------------------------------------------- prompt lengths

@dataclass(frozen=True)
class PromptMix:
    """Prompt lengths: a lognormal with this ``mean`` whose ``percentile`` quantile is ``at_percentile``
    (equal to the mean: every prompt that long); with ``tail`` (the :data:`TAIL_PERCENTILE` quantile),
    the wider of the two fits. A Pareto or multi-tenant mix has a tail one upper quantile does not show:
    issue 13's Pareto prompts (mean ~7k, p90 ~13k, p99 ~72k tokens) fitted at p90 give a prefill
    service-time cv^2 of 0.7 where the prompts' own is 7.1; fitted at p99, 7.7."""

    mean: float
    at_percentile: float
    percentile: float = 90.0
    tail: float | None = None

    @classmethod
    def fixed(cls, tokens: float) -> PromptMix:
        return cls(tokens, tokens)

    @property
    def sigma(self) -> float:
        """The lognormal's shape: from ln(q / mean) = z sigma - sigma^2 / 2 (its smaller root; a quantile
        at or below the mean, or a ratio no lognormal reaches, gives the nearest one that fits); the
        larger of the fits at ``percentile`` and, when given, at the tail."""
        fits = [_fit_sigma(self.mean, self.at_percentile, self.percentile)]
        if self.tail is not None:
            fits.append(_fit_sigma(self.mean, self.tail, TAIL_PERCENTILE))
        return max(fits)

    def lengths(self) -> tuple[float, ...]:
        """:data:`MIX_POINTS` equally likely prompt lengths (stratum midpoints of the distribution)."""
        return _lengths(round(self.mean, 6), round(self.sigma, 6))


def _fit_sigma(mean: float, quantile: float, percentile: float) -> float:
    if mean <= 0 or quantile <= mean:
        return 0.0
    zz = z(percentile)
    disc = zz * zz - 2.0 * math.log(quantile / mean)
    return min(zz - math.sqrt(disc) if disc > 0 else zz, MAX_PROMPT_SIGMA)


@lru_cache(maxsize=4096)
def _lengths(mean: float, sigma: float) -> tuple[float, ...]:
    if sigma <= 0:
        return (mean,)
    nd = NormalDist()
    mu = math.log(mean) - sigma * sigma / 2.0
    pts = [math.exp(mu + sigma * nd.inv_cdf((i + 0.5) / MIX_POINTS)) for i in range(MIX_POINTS)]
    scale = mean / (sum(pts) / len(pts))  # the strata's midpoints keep the mean exactly
    return tuple(p * scale for p in pts)


@dataclass(frozen=True)
class PrefillWork:
    """Per equally likely prompt of a mix: its prefill time alone and its KV transfer time; ``servers``: the
    prompts one replica prefills side by side (:attr:`.model.PerfModel.servers`: 1, or a data-parallel
    replica's ranks), so ``replicas`` replicas are ``replicas x servers`` servers of one queue."""

    service: tuple[float, ...]
    transfer: tuple[float, ...]
    servers: int = 1

    @property
    def mean(self) -> float:
        return sum(self.service) / len(self.service)

    @property
    def cv2(self) -> float:
        m = self.mean
        if m <= 0:
            return 0.0
        second = sum(s * s for s in self.service) / len(self.service)
        return max(second / (m * m) - 1.0, 0.0)


def kv_transfer_time(prefill: PerfModel, tokens: float, decode_tp: int | None = None) -> float:
    """Seconds from a prompt's prefill ending on a prefill replica to a decode replica of ``decode_tp``
    taking it: the KV cache over the link, or, where the prefill profile measured the P/D path through
    the router, that hand-off (:meth:`.model.PerfModel.handoff_time`). The planner, the configurator
    and the simulator all charge it here."""
    from .parallel import kv_transfer_seconds   # the per-rank charge between heterogeneous layouts

    wire = kv_transfer_seconds(prefill.shape, tokens, prefill.tp, decode_tp or prefill.tp, prefill.link,
                               data_parallel=prefill.data_parallel)
    measured = prefill.profile.handoff_base if prefill.profile is not None else None
    return wire if measured is None else max(measured, wire)


def prefill_work(model: PerfModel, mix: PromptMix, prefix_hit: float = 0.0,
                 decode_tp: int | None = None) -> PrefillWork:
    hit = min(max(prefix_hit, 0.0), 0.99)
    lengths = mix.lengths()
    return PrefillWork(tuple(model.ttft(n, n * hit) for n in lengths),
                       tuple(kv_transfer_time(model, n, decode_tp) for n in lengths), model.servers)


def prefill_ttft(work: PrefillWork, rate: float, replicas: int, percentile: float, first_step: float = 0.0) -> float:
    """TTFT at ``percentile`` with ``replicas`` prefill replicas sharing a queue fed ``rate`` prompts/s:
    the percentile of wait + own prefill + own KV transfer (+ ``first_step``, the decode step that
    emits the first token) over the prompt mix; inf when the queue is unstable."""
    tail = 1.0 - percentile / 100.0
    own = sorted(s + x + first_step for s, x in zip(work.service, work.transfer))
    c, theta = wait_tail(rate, work.mean, work.cv2, replicas * work.servers)
    if theta == 0.0:
        return math.inf
    n = len(own)

    def exceed(t: float) -> float:  # P(TTFT > t)
        total = 0.0
        for o in own:
            u = t - o
            total += 1.0 if u < 0 else (c * math.exp(-theta * u) if theta != math.inf else 0.0)
        return total / n

    lo, hi = own[0], own[-1] + (math.log(max(c, tail) / tail) / theta if theta != math.inf else 0.0)
    if exceed(lo) <= tail:
        return lo
    for _ in range(60):
        mid = (lo + hi) / 2.0
        if exceed(mid) > tail:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-6 * max(hi, 1e-3):
            break
    return hi


def least_prefill(work: PrefillWork, rate: float, ttft_target: float, percentile: float, limit: int,
                  first_step: float = 0.0, capacity_service: float | None = None) -> tuple[int, float]:
    """Fewest prefill replicas (up to ``limit``) whose TTFT at the percentile meets ``ttft_target`` and
    whose utilisation stays under :data:`PREFILL_MAX_UTILIZATION` (at ``capacity_service`` seconds a prompt
    when given and longer than the work's mean); ``limit`` when none does. With the TTFT they give."""
    service = max(work.mean, capacity_service or 0.0)
    lo = max(1, math.ceil(rate * service / PREFILL_MAX_UTILIZATION / work.servers - 1e-12)) if rate > 0 else 1
    n = min(lo, limit)
    while n < limit and prefill_ttft(work, rate, n, percentile, first_step) > ttft_target:
        n += 1
    return n, prefill_ttft(work, rate, n, percentile, first_step)


# ---------------------------------------------------------------- decode

def batch_at_percentile(batch: float, percentile: float, cap: float | None = None) -> float:
    """Requests in service at the percentile when ``batch`` is the mean (Poisson), never above ``cap``."""
    b = batch + z(percentile) * math.sqrt(max(batch, 0.0))
    return min(b, max(cap, batch)) if cap is not None else b


def decode_batch(model: PerfModel, input_mean: float, output_mean: float, itl_target: float) -> tuple[int, float]:
    """Planned requests per decode replica: :data:`DECODE_MAX_UTILIZATION` of the most whose ITL meets the
    target (at the mean context) and whose KV cache fits when every request reaches its full length; with
    the mean context."""
    ctx = input_mean + output_mean / 2.0
    by_itl = model.max_concurrency_for_itl(itl_target, ctx)
    by_memory = model.max_concurrency(input_mean + output_mean)
    return max(math.floor(min(by_itl, by_memory) * DECODE_MAX_UTILIZATION), 1), ctx


def decode_replicas(model: PerfModel, rate: float, input_mean: float, output_mean: float, itl_target: float,
                    percentile: float) -> int:
    """Least decode replicas for ``rate`` requests/s: in flight by Little's law at the planned batch's ITL
    (an upper bound on ITL, so monotone in rate), plus the percentile's Poisson margin."""
    batch, ctx = decode_batch(model, input_mean, output_mean, itl_target)
    in_flight = rate * output_mean * model.itl(batch, ctx)
    return max(1, math.ceil(batch_at_percentile(in_flight, percentile) / batch - 1e-9))


def decode_itl(model: PerfModel, rate: float, input_mean: float, output_mean: float, replicas: int) -> float:
    """Mean ITL with ``replicas`` decode replicas sharing the requests in flight (Little's law at its fixed
    point: in flight = rate x output tokens x ITL(in flight)); inf when the KV cache cannot hold them."""
    ctx = input_mean + output_mean / 2.0
    capacity = max(model.max_concurrency(input_mean + output_mean), 1)
    per_replica = 1.0
    for _ in range(20):
        nxt = max(rate * output_mean * model.itl(per_replica, ctx) / replicas, 1.0)
        if nxt > capacity:
            return math.inf
        if abs(nxt - per_replica) < 1e-3:
            break
        per_replica = nxt
    return model.itl(per_replica, ctx)
