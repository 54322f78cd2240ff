"""Conditional disaggregation: where a request prefills (no HTTP, no vLLM)."""

from __future__ import annotations

import pytest

from disagg.api.names import ROLE_DECODE, ROLE_PREFILL
from disagg.router.config import RouterConfig
from disagg.router.errors import NoWorkers
from disagg.router.index import block_keys
from disagg.router.metrics import RouterMetrics
from disagg.router.service import Router


def _router(mode: str = "conditional", threshold: int = 64, prefill: int = 1) -> Router:
    cfg = RouterConfig(model="tiny", tokenizer="unused", block_size=16, max_prefill_active=2,
                       spec={"disaggregation": mode, "localPrefillThresholdTokens": threshold},
                       prefill=[{"url": f"http://p{i}:8000"} for i in range(prefill)],
                       decode=[{"url": "http://d0:8000"}, {"url": "http://d1:8000"}])
    return Router(cfg, tokenizer=None, metrics=RouterMetrics())


PROMPT = list(range(100))      # 6 full blocks of 16


def test_long_uncached_prompt_prefills_remotely():
    plan = _router().plan(PROMPT)
    assert plan.prefill is not None and plan.prefill.role == ROLE_PREFILL and plan.decode.role == ROLE_DECODE
    assert plan.prompt_tokens == 100 and plan.cached_tokens == 0


def test_prompt_mostly_cached_on_decode_prefills_there():
    r = _router()
    r.index[ROLE_DECODE].add_keys("http://d1:8000", block_keys(PROMPT, 16)[:5])   # 80 of 100 tokens
    plan = r.plan(PROMPT)
    assert plan.prefill is None and plan.decode.name == "http://d1:8000" and plan.cached_tokens == 80


def test_short_prompt_and_saturated_prefill_stay_local():
    r = _router()
    assert r.plan(PROMPT[:40]).prefill is None
    r.pool.workers[ROLE_PREFILL]["http://p0:8000"].active = 2
    assert r.plan(PROMPT).prefill is None


def test_always_never_and_no_prefill_workers():
    assert _router("always").plan(PROMPT[:10]).prefill is not None
    assert _router("never").plan(PROMPT).prefill is None
    assert _router(prefill=0).plan(PROMPT).prefill is None
    r = _router()
    r.pool.workers[ROLE_PREFILL]["http://p0:8000"].healthy = False
    assert r.plan(PROMPT).prefill is None


def test_no_decode_workers_is_no_workers():
    r = _router()
    for w in r.pool.workers[ROLE_DECODE].values():
        w.healthy = False
    with pytest.raises(NoWorkers, match="no healthy decode workers"):
        r.plan(PROMPT)
