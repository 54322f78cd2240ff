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


# ---------------------------------------------------------------- LoRA adapters (router/adapters.py)

def _lora_decider(prefill, decode, max_loras=None) -> Decider:
    """``prefill``/``decode``: name -> the adapters that worker holds."""
    cfg = RouterConfig(model="tiny", tokenizer="unused", block_size=16, spec={"disaggregation": "always"},
                       prefill=[{"url": f"http://{n}:8000"} for n in prefill],
                       decode=[{"url": f"http://{n}:8000"} for n in decode], prefix_prediction_s=0,
                       max_loras=max_loras)
    d = Decider(cfg, Pool.static(cfg), {ROLE_PREFILL: PrefixIndex(), ROLE_DECODE: PrefixIndex()}, RouterMetrics())
    for role, held in ((ROLE_PREFILL, prefill), (ROLE_DECODE, decode)):
        for n, adapters in held.items():
            d.pool.workers[role][f"http://{n}:8000"].adapters = set(adapters)
    return d


def test_a_shared_prefix_under_two_adapters_is_indexed_apart():
    """vLLM's KV events carry the adapter (lora_name): the same tokens stored under sql and under chat (and
    under none) are three different prefixes, each matched only by requests of its own adapter."""
    import msgspec

    from disagg.router import adapters as lora
    from disagg.router.events import apply

    idx = PrefixIndex()
    toks = PROMPT[:32]

    def stored(hashes, adapter):
        return msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
                                              "token_ids": toks, "block_size": 16, "lora_id": None, "medium": "GPU",
                                              "lora_name": adapter}], 0])
    assert apply(idx, "http://w-sql:8000", stored([1, 2], "sql")) == 2
    assert apply(idx, "http://w-chat:8000", stored([3, 4], "chat")) == 2
    assert apply(idx, "http://w-base:8000", stored([5, 6], None)) == 2
    keys = {a: block_keys(toks, 16, lora.root(a)) for a in ("sql", "chat", None)}
    assert len({tuple(k) for k in keys.values()}) == 3
    assert idx.match(keys["sql"]) == {"http://w-sql:8000": 2}
    assert idx.match(keys["chat"]) == {"http://w-chat:8000": 2}
    assert idx.match(keys[None]) == {"http://w-base:8000": 2}
    # the decision keys a request the same way: the sql request follows the sql blocks, not the base ones
    d = _lora_decider({"p": {"sql"}}, {"d-base": {"sql"}, "d-sql": {"sql"}})
    d.index[ROLE_DECODE].add_keys("http://d-base:8000", keys[None])
    d.index[ROLE_DECODE].add_keys("http://d-sql:8000", keys["sql"])
    d.pool.workers[ROLE_DECODE]["http://d-sql:8000"].active = 1    # busier, and still the holder of its KV
    assert d.plan(toks, adapter="sql").decode.name == "http://d-sql:8000"
    assert d.plan(toks).decode.name == "http://d-base:8000"


def test_a_worker_without_the_adapter_is_never_chosen_when_one_with_it_is_ready():
    d = _lora_decider({"p-none": set(), "p-sql": {"sql"}}, {"d-none": set(), "d-sql": {"sql"}})
    # the workers without it hold the whole prompt and are idle; those with it are busy
    for role, name in ((ROLE_PREFILL, "p-none"), (ROLE_DECODE, "d-none")):
        d.index[role].add_keys(f"http://{name}:8000", block_keys(PROMPT, 16))
    for role, name in ((ROLE_PREFILL, "p-sql"), (ROLE_DECODE, "d-sql")):
        d.pool.workers[role][f"http://{name}:8000"].active = 50
    for _ in range(5):
        plan = d.plan(PROMPT, adapter="sql")
        assert (plan.prefill.name, plan.decode.name, plan.adapter) == ("http://p-sql:8000", "http://d-sql:8000", "sql")
    # a retry after the decode failed stays with the adapter: the only other decode lacks it
    assert d.another_decode(plan.decode, PROMPT, [plan.decode.name], "sql").name == "http://d-sql:8000"
    # the base model's requests still go anywhere
    assert d.plan(PROMPT).decode.name == "http://d-none:8000"


def test_a_prefill_and_its_decode_never_run_different_adapters():
    """No prefill holds the adapter: the decode that does prefills itself (local, no_prefill), never a prefill
    that would compute the KV with the base model."""
    d = _lora_decider({"p0": set(), "p1": {"chat"}}, {"d0": {"sql", "chat"}})
    plan = d.plan(PROMPT, adapter="sql")
    assert plan.prefill is None and plan.decode.name == "http://d0:8000" and plan.reason == m.LOCAL_NO_PREFILL
    plan = d.plan(PROMPT, adapter="chat")
    assert plan.prefill.name == "http://p1:8000" and "chat" in plan.prefill.adapters and "chat" in plan.decode.adapters


