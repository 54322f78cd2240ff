"""The routing decision alone (router/decision.py): a pool, a prefix index and a config in, a plan out;
no router, no HTTP, no vLLM, as an endpoint picker in front of the workers would use it."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import generate_latest

from disagg.api import metrics as m
from disagg.api.names import ROLE_DECODE, ROLE_PREFILL
from disagg.router.config import RouterConfig
from disagg.router.decision import Decider, Route
from disagg.router.index import PrefixIndex, block_keys
from disagg.router.metrics import RouterMetrics
from disagg.router.pool import Pool
from disagg.workers.local import metric_sum, parse_metrics

PROMPT = list(range(100))      # 6 full blocks of 16


def _decider(prefill, decode, prediction_s: float = 0, **spec) -> Decider:
    """``prefill``/``decode``: (url, revision, generation) each. ``prediction_s``: the prefix predictions'
    TTL (off unless a test is about them: the others plan many times over one index)."""
    def eps(ws):
        return [{"url": u, "revision": rev, "revision_generation": gen} for u, rev, gen in ws]
    cfg = RouterConfig(model="tiny", tokenizer="unused", block_size=16, spec={"disaggregation": "always", **spec},
                       prefill=eps(prefill), decode=eps(decode), prefix_prediction_s=prediction_s)
    return Decider(cfg, Pool.static(cfg), {ROLE_PREFILL: PrefixIndex(), ROLE_DECODE: PrefixIndex()}, RouterMetrics())


def _workers(*names, revision=None, generation=None):
    return [(f"http://{n}:8000", revision, generation) for n in names]


def test_the_decode_holding_the_prefix_is_picked_and_its_cached_tokens_counted():
    d = _decider(_workers("p0", "p1"), _workers("d0", "d1", "d2"))
    d.index[ROLE_DECODE].add_keys("http://d2:8000", block_keys(PROMPT, 16)[:4])     # 64 of 100 tokens
    d.index[ROLE_PREFILL].add_keys("http://p1:8000", block_keys(PROMPT, 16)[:2])    # 32
    for _ in range(5):          # not a round-robin's luck: every time
        plan = d.plan(PROMPT)
        assert plan.decode.name == "http://d2:8000" and plan.prefill.name == "http://p1:8000"
        assert (plan.prompt_tokens, plan.cached_tokens) == (100, 32)   # what the prefill worker will skip
    # a busy holder still wins over idle workers that hold nothing (no load bound reached at 1 active)
    d.pool.workers[ROLE_DECODE]["http://d2:8000"].active = 1
    assert d.plan(PROMPT).decode.name == "http://d2:8000"


def test_mixed_revisions_are_never_paired():
    d = _decider(_workers("p-old", revision="aaaa", generation=1) + _workers("p-new", revision="bbbb", generation=2),
                 _workers("d-old", revision="aaaa", generation=1) + _workers("d-new", revision="bbbb", generation=2))
    # the old revision's decode holds the whole prompt: the prefix does not pull a request across revisions
    d.index[ROLE_DECODE].add_keys("http://d-old:8000", block_keys(PROMPT, 16))
    plan = d.plan(PROMPT)
    assert (plan.prefill.name, plan.decode.name) == ("http://p-new:8000", "http://d-new:8000")
    # the new revision's decode goes: the old pair serves, never the new prefill with the old decode
    d.pool.workers[ROLE_DECODE]["http://d-new:8000"].healthy = False
    plan = d.plan(PROMPT)
    assert (plan.prefill.name, plan.decode.name) == ("http://p-old:8000", "http://d-old:8000")
    # and without the old prefill either: decode-only, counted as a refusal of the other revision's prefill
    d.pool.workers[ROLE_PREFILL]["http://p-old:8000"].healthy = False
    plan = d.plan(PROMPT)
    assert plan.prefill is None and plan.decode.name == "http://d-old:8000"
    text = generate_latest(d.metrics.registry).decode()
    assert metric_sum(parse_metrics(text), m.ROUTER_PAIRING_REFUSALS) == 1


def test_an_excluded_worker_is_skipped():
    d = _decider(_workers("p0"), _workers("d0", "d1"))
    d.index[ROLE_DECODE].add_keys("http://d0:8000", block_keys(PROMPT, 16))
    assert d.plan(PROMPT).decode.name == "http://d0:8000"
    assert d.plan(PROMPT, exclude={"http://d0:8000"}).decode.name == "http://d1:8000"


def test_a_retry_goes_to_an_untried_decode_of_the_failed_ones_revision():
    d = _decider(_workers("p0", revision="aaaa", generation=1),
                 _workers("d0", "d1", revision="aaaa", generation=1) + _workers("d9", revision="bbbb", generation=2))
    d0, d1 = (d.pool.workers[ROLE_DECODE][f"http://{n}:8000"] for n in ("d0", "d1"))
    d.index[ROLE_DECODE].add_keys(d0.name, block_keys(PROMPT, 16))     # the failed one holds the prefix
    assert d.another_decode(d0, PROMPT, [d0.name]) is d1
    # none untried of its revision: the tried ones again while they look healthy (d0 by its prefix), never
    # the other revision's untried d9
    assert d.another_decode(d0, PROMPT, [d0.name, d1.name]) is d0
    d0.healthy = d1.healthy = False
    assert d.another_decode(d0, PROMPT, [d0.name]) is None


def test_a_prefix_follows_the_worker_it_was_sent_to_before_that_workers_kv_events_arrive(monkeypatch):
    """A session's next turn, planned while the last is still prefilling (no KV event yet), goes where the
    last went, its prefix counted as cached there; predictions expire and leave with their worker."""
    from disagg.router import decision

    d = _decider(_workers("p0"), _workers("d0", "d1", "d2"), prediction_s=30)
    first = d.plan(PROMPT)
    for i in range(4):
        nxt = d.plan(PROMPT + [1000 + i] * 20)
        assert (nxt.decode, nxt.prefill) == (first.decode, first.prefill)
        assert nxt.cached_tokens == 96                    # the 6 full blocks the first one computes there
    clock = [decision.time.monotonic() + 31]
    monkeypatch.setattr(decision.time, "monotonic", lambda: clock[0])
    d.plan(list(range(500, 600)))                          # any decision expires the old predictions
    assert not d.predicted[ROLE_DECODE].match(block_keys(PROMPT, 16))
    d.plan(PROMPT)
    holder = d.pool.workers[ROLE_DECODE][d.plan(PROMPT).decode.name]
    d.forget(holder)
    assert holder.name not in d.predicted[ROLE_DECODE].match(block_keys(PROMPT, 16))


def test_conditional_disaggregation_keeps_a_cached_or_short_prompt_on_its_decode():
    d = _decider(_workers("p0"), _workers("d0", "d1"), disaggregation="conditional",
                 localPrefillThresholdTokens=64)
    assert d.plan(PROMPT).prefill is not None                   # 100 uncached tokens
    assert d.plan(PROMPT[:40]).prefill is None                  # short
    d.index[ROLE_DECODE].add_keys("http://d1:8000", block_keys(PROMPT, 16)[:5])
    plan = d.plan(PROMPT)                                       # 20 uncached on d1
    assert plan.prefill is None and plan.decode.name == "http://d1:8000" and plan.cached_tokens == 80


def test_a_departed_worker_leaves_the_decision_counts():
    d = _decider([], _workers("d0"))
    w = d.plan(PROMPT).decode
    labels = {"policy": "kv-aware", "role": ROLE_DECODE, "worker": w.name}
    assert d.metrics.registry.get_sample_value(m.ROUTER_ROUTING_DECISIONS, labels) == 1
    d.forget(w)
    assert d.metrics.registry.get_sample_value(m.ROUTER_ROUTING_DECISIONS, labels) is None


def test_ids_are_needed_unless_nothing_routes_by_them():
    assert _decider([], _workers("d0")).needs_ids
    assert not _decider([], _workers("d0"), policy="round-robin", disaggregation="never").needs_ids
    assert _decider([], _workers("d0"), policy="round-robin", disaggregation="conditional").needs_ids


def test_the_decision_loads_no_http_client():
    code = ("import sys, disagg.router.decision; "
            "print(sorted(m for m in ('aiohttp', 'zmq', 'disagg.router.upstream', 'disagg.router.calls') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_decision_says_why_the_decode_prefills_itself():
    """Plan.reason, what a picker reports and the x-disagg-local-reason header of a local_prefill route."""
    assert _decider(_workers("p0"), _workers("d0")).plan(PROMPT).reason == m.REASON_REMOTE
    assert _decider(_workers("p0"), _workers("d0"), disaggregation="never").plan(PROMPT).reason == m.LOCAL_NEVER
    assert _decider([], _workers("d0")).plan(PROMPT).reason == m.LOCAL_NO_PREFILL
    d = _decider(_workers("p0"), _workers("d0"), disaggregation="conditional", localPrefillThresholdTokens=64)
    assert d.plan(PROMPT[:40]).reason == m.LOCAL_SHORT
    assert d.plan(PROMPT).reason == m.REASON_REMOTE
    d.pool.workers[ROLE_PREFILL]["http://p0:8000"].active = d.config.max_prefill_active
    plan = d.plan(PROMPT)
    assert (plan.prefill, plan.reason) == (None, m.LOCAL_SATURATED)
    # the header, on a local route only: a remote or fallback route says its own why
    local = Route(m.PATH_LOCAL_PREFILL, "http://d0:8000", local_reason=m.LOCAL_SATURATED)
    assert local.headers()["x-disagg-local-reason"] == m.LOCAL_SATURATED
    moved = Route(m.PATH_FALLBACK, "http://d0:8000", "http://p0:8000", fallback="kv_transfer_failed",
                  local_reason=None)
    assert "x-disagg-local-reason" not in moved.headers()