def test_an_adapter_no_decode_holds_is_a_503_not_the_base_model():
    from disagg.router.adapters import AdapterNotReady
    from disagg.router.errors import NoWorkers

    d = _lora_decider({"p0": {"sql"}}, {"d0": set(), "d1": {"chat"}})
    try:
        d.plan(PROMPT, adapter="sql")
    except AdapterNotReady as e:
        assert e.status == 503 and "`sql`" in str(e) and isinstance(e, NoWorkers)
    else:
        raise AssertionError("planned a request for an adapter no decode holds")
    d.pool.workers[ROLE_DECODE]["http://d1:8000"].adapters.add("sql")
    d.pool.workers[ROLE_DECODE]["http://d1:8000"].healthy = False     # held, but by an unhealthy worker only
    try:
        d.plan(PROMPT, adapter="sql")
    except AdapterNotReady:
        pass
    else:
        raise AssertionError("planned a request on an unhealthy worker")


def test_lora_affinity_scores_as_the_gateway_extension_does():
    from disagg.router.adapters import lora_affinity

    assert lora_affinity("a", {"a", "b"}, set(), 2) == 1.0          # in the batch now
    assert lora_affinity("a", {"b"}, set(), 2) == 0.8               # a free slot
    assert lora_affinity("a", {"b"}, {"a"}, 2) == 0.6               # queued for a slot
    assert lora_affinity("a", {"b", "c"}, set(), 2) == 0.0          # full
    assert lora_affinity("a", {"b", "c"}, set(), None) == 0.8       # no limit known


def test_the_decision_prefers_the_adapter_active_then_a_free_slot():
    """Every decode holds sql; d-active runs it now, d-free has a slot left, d-full's slots are taken by
    other adapters (max_loras 2): requests go to d-active, and without it to d-free, never to d-full."""
    d = _lora_decider({"p": {"sql", "x", "y"}}, {n: {"sql", "x", "y"} for n in ("d-active", "d-free", "d-full")},
                      max_loras=2)
    workers = d.pool.workers[ROLE_DECODE]
    # the router's own recent decisions say what runs where (decision.ADAPTER_ACTIVE_S)
    d.pick(ROLE_DECODE, [], workers=[workers["http://d-active:8000"]], adapter="sql")
    d.pick(ROLE_DECODE, [], workers=[workers["http://d-full:8000"]], adapter="x")
    d.pick(ROLE_DECODE, [], workers=[workers["http://d-full:8000"]], adapter="y")
    workers["http://d-active:8000"].active = 5           # the busiest, and still where sql runs
    for _ in range(3):
        assert d.plan(PROMPT, adapter="sql").decode.name == "http://d-active:8000"
    d.forget(workers["http://d-active:8000"])
    workers["http://d-active:8000"].healthy = False
    workers["http://d-full:8000"].active = 0
    workers["http://d-free:8000"].active = 3
    assert d.plan(PROMPT, adapter="sql").decode.name == "http://d-free:8000"


def test_the_engines_reported_queue_is_the_queued_tier():
    """vllm:lora_requests_info as vLLM writes it (one sample per label set it ever reported, each at the time it
    last reported it: the greatest is now) gives each worker's running and waiting adapters (read by the fleet
    at each adapter sync). With every slot taken (max_loras 2), a worker where sql waits for a slot (0.6) is
    chosen over one full of other adapters (0); one running sql (1.0), even if only the engine knows it (another
    router replica sent it), over both."""
    from disagg.router.adapters import lora_requests

    text = ('# HELP vllm:lora_requests_info Running stats on lora requests.\n'
            '# TYPE vllm:lora_requests_info gauge\n'
            'vllm:lora_requests_info{engine="0",max_lora="2",model_name="tiny",running_lora_adapters="sql",'
            'waiting_lora_adapters=""} 1.7649e+09\n'
            'vllm:lora_requests_info{engine="0",max_lora="2",model_name="tiny",running_lora_adapters="x,y",'
            'waiting_lora_adapters="sql"} 1.76491e+09\n'
            'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0\n')
    assert lora_requests(text) == ({"x", "y"}, {"sql"})
    assert lora_requests('vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n') is None   # LoRA off

    d = _lora_decider({"p": {"sql", "x", "y"}}, {n: {"sql", "x", "y"} for n in ("d-queued", "d-full", "d-run")},
                      max_loras=2)
    workers = d.pool.workers[ROLE_DECODE]
    workers["http://d-queued:8000"].lora_running, workers["http://d-queued:8000"].lora_waiting = lora_requests(text)
    workers["http://d-full:8000"].lora_running = {"x", "y"}
    workers["http://d-run:8000"].lora_running = {"sql", "x"}
    workers["http://d-run:8000"].active = 9                # the busiest, and still where sql runs
    assert d.plan(PROMPT, adapter="sql").decode.name == "http://d-run:8000"
    workers["http://d-run:8000"].healthy = False
    for _ in range(3):
        assert d.plan(PROMPT, adapter="sql").decode.name == "http://d-queued:8000"
