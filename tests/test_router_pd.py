"""A prefill and a decode vLLM (CPU build, tiny model) with real NIXL transfer, behind the router,
answering the official openai client; the reference is one aggregated vLLM server.

Then workers that die under a request, the same engines plus one more decode worker behind a second
router (every request P/D, probes every second, the prefill reached through a proxy that can kill or stop
it between its answer and the router's reading of it). These run last, in this order, each leaving what
the next needs (a live prefill until the last, at least one live decode):

- A decode worker killed (SIGKILL) mid-stream: the router continues the client's stream on the other decode
  worker from the token ids generated so far; at temperature 0 the client's text is the uninterrupted
  run's, its usage counts every token once, and the migration is counted. Made deterministic by counting
  where the router reads: a proxy in front of each decode worker relays its stream and, once armed, kills
  the worker after relaying KILL_AFTER token chunks and cuts the stream there (a trigger on the client's
  side raced the engine: without busy-polling NIXL threads slowing it, a decode finished its whole stream
  before the client had read KILL_AFTER tokens, and nothing was left to migrate).
- A prefill worker hung (SIGSTOP) right after it answered: the request completes with the same text and
  never hangs. Whether the decode's pull needs the stopped engine varies (seen: it waited, and the router
  gave it up when its probes found the prefill unhealthy, prefill_lost; and it went through); a decode
  that waits for ever is tests/test_router_migration.py's.
- A prefill worker killed right after it answered (its KV computed, not yet pulled by the decode), with
  other requests in flight on it and more sent after: vLLM fails the decode's KV load; that request
  completes by local prefill with the same text, counted; every other one completes too, and none later
  is served by the dead prefill.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from openai import OpenAI

from disagg.api import metrics as m
from disagg.e2e.testing import wait_for
from disagg.workers.local import (cpu_settings, free_port, metric_sum, router, scrape, stop_all, wait_metric,
                                  worker)

PROMPTS = ["def parse_args(argv): return the namespace of", "The quick brown fox jumps over the lazy dog " * 6]
CHATS = [[{"role": "user", "content": "Say hello to the parser."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Wrap this text " * 10}]]
MAX_TOKENS = 12
# How long the failure tests' setup waits for decode-b, started alone after the tests on the pair
# (`decode_b`): a start-up takes ~1 min on a quiet machine, 4-5 at a load average of 20-60 here. The
# first flex test, whose setup this is, has its own pytest limit (FIRST_FAILURE_TEST_TIMEOUT) so a
# slow start-up reaches this wait's message, with decode-b's log, rather than pytest's 600 s cut.
DECODE_B_WAIT_S = 1200
FIRST_FAILURE_TEST_TIMEOUT = DECODE_B_WAIT_S + 600


# LoRA on in every engine of this module (the reference, the pair, decode-b), so the adapter tests reuse
# them: its runtime loading needs the switch, and the base model's answers must not change with LoRA on
ADAPTER = "tiny-sql"
LORA_ARGS = ["--max-num-seqs", "64", "--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def _engine(name: str, settings, worker_python: str, logs: Path):
    """A worker (workers/local.py) with LoRA on and adapters loadable at run time."""
    p = worker(name, settings, worker_python, logs)
    p.env.update(LORA_ENV)
    return p


def _lora(role: str, tiny_model: str, cores: str, **kw):
    return cpu_settings(role, tiny_model, cores, engine_args=LORA_ARGS, **kw)


def _complete(client: OpenAI, prompt: str, model: str = "tiny") -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     seed=7).choices[0].text


def _chat(client: OpenAI, messages) -> str:
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0).choices[0].message.content


@pytest.fixture(scope="module")
def reference(tiny_model, tiny_adapter, worker_python, tmp_path_factory):
    """What one ordinary (aggregated, no NIXL) vLLM server answers, at temperature 0: with the base model,
    and with the tiny LoRA adapter (loaded the way the router loads it)."""
    logs = tmp_path_factory.mktemp("reference")
    agg = _engine("aggregated", _lora("decode", tiny_model, "0-1", kv_transfer=False), worker_python, logs)
    agg.start()
    try:
        agg.wait_ready()
        _started_once(agg)
        client = OpenAI(base_url=f"{agg.url}/v1", api_key="unused")
        answers = {"completions": [_complete(client, p) for p in PROMPTS], "chat": [_chat(client, c) for c in CHATS]}
        _post(agg.url, "/v1/load_lora_adapter", {"lora_name": ADAPTER, "lora_path": tiny_adapter})
        answers["adapter"] = [_complete(client, p, ADAPTER) for p in PROMPTS]
    finally:
        agg.stop()          # before the P/D workers start: two cores are all there is
    return answers


# decode-b's first KV pull from the (long-running) prefill, made before the failure tests, bounded
FIRST_PULL_S = 90


def _post(url: str, path: str, body: dict, timeout: float = 60) -> bytes:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _started_once(*procs) -> None:
    """Each engine started on its first try: LocalProcess restarts one whose start-up stalls (its net for
    `disagg serve --local`), which here would hide a return of the start-up starvation it was made for
    (workers/local.py), so a restart fails the test, with the stalled start's log."""
    for p in procs:
        if p.restarts:
            stalled = p.log_path.with_name(f"{p.name}.stalled-1.log")
            tail = "\n".join(stalled.read_text(errors="replace").splitlines()[-40:]) if stalled.exists() else ""
            pytest.fail(f"{p.name}'s start-up stalled and was restarted {p.restarts} time(s); the stalled "
                        f"start's log tail:\n{tail}")


def _first_pull(prefill_url: str, decode_url: str) -> None:
    """One P/D hand-off straight to the workers (the router's two hops): the prefill with
    do_remote_decode, then the decode with the kv_transfer_params it returned."""
    from disagg.router.service import REMOTE_DECODE

    def post(url: str, body: dict) -> dict:
        req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=FIRST_PULL_S) as r:
            return json.loads(r.read())
    body = {"model": "tiny", "prompt": "The first pull of a new decode worker " * 4, "max_tokens": 2,
            "temperature": 0}
    params = post(prefill_url, dict(body, max_tokens=1, kv_transfer_params=REMOTE_DECODE))["kv_transfer_params"]
    post(decode_url, dict(body, kv_transfer_params=params))


@pytest.fixture(scope="module")
def decode_b(pd, tiny_model, worker_python, tmp_path_factory):
    """A third engine (core 0), started as a flex worker (kv_role kv_both, spec.flex): the flex tests'
    router switches it between prefill and decode, then the failure tests' router uses it as a second
    decode worker. One engine for both: CI's time has no room for another engine's start-up. Started
    alone, once the tests on the pair have run (the first flex test asks for it), so its start-up competes
    with no other. (Engines that started beside others used to "hang" here: the idle engines' NIXL progress
    threads busy-polled a core each and starved the starting one, pinned to a busy core, of CPU; the
    engines' sitecustomize now gives that thread a poll timeout, tests/test_nixl_progress.py.)

    Then its first KV pull from the prefill, before any test: a new decode's first pull from a prefill
    that has served for minutes has stalled here for minutes (twice: a CI run's first failure test, and
    once in two local runs beside two busy loops; the prefill's and then the decode's worker process
    each blocked, the decode's until the prefill's process group was stopped and continued; pulls
    between engines that had made one went through). The cause found (2026-12-04): each worker had its
    own session, so its own scheduler autogroup, and decode-b's group, pinned to the prefill's core, went
    unscheduled while the prefill's NIXL progress thread ran (workers/local.py, LocalProcess.start: a
    process group now, not a session). The tests are about what the router does when workers die, not
    about that stall; should it return, the first pull fails the test with both engines' logs, and so
    does a start-up that LocalProcess had to restart (_started_once): neither is retried away."""
    logs = tmp_path_factory.mktemp("decode-b")
    p = _engine("decode-b", _lora("flex", tiny_model, "0"), worker_python, logs)
    try:
        p.start().wait_ready(DECODE_B_WAIT_S)
        _started_once(p)
        try:
            _first_pull(pd["prefill"].url, p.url)
        except OSError as e:               # a timeout, or the worker's own error
            pytest.fail(f"decode-b's first KV pull failed ({e!r}); decode-b's log tail:\n{p.tail(40)}\n"
                        f"--- prefill (log tail):\n{pd['prefill'].tail(40)}")
        yield p
    finally:
        p.stop()


@pytest.fixture(scope="module")
def pd(reference, tiny_model, worker_python, tmp_path_factory, jaeger):
    """prefill (core 0) + decode (core 1) + the router, disaggregating every request. Both engines export
    traces to Jaeger (spec.tracing's worker flags), ratio 0: only requests whose traceparent says sampled
    are traced, which this router (tracing off) never sends; a traced router's are
    (test_one_trace_holds_the_routers_spans_and_both_engines_llm_request_spans)."""
    logs = tmp_path_factory.mktemp("pd")
    tracing = dict(otlp_traces_endpoint=jaeger.otlp_endpoint, trace_sampling_ratio=0.0)
    prefill_s = _lora("prefill", tiny_model, "0", **tracing)
    decode_s = _lora("decode", tiny_model, "1", **tracing)
    port = free_port()
    # adapters come and go at run time: the router re-reads this file (the adapter tests write it)
    (logs / "adapters.json").write_text("{}")
    # no max_model_len: the router learns the workers' (1024, cpu_settings) from their /v1/models
    config = {"model": "tiny", "tokenizer": tiny_model, "block_size": prefill_s.block_size, "port": port,
              "host": "127.0.0.1", "health_interval_s": 60,
              # vLLM CPU workers sometimes stall for one NIXL lease (30 s) on a loaded 2-core machine; the
              # test checks the P/D path, so a slow prefill must not turn into a (correct) fallback
              "spec": {"disaggregation": "always", "prefillTimeoutSeconds": 120},
              "adapters_file": str(logs / "adapters.json"), "max_loras": 2,
              "prefill": [{"url": f"http://127.0.0.1:{prefill_s.port}",
                           "kv_events": f"tcp://127.0.0.1:{prefill_s.kv_events_port}"}],
              "decode": [{"url": f"http://127.0.0.1:{decode_s.port}",
                          "kv_events": f"tcp://127.0.0.1:{decode_s.kv_events_port}"}]}
    (logs / "router.json").write_text(json.dumps(config))
    procs = {"prefill": _engine("prefill", prefill_s, worker_python, logs),
             "decode": _engine("decode", decode_s, worker_python, logs),
             "router": router(logs / "router.json", port, logs)}
    try:
        for name in ("prefill", "decode"):
            procs[name].start()
        for name in ("prefill", "decode"):
            procs[name].wait_ready()
        _started_once(procs["prefill"], procs["decode"])
        procs["router"].start().wait_ready()
        yield procs
    finally:
        stop_all(list(procs.values()))


# its setup starts the engines (the reference, then the pair), each wait bounded by wait_ready's
# 300 s, so a slow start-up fails with that engine's log rather than pytest's 600 s cut
@pytest.mark.timeout(1200)
def test_openai_client_gets_the_aggregated_servers_text(pd, reference):
    client = OpenAI(base_url=f"{pd['router'].url}/v1", api_key="unused")
    assert [m_.id for m_ in client.models.list().data] == ["tiny"]
    assert [_complete(client, p) for p in PROMPTS] == reference["completions"]
    assert [_chat(client, c) for c in CHATS] == reference["chat"]
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert r.usage.completion_tokens == MAX_TOKENS and r.usage.prompt_tokens > 5


def test_the_router_refuses_by_the_context_the_workers_run_with(pd):
    """The router was given no context length: it refuses by the one vLLM runs with (learned from the
    workers' /v1/models), in its own words, before any worker sees the prompt."""
    import openai

    client = OpenAI(base_url=f"{pd['router'].url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="word " * 1500, max_tokens=4)
    assert "this model's context is 1024 tokens" in str(e.value)
    assert client.completions.create(model="tiny", prompt="word " * 100, max_tokens=4).choices[0].text is not None


def test_a_router_that_does_not_tokenize_passes_the_workers_refusal_on(pd, tmp_path):
    """Round-robin with disaggregation never: the router does not tokenize, so an over-long prompt reaches
    the decode worker, whose own 400 the client gets (OpenAI's shape, vLLM's words); a prompt that fits is
    served, and the router's prompt-token metrics are the worker's usage."""
    import openai

    first = json.loads(Path(pd["router"].argv[-1]).read_text())
    port = free_port()
    config = {"model": first["model"], "tokenizer": first["tokenizer"], "block_size": first["block_size"],
              "port": port, "host": "127.0.0.1", "health_interval_s": 60,
              "spec": {"disaggregation": "never", "policy": "round-robin"}, "decode": first["decode"]}
    (tmp_path / "router.json").write_text(json.dumps(config))
    r = router(tmp_path / "router.json", port, tmp_path)
    try:
        r.start().wait_ready()
        client = OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt="word " * 1500, max_tokens=4)
        assert "1024" in str(e.value)                     # the worker's message names its context length
        chunks = list(client.completions.create(model="tiny", prompt="word " * 100, max_tokens=4, stream=True,
                                                stream_options={"include_usage": True}))
        prompt_tokens = chunks[-1].usage.prompt_tokens
        s = scrape(r.url)
        assert s[m.ROUTER_PROMPT_TOKENS] == prompt_tokens > 100
        assert s[f"{m.ROUTER_INPUT_TOKENS}_count"] == 1
    finally:
        r.stop()


def test_streaming_gets_the_same_text_and_usage(pd, reference):
    client = OpenAI(base_url=f"{pd['router'].url}/v1", api_key="unused")
    for prompt, want in zip(PROMPTS, reference["completions"]):
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        assert chunks[-1].usage.completion_tokens == MAX_TOKENS
    for messages, want in zip(CHATS, reference["chat"]):
        chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True))
        assert all(c.usage is None for c in chunks)            # not asked for: the router's own usage is hidden
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_kv_blocks_moved_over_nixl_and_every_request_prefilled_remotely(pd):
    transfers = wait_metric(pd["decode"].url, m.VLLM_NIXL_BYTES_TRANSFERRED + "_count", len(PROMPTS) + len(CHATS))
    assert transfers >= len(PROMPTS) + len(CHATS)
    decode = scrape(pd["decode"].url)
    assert metric_sum(decode, m.VLLM_NIXL_BYTES_TRANSFERRED + "_sum") >= transfers * 1024
    assert metric_sum(decode, m.VLLM_NIXL_FAILED_TRANSFERS + "_total") == 0
    routed = scrape(pd["router"].url)
    assert routed[f'{m.ROUTER_REQUESTS}{{outcome="success",path="{m.PATH_REMOTE_PREFILL}"}}'] >= 8
    # every request the router served (refused ones, such as the over-long prompt, reach no worker)
    served = {k: v for k, v in routed.items() if f'outcome="{m.OUTCOME_CLIENT_ERROR}"' not in k}
    assert metric_sum(served, m.ROUTER_REQUESTS) == metric_sum(
        {k: v for k, v in served.items() if m.PATH_REMOTE_PREFILL in k}, m.ROUTER_REQUESTS)
    # the route is in the response headers, so a client can tell a fallback from a P/D request
    client = OpenAI(base_url=f"{pd['router'].url}/v1", api_key="unused")
    raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert raw.headers["x-disagg-path"] == m.PATH_REMOTE_PREFILL and "x-disagg-fallback" not in raw.headers
    assert (raw.headers["x-disagg-prefill"], raw.headers["x-disagg-decode"]) == (pd["prefill"].url, pd["decode"].url)
    # the prefill worker's KV events reached the router's index
    assert routed[f'{m.ROUTER_INDEXED_BLOCKS}{{role="prefill"}}'] > 0 or \
        metric_sum(routed, m.ROUTER_KV_EVENT_BATCHES) > 0


def test_one_trace_holds_the_routers_spans_and_both_engines_llm_request_spans(pd, jaeger, tmp_path):
    """A traced router over the pair: one streamed request is one trace in Jaeger holding the router's spans
    and vLLM's llm_request span of the prefill (service vllm-prefill, under the router's prefill span) and of
    the decode (vllm-decode, under its decode span), joined by the traceparent the router sent each. The
    router's spans up to the first token add up to the client's TTFT within 0.25 s, and vLLM's own time for
    the prefill fits inside the router's prefill span."""
    from disagg.e2e.jaeger import spans_by_name
    from disagg.router import tracing as t

    first = json.loads(Path(pd["router"].argv[-1]).read_text())
    port = free_port()
    config = {**first, "port": port, "tracing": {"otlpEndpoint": jaeger.otlp_endpoint, "samplingRatio": 1.0}}
    (tmp_path / "router.json").write_text(json.dumps(config))
    r = router(tmp_path / "router.json", port, tmp_path)
    try:
        r.start().wait_ready()
        req = urllib.request.Request(f"{r.url}/v1/completions", method="POST",
                                     headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                                                      "temperature": 0, "stream": True}).encode())
        t0 = time.monotonic()
        with urllib.request.urlopen(req, timeout=300) as resp:
            resp.read1()
            ttft = time.monotonic() - t0
            resp.read()
            headers = dict(resp.headers)
        assert headers["x-disagg-path"] == m.PATH_REMOTE_PREFILL
        trace_id = headers[t.TRACE_ID_HEADER]
        # the router and vLLM export in batches (the SDK's default: every 5 s); vLLM's span at the request's end
        trace = wait_for(lambda: (tr := jaeger.trace(trace_id)) and len(spans_by_name(tr).get("llm_request", [])) >= 2
                         and t.REQUEST in spans_by_name(tr) and tr, 120, f"trace {trace_id} with both engines' spans")
    finally:
        r.stop()
    by = spans_by_name(trace)
    llm = {s["service"]: s for s in by["llm_request"]}
    assert set(llm) == {"vllm-prefill", "vllm-decode"}, list(llm)
    assert llm["vllm-prefill"]["parent"] == by[t.PREFILL][0]["spanID"]
    assert llm["vllm-decode"]["parent"] == by[t.DECODE][0]["spanID"]
    root = by[t.REQUEST][0]
    assert all(s["parent"] == root["spanID"] for n in (t.ADMISSION, t.TOKENIZE, t.ROUTING, t.PREFILL, t.DECODE)
               for s in by[n])
    router_ttft = (by[t.FIRST_TOKEN][0]["startTime"] + by[t.FIRST_TOKEN][0]["duration"] - root["startTime"]) / 1e6
    assert 0 < router_ttft <= ttft + 0.01 and ttft - router_ttft < 0.25, (router_ttft, ttft)
    tags = {tag["key"]: tag["value"] for tag in llm["vllm-prefill"]["tags"]}
    # vLLM's queue + prefill of the prefill leg, inside the router's prefill span (seconds vs microseconds)
    engine = tags["gen_ai.latency.time_in_queue"] + tags["gen_ai.latency.time_in_model_prefill"]
    assert 0 < engine <= by[t.PREFILL][0]["duration"] / 1e6, (engine, by[t.PREFILL][0]["duration"])
    assert tags["gen_ai.usage.prompt_tokens"] > 20


# ---------------------------------------------------------------- LoRA adapters (router/adapters.py)
def _declare(pd, adapters: dict[str, str]) -> None:
    """spec.model.adapters as the running router reads them: its adapters file, replaced whole (a new inode,
    as the kubelet swaps a mounted file)."""
    path = Path(json.loads(Path(pd["router"].argv[-1]).read_text())["adapters_file"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(adapters))
    tmp.replace(path)


def _served(url: str) -> list[str]:
    """The models a router or a worker lists on /v1/models."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as r:
        return [c["id"] for c in json.loads(r.read())["data"]]


def _engines(pd) -> dict[str, int]:
    """Each engine's supervisor pid, checked alive and never restarted (LocalProcess restarts a stall)."""
    for name in ("prefill", "decode"):
        assert pd[name].proc.poll() is None and pd[name].restarts == 0, f"{name} restarted"
    return {name: pd[name].proc.pid for name in ("prefill", "decode")}


def test_an_adapter_added_at_run_time_serves_both_legs_as_one_engine_does(pd, reference, tiny_adapter):
    """Declared on a live deployment, the adapter is loaded onto the running prefill and decode (no engine
    restarts), listed on /v1/models, and served P/D with NIXL: the official client's completions at
    temperature 0 differ from the base model's and equal one aggregated engine's with the same adapter."""
    import openai

    client = OpenAI(base_url=f"{pd['router'].url}/v1", api_key="unused", max_retries=0)
    before = _engines(pd)
    with pytest.raises(openai.NotFoundError) as e:          # not declared yet: unknown, never the base model
        client.completions.create(model=ADAPTER, prompt=PROMPTS[0], max_tokens=4)
    assert ADAPTER in str(e.value)
    _declare(pd, {ADAPTER: tiny_adapter})
    wait_for(lambda: ADAPTER in _served(pd["router"].url), 120, f"{ADAPTER} on the router's /v1/models")
    for name in ("prefill", "decode"):                      # loaded on both legs, as the engines list it
        assert ADAPTER in _served(pd[name].url)
    router_metrics = scrape(pd["router"].url)
    for role in ("prefill", "decode"):
        assert router_metrics[f'{m.ROUTER_ADAPTER_WORKERS}{{adapter="{ADAPTER}",role="{role}"}}'] == 1
    pulls = metric_sum(scrape(pd["decode"].url), m.VLLM_NIXL_BYTES_TRANSFERRED + "_count")
    texts = [_complete(client, p, ADAPTER) for p in PROMPTS]
    assert texts == reference["adapter"]
    assert all(a != b for a, b in zip(texts, reference["completions"])), (texts, reference["completions"])
    raw = client.completions.with_raw_response.create(model=ADAPTER, prompt=PROMPTS[1], max_tokens=4,
                                                      temperature=0)
    assert raw.headers["x-disagg-path"] == m.PATH_REMOTE_PREFILL and raw.headers["x-disagg-adapter"] == ADAPTER
    assert (raw.headers["x-disagg-prefill"], raw.headers["x-disagg-decode"]) == (pd["prefill"].url, pd["decode"].url)
    # every adapter request's KV came over NIXL from the prefill, computed there with the adapter
    assert wait_metric(pd["decode"].url, m.VLLM_NIXL_BYTES_TRANSFERRED + "_count",
                       pulls + len(PROMPTS) + 1) >= pulls + len(PROMPTS) + 1
    # the base model's answers are as they were
    assert [_complete(client, p) for p in PROMPTS] == reference["completions"]
    assert _engines(pd) == before


def test_an_adapter_removed_or_not_loadable_fails_cleanly(pd, tiny_adapter, tmp_path):
    """Removed: unloaded from both engines and a 404 for it at once; declared but loadable nowhere (its
    files missing): not listed, and a 503 that names it. Never the base model's answer; no engine restarts."""
    import openai

    client = OpenAI(base_url=f"{pd['router'].url}/v1", api_key="unused", max_retries=0)
    before = _engines(pd)
    _declare(pd, {ADAPTER: tiny_adapter})
    wait_for(lambda: ADAPTER in _served(pd["router"].url), 120, f"{ADAPTER} on the router's /v1/models")
    _declare(pd, {})
    wait_for(lambda: all(ADAPTER not in _served(pd[n].url) for n in ("prefill", "decode")), 120,
             f"{ADAPTER} unloaded from both engines")
    assert _served(pd["router"].url) == ["tiny"]
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model=ADAPTER, prompt=PROMPTS[0], max_tokens=4)
    assert e.value.status_code == 404 and ADAPTER in str(e.value)
    loads = f'{m.ROUTER_ADAPTER_LOADS}{{outcome="{m.ADAPTER_LOAD_FAILED}"}}'
    failed = scrape(pd["router"].url).get(loads, 0)
    _declare(pd, {"missing": str(tmp_path / "no-such-adapter")})
    wait_for(lambda: scrape(pd["router"].url).get(loads, 0) >= failed + 2, 120, "both engines refusing the load")
    assert _served(pd["router"].url) == ["tiny"]
    with pytest.raises(openai.InternalServerError) as e:
        client.completions.create(model="missing", prompt=PROMPTS[0], max_tokens=4)
    assert e.value.status_code == 503 and "`missing`" in str(e.value)
    _declare(pd, {})
    assert client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4).choices[0].text is not None
    assert _engines(pd) == before


def test_vllm_bench_serve_runs_through_the_router_and_reports_goodput(pd, tiny_model, worker_python, tmp_path):
    """The field's lightest client (`vllm bench serve`, vLLM's own, from the worker environment) completes a
    short random-prompt run through the router over the pair, every request disaggregated, and its goodput
    is read from the result file it writes: under targets every request meets (60 s TTFT and TPOT) it is
    its whole request throughput. bench/field_clients.py runs it at scale against the other layouts."""
    from disagg.e2e.fieldclients import vllm_bench_serve

    url = pd["router"].url
    series = f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_SUCCESS}",path="{m.PATH_REMOTE_PREFILL}"}}'
    before = scrape(url).get(series, 0)
    result = vllm_bench_serve(worker_python, url, "tiny", tiny_model, tmp_path / "vllm-bench.json",
                              num_prompts=8, input_len=32, output_len=8, max_concurrency=4,
                              ttft_ms=60000, tpot_ms=60000)
    assert (result["completed"], result["failed"]) == (8, 0), {k: result.get(k) for k in ("completed", "failed")}
    assert result["total_output_tokens"] == 8 * 8
    assert result["request_throughput"] > 0
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    # the client's requests went through the router, each prefilled remotely
    assert scrape(url).get(series, 0) - before >= 8


def test_min_tokens_binds_the_decode_not_the_prefill(pd):
    """aiperf sends min_tokens (with ignore_eos) to hold every answer to its output length: the prefill leg
    (max_tokens 1) must not carry it, or vLLM refuses the prefill (min_tokens above max_tokens) and the
    client gets a 400 on the P/D path only; the decode honours it."""
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "min_tokens": 12, "temperature": 0}
    req = urllib.request.Request(f"{pd['router'].url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        path, answer = r.headers["x-disagg-path"], json.loads(r.read())
    assert path == m.PATH_REMOTE_PREFILL
    assert answer["usage"]["completion_tokens"] == 12


# ---------------------------------------------------------------- workers that die under a request
FAILURE_PROMPT = "A journey of a thousand miles begins with a single step " * 5
MAX_TOKENS_LONG, KILL_AFTER = 160, 16


class _Proxy:
    """A loopback HTTP server in front of a worker: each request goes to ``handle(request, body)``.
    Quiet: a thread printing a traceback (a probe the router gave up on, answered late) while pytest
    formats a failure has crashed pytest (CPython 3.11's ast module keeps one recursion counter for all
    threads: 'AST constructor recursion depth mismatch'), losing the failure's message."""

    def __init__(self):
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                proxy.handle(self, None)

            def do_POST(self):
                proxy.handle(self, self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass            # the router went away first (a probe timed out, a stream cut): nothing to tell

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def handle(self, request: BaseHTTPRequestHandler, body: bytes | None) -> None:
        raise NotImplementedError

    @staticmethod
    def upstream(url: str, request: BaseHTTPRequestHandler, body: bytes | None):
        """The worker's response to the same request (a probe, GET, gives up after 5 s; a generation may
        be slow on a loaded machine); an HTTPError is a response too."""
        req = urllib.request.Request(f"{url}{request.path}", data=body, method=request.command,
                                     headers={"Content-Type": "application/json"})
        try:
            return urllib.request.urlopen(req, timeout=300 if body else 5)
        except urllib.error.HTTPError as e:
            return e

    def close(self):
        self.server.shutdown()
        self.server.server_close()


class _KillingProxy(_Proxy):
    """In front of the prefill worker: passes requests through; once armed with an action (kill or stop
    the prefill worker) and a prompt, it runs the action after the worker answered that prompt's prefill
    and before the router gets the answer, so the decode is handed KV held by a dead or hung engine."""

    def __init__(self, target: str):
        self.target, self.action, self.prompt, self.done = target, None, None, threading.Event()
        super().__init__()

    def handle(self, request: BaseHTTPRequestHandler, body: bytes | None) -> None:
        try:
            with self.upstream(self.target, request, body) as r:
                status, data = r.status, r.read()
        except OSError:
            status, data = 502, b'{"error": {"message": "prefill unreachable"}}'
        if status == 200 and body and self.action and json.loads(body).get("prompt") == self.prompt:
            action, self.action = self.action, None
            action()
            self.done.set()
        request.send_response(status)
        request.send_header("Content-Type", "application/json")
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        request.wfile.write(data)

    def arm(self, action, prompt: str) -> None:
        self.done.clear()
        self.prompt, self.action = prompt, action


class _DecodeProxy(_Proxy):
    """In front of a decode worker, relaying each response line by line as it comes. Once armed with a
    count, it relays that many token chunks of the next stream (or all but the last, when the stream
    ends sooner), then kills the worker (SIGKILL), cuts the stream, and disarms its peers (the
    continuation goes through one of them): the router has seen part of the text, however far the
    engine had got."""

    def __init__(self, worker):
        self.worker, self.after, self.fired = worker, None, threading.Event()
        self.peers: list[_DecodeProxy] = [self]
        super().__init__()

    def handle(self, request: BaseHTTPRequestHandler, body: bytes | None) -> None:
        try:
            r = self.upstream(self.worker.url, request, body)
        except OSError:
            request.send_error(502, "decode unreachable")
            return
        with r:
            request.send_response(r.status)
            request.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
            request.end_headers()          # HTTP/1.0, no length: the body ends when the connection does
            tokens = 0
            for line in r:
                choices = None
                if self.after is not None and line.startswith(b"data: {"):
                    choices = json.loads(line[6:]).get("choices")
                if choices and choices[0].get("finish_reason") is not None:
                    # the engine got to the end within fewer chunks (vLLM merges tokens into one chunk when
                    # its frontend lags the engine, as on a loaded machine): the last chunk is withheld, so
                    # the router still has tokens to continue elsewhere
                    self._fire(request)
                    return
                request.wfile.write(line)
                request.wfile.flush()
                if choices:
                    tokens += 1
                    if tokens == self.after:
                        self._fire(request)
                        return

    def _fire(self, request: BaseHTTPRequestHandler) -> None:
        for peer in self.peers:
            peer.after = None
        self.worker.kill()
        self.fired.set()
        request.connection.shutdown(socket.SHUT_RDWR)

    def arm(self, after: int) -> None:
        self.fired.clear()
        self.after = after

    def disarm(self) -> None:
        self.after = None


# ---------------------------------------------------------------- a flex worker switched between roles
# decode-b is the flex worker here (kv_both): a third router uses the prefill, the decode (through a
# _GateProxy, which can keep one decode from pulling its KV) and decode-b (through a _PauseProxy, which can
# keep its streams in flight) in the role a roles file gives it,
# as a pod's serving-role label gives it in Kubernetes. The first two tests write that file where the planner
# would write the label; the third has the planner decide, on the local control plane, from these engines'
# metrics in a real Prometheus (test_the_planner_switches_the_flex_worker_on_a_load_step_from_real_metrics).
FLEX_LONG_TOKENS, FLEX_SHORT_TOKENS = 48, 2


class _GateProxy(_Proxy):
    """In front of a decode worker, relaying each response line by line. Once armed, it holds the next
    request that carries a prefill's KV (kv_transfer_params) before the worker sees it, so the KV stays
    unpulled on the prefill until :meth:`release`."""

    def __init__(self, target: str):
        self.target, self.armed = target, False
        self.holding, self.released = threading.Event(), threading.Event()
        self.held_body: dict | None = None
        super().__init__()

    def handle(self, request: BaseHTTPRequestHandler, body: bytes | None) -> None:
        if body and self.armed and b"kv_transfer_params" in body:
            self.armed = False
            self.held_body = json.loads(body)
            self.holding.set()
            self.released.wait(300)
        try:
            r = self.upstream(self.target, request, body)
        except OSError:
            request.send_error(502, "decode unreachable")
            return
        with r:
            request.send_response(r.status)
            request.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
            request.end_headers()          # HTTP/1.0, no length: the body ends when the connection does
            for line in r:
                request.wfile.write(line)
                request.wfile.flush()

    def arm(self) -> None:
        self.holding.clear()
        self.released.clear()
        self.armed = True

    def release(self) -> None:
        self.released.set()


class _PauseProxy(_Proxy):
    """In front of the flex worker, relaying each response line by line. While pausing, a stream stops
    after its first token until :meth:`resume`: it stays in flight on the worker for as long as the test
    needs (a tiny model's whole answer takes less than a poll here)."""

    def __init__(self, target: str):
        self.target, self.pausing, self.resumed = target, False, threading.Event()
        self.paused = 0
        self.lock = threading.Lock()
        super().__init__()

    def handle(self, request: BaseHTTPRequestHandler, body: bytes | None) -> None:
        try:
            r = self.upstream(self.target, request, body)
        except OSError:
            request.send_error(502, "flex worker unreachable")
            return
        pause = self.pausing and body is not None and json.loads(body).get("stream")
        with r:
            request.send_response(r.status)
            request.send_header("Content-Type", r.headers.get("Content-Type", "application/json"))
            request.end_headers()
            for line in r:
                request.wfile.write(line)
                request.wfile.flush()
                if pause and line.startswith(b"data: {") and json.loads(line[6:]).get("choices"):
                    pause = False
                    with self.lock:
                        self.paused += 1
                    self.resumed.wait(300)

    def pause(self) -> None:
        self.resumed.clear()
        self.paused, self.pausing = 0, True

    def resume(self) -> None:
        self.pausing = False
        self.resumed.set()


@pytest.fixture(scope="module")
def flex(pd, decode_b, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-flex")
    first = json.loads(Path(pd["router"].argv[-1]).read_text())
    gate, front = _GateProxy(pd["decode"].url), _PauseProxy(decode_b.url)
    roles = logs / "flex-roles.json"
    roles.write_text(json.dumps({front.url: "prefill"}))
    port = free_port()
    config = {"model": first["model"], "tokenizer": first["tokenizer"], "block_size": first["block_size"],
              "port": port, "host": "127.0.0.1", "health_interval_s": 1,
              # round-robin: which prefill and decode a request gets is the test's to know
              "spec": {"disaggregation": "always", "policy": "round-robin", "connectTimeoutSeconds": 30,
                       "prefillTimeoutSeconds": 120},
              "prefill": [{"url": pd["prefill"].url, "kv_events": first["prefill"][0]["kv_events"]}],
              "decode": [{"url": gate.url}],
              "flex": [{"url": front.url, "role": "prefill"}], "flex_roles_file": str(roles)}
    (logs / "router.json").write_text(json.dumps(config))
    r = router(logs / "router.json", port, logs)
    try:
        r.start().wait_ready()
        yield {"router": r, "gate": gate, "front": front, "url": front.url, "roles": roles, "worker": decode_b,
               "prefill": pd["prefill"], "decode": pd["decode"]}
    finally:
        r.stop()
        gate.close()
        front.close()


def _flex_request(url: str, prompt: str, max_tokens: int) -> tuple[dict, str, dict]:
    """A streamed completion through the flex router: (route headers, text, usage); an error event, a
    refusal or a broken stream raises."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, usage = [], {}
    with urllib.request.urlopen(req, timeout=300) as r:
        route = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-disagg-")}
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, f"an error event: {str(event)[:300]}"
            if event.get("usage"):
                usage = event["usage"]
            if event["choices"]:
                text.append(event["choices"][0]["text"])
    return route, "".join(text), usage


def _flex_log_tails(flex) -> str:
    return "\n".join(f"--- {p.name} (log tail):\n{p.tail(40)}"
                     for p in (flex["router"], flex["worker"], flex["prefill"], flex["decode"]))


def _switch(flex, role: str) -> float:
    """The decision, as the planner writes it: the flex worker's role. Returns when it was written."""
    flex["roles"].write_text(json.dumps({flex["url"]: role}))
    return time.monotonic()


def _switches(flex, frm: str, to: str, outcome: str = m.SWITCH_SWITCHED) -> float:
    return scrape(flex["router"].url).get(
        f'{m.ROUTER_ROLE_SWITCHES}{{from_role="{frm}",outcome="{outcome}",to_role="{to}"}}', 0)


def _serving(flex, role: str, state: str = "serving") -> float:
    return scrape(flex["router"].url).get(f'{m.ROUTER_FLEX_WORKERS}{{role="{role}",state="{state}"}}', 0)


@pytest.mark.timeout(FIRST_FAILURE_TEST_TIMEOUT)     # its setup waits for decode-b (DECODE_B_WAIT_S)
def test_a_flex_prefill_holding_kv_for_a_decode_switches_only_after_the_pull(flex):
    """The flex worker prefilled a request whose decode has not pulled the KV yet (the gate holds the
    decode's request before the decode engine sees it). Told to serve decode, it takes no new prefill, and
    does not flip while the blocks wait: a whole other request goes through meanwhile. Once the decode gets
    the request and pulls the blocks, it flips; the held request finishes whole, nothing failed."""
    url, gate, flex_url = flex["router"].url, flex["gate"], flex["url"]
    wait_for(lambda: _serving(flex, "prefill") == 1, 60, "the flex worker serving prefill")
    held = None
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        for _ in range(2):                  # round-robin: the first or the second request prefills on it
            gate.arm()
            held = pool.submit(_flex_request, url, "The held request's prompt, long enough " * 8, 8)
            gate.holding.wait(300)
            assert gate.holding.is_set(), _flex_log_tails(flex)
            key = f'{m.ROUTER_KV_HELD}{{role="prefill",worker="{flex_url}"}}'
            if scrape(url).get(key) == 1:
                break
            gate.release()                  # the dedicated prefill did this one
            held.result(timeout=300)
        assert scrape(url).get(key) == 1
        remote = gate.held_body["kv_transfer_params"]
        decided = _switch(flex, "decode")
        wait_for(lambda: _serving(flex, "prefill", "draining") == 1, 30, "the router to see the decision")
        # the drain waits: a whole request (prefilled by the dedicated prefill) goes through meanwhile
        route, text, usage = pool.submit(_flex_request, url, "Meanwhile another request " * 4,
                                         FLEX_SHORT_TOKENS).result(timeout=300)
        assert route["x-disagg-prefill"] == flex["prefill"].url and usage["completion_tokens"] == FLEX_SHORT_TOKENS
        assert _switches(flex, "prefill", "decode") == 0 and scrape(url).get(key) == 1
        pulls = metric_sum(scrape(flex["decode"].url), m.VLLM_NIXL_BYTES_TRANSFERRED + "_count")
        gate.release()
        wait_for(lambda: _switches(flex, "prefill", "decode") == 1, 120, "the flip after the pull")
        flipped = time.monotonic()
        route, text, usage = held.result(timeout=300)
    assert route["x-disagg-prefill"] == flex_url and route["x-disagg-path"] == m.PATH_REMOTE_PREFILL
    assert usage["completion_tokens"] == 8 and "x-disagg-fallback" not in route
    assert remote.get("remote_engine_id")                       # the decode pulled from the flex engine
    wait_for(lambda: metric_sum(scrape(flex["decode"].url), m.VLLM_NIXL_BYTES_TRANSFERRED + "_count") > pulls, 60,
             "the decode engine to count its pull from the flex engine")
    assert _serving(flex, "decode") == 1 and _switches(flex, "prefill", "decode", m.SWITCH_ABANDONED) == 0
    print(f"flex switch prefill -> decode: {flipped - decided:.1f} s from the decision, held by one unpulled "
          "hand-off")


def test_a_load_step_switches_the_flex_worker_and_no_request_fails(flex):
    """Output-heavy streams decode on the flex worker (serving decode); the decision for prompt-heavy
    traffic switches it to prefill while its streams are in flight (held mid-answer by the proxy in front of
    it): it takes no new decode and does not flip while they run; once they go on, they finish whole and it
    flips, then prefills. The step back to output-heavy traffic switches it to decode with its prefills in
    flight. Every request of the run succeeds, with no fallback and no drain given up."""
    url, front, flex_url = flex["router"].url, flex["front"], flex["url"]
    wait_for(lambda: _serving(flex, "decode") == 1, 60, "the flex worker serving decode")
    long_prompt = "Summarise the following paragraph of text in detail please " * 12
    results: list = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # output-heavy: each stream decodes on the decode worker (and ends) or on the flex worker (and waits)
        front.pause()
        streams = [pool.submit(_flex_request, url, f"Story {i}: once upon a time", FLEX_LONG_TOKENS) for i in range(4)]
        wait_for(lambda: front.paused + sum(f.done() for f in streams) == len(streams), 300,
                 "every stream decoding on the flex worker or done")
        on_it = front.paused
        assert on_it >= 1, [f.result() for f in streams]
        decided = _switch(flex, "prefill")           # prompt-heavy traffic is coming
        wait_for(lambda: _serving(flex, "decode", "draining") == 1, 30, "the router to see the decision")
        prompt_heavy = [pool.submit(_flex_request, url, f"{i} {long_prompt}", FLEX_SHORT_TOKENS) for i in range(6)]
        results += [f.result(timeout=300) for f in prompt_heavy]
        # they decoded elsewhere, and the flex worker still drains: its streams are in flight
        assert all(r[0]["x-disagg-decode"] != flex_url for r in results)
        assert _switches(flex, "decode", "prefill") == 0 and _serving(flex, "decode", "draining") == 1
        front.resume()
        results += [f.result(timeout=300) for f in streams]
        on_flex = [r for r in results[-4:] if r[0]["x-disagg-decode"] == flex_url]
        assert len(on_flex) == on_it and all(r[2]["completion_tokens"] == FLEX_LONG_TOKENS for r in results[-4:])
        wait_for(lambda: _switches(flex, "decode", "prefill") == 1, 120, "the flip to prefill")
        to_prefill = time.monotonic() - decided
        more = [pool.submit(_flex_request, url, f"{i} more: {long_prompt}", FLEX_SHORT_TOKENS) for i in range(4)]
        step = [r.result(timeout=300) for r in more]
        results += step
        assert any(r[0]["x-disagg-prefill"] == flex_url for r in step), "the flex worker prefilled nothing"
        # the step to output-heavy traffic, with prefills on the flex worker in flight
        in_flight = [pool.submit(_flex_request, url, f"{i} last: {long_prompt}", FLEX_SHORT_TOKENS)
                     for i in range(4)]
        decided = _switch(flex, "decode")
        wait_for(lambda: _switches(flex, "prefill", "decode") == 2, 120, "the flip back to decode")
        to_decode = time.monotonic() - decided
        results += [f.result(timeout=300) for f in in_flight]
        after = [pool.submit(_flex_request, url, f"Tale {i}: far away", FLEX_LONG_TOKENS) for i in range(2)]
        results += [f.result(timeout=300) for f in after]
    assert any(r[0]["x-disagg-decode"] == flex_url for r in results[-2:]), "no decode on the flex worker"
    assert all(r[2]["completion_tokens"] in (FLEX_LONG_TOKENS, FLEX_SHORT_TOKENS) for r in results)
    routed = scrape(url)
    failed = {k: v for k, v in routed.items() if k.startswith(m.ROUTER_REQUESTS) and v
              and f'outcome="{m.OUTCOME_SUCCESS}"' not in k}
    assert failed == {}, failed                                 # zero failed requests, the whole module's flex run
    assert metric_sum(routed, m.ROUTER_FALLBACKS) == 0
    assert _switches(flex, "decode", "prefill", m.SWITCH_ABANDONED) == 0
    assert _switches(flex, "prefill", "decode", m.SWITCH_ABANDONED) == 0
    print(f"flex switches under load: decode -> prefill {to_prefill:.1f} s (its streams held by the test), "
          f"prefill -> decode {to_decode:.1f} s from the decision")


# ---------------------------------------------------------------- the planner deciding a flex worker's switch
# The same three engines and flex router, now as a DisaggDeployment's workers: on the local control plane the
# operator renders the deployment (kwok pods: one prefill, one decode, one flex worker, a router), a real
# Prometheus scrapes the real engines and the flex router under the labels the chart's pod monitors give the
# pods' series, and the planner loop (its own process's loop, here in a thread, under the planner's role)
# decides the flex worker's role from them and writes it on the flex pod.
PLANNED = "flexpd"
PLANNED_ENDPOINT = "cluster-prometheus"
PROMPT_HEAVY_CLIENTS, OUTPUT_HEAVY_CLIENTS = 4, 80     # 80: more streams than the decode engine runs (64)
PROMPT_HEAVY_TOKENS, OUTPUT_HEAVY_TOKENS = 2, 96
PROMPT_HEAVY = "Summarise the following paragraph of text in detail please " * 20   # ~650 tokens


def _planned_manifest(namespace: str) -> dict:
    from disagg.api.v1alpha1 import VERSION
    from disagg.e2e.testing import GROUP
    from disagg.planner.loop import GPU_ANNOTATION

    # The planner sizes with its performance model, which knows GPU models only: named here is one it knows,
    # and its figures (an H100's) say one replica of each role has room to spare for anything these CPU
    # engines serve. What the decision follows is what the engines report: requests waiting at decode (more
    # streams than the decode engine runs) ask decode for one more replica, which the flex worker is. The
    # SLO is loose for the same reason: the CPU engines' latencies alone breach nothing.
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DisaggDeployment",
            "metadata": {"name": PLANNED, "namespace": namespace, "annotations": {GPU_ANNOTATION: "H100-SXM"}},
            "spec": {"model": {"name": "llama-3.1-8b", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
                     "prefill": {"replicas": 1, "maxReplicas": 1}, "decode": {"replicas": 1, "maxReplicas": 1},
                     # one flex worker, no more, no fewer: the planner can switch it, not grow or shrink the pool
                     "flex": {"replicas": 1, "minReplicas": 1, "maxReplicas": 1},
                     "slo": {"ttftMs": 30000, "itlMs": 2000, "percentile": 90},
                     "planner": {"enabled": True, "intervalSeconds": 5, "gpuBudget": 8,
                                 "prometheus": PLANNED_ENDPOINT}}}


def _say(*args) -> None:
    """print, past the operator fixture: kopf's test runner (click's) holds sys.stdout while it runs."""
    print(*args, file=sys.__stdout__, flush=True)


class _RoleBridge:
    """What the router's and Prometheus' pod discovery do in a cluster, for engines that run outside it:
    the flex pod's serving-role label (the planner's decision) becomes the flex router's roles file (a
    router in a cluster watches the pod) and the `role` of the flex engine's scrape target (the chart's pod
    monitor relabels it from the pod's label). Polls the pod; each change is recorded with when it was
    seen."""

    def __init__(self, core, namespace: str, pod: str, write):
        self.core, self.namespace, self.pod, self.write = core, namespace, pod, write
        self.seen: list[tuple[str, float, str | None]] = []     # (role, wall time seen, since annotation)
        self.errors: list[BaseException] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from disagg.api.names import ANNOTATION_SERVING_ROLE_SINCE, LABEL_SERVING_ROLE

        role = None
        while not self.stop.wait(0.2):
            try:
                meta = self.core.read_namespaced_pod(self.pod, self.namespace, _request_timeout=10).metadata
            except Exception as e:      # (the API server slow under load: the next poll)
                self.errors.append(e)
                continue
            now = (meta.labels or {}).get(LABEL_SERVING_ROLE)
            if now in ("prefill", "decode") and now != role:
                self.write(now)
                role = now
                self.seen.append((now, time.time(), (meta.annotations or {}).get(ANNOTATION_SERVING_ROLE_SINCE)))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


class _ClosedLoop:
    """``clients`` threads, each sending one streamed completion after another (``_flex_request``) until
    stopped: (start, end, route headers, text, usage, error) per request."""

    def __init__(self, url: str, clients: int, prompt, max_tokens: int):
        self.url, self.prompt, self.max_tokens = url, prompt, max_tokens
        self.done: list[tuple] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(clients)]

    def _client(self, i: int) -> None:
        k = 0
        while not self.stopping.is_set():
            start = time.time()
            try:
                route, text, usage = _flex_request(self.url, self.prompt(i, k), self.max_tokens)
                self.done.append((start, time.time(), route, text, usage, None))
            except Exception as e:
                self.done.append((start, time.time(), {}, "", {}, e))
            k += 1

    def start(self) -> _ClosedLoop:
        for t in self.threads:
            t.start()
        return self

    def finish(self, timeout: float = 300) -> list[tuple]:
        """Stops sending; every request in flight ends (its stream read to the end) before this returns."""
        self.stopping.set()
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(deadline - time.monotonic(), 0))
        assert not any(t.is_alive() for t in self.threads), "streams still running past the wait"
        return self.done


@pytest.mark.cluster
@pytest.mark.timeout(FIRST_FAILURE_TEST_TIMEOUT)     # run alone (-k), its setup starts the engines
def test_the_planner_switches_the_flex_worker_on_a_load_step_from_real_metrics(
        flex, cluster, api_client, crd_installed, namespace, operator_kubeconfig, planner_api, tmp_path):
    """Issue 31's acceptance on real engines: a deployment of one prefill, one decode and one flex worker
    (the flex router's engines, under kwok pods the operator renders). Prompt-heavy traffic, the flex
    worker serving prefill: the planner keeps it there. The step to output-heavy traffic (more streams than
    the decode engine runs, so requests wait for decode): from the engines' and the router's metrics in
    Prometheus the planner decides to switch the flex worker to decode and writes it on the pod; the router
    drains it (the prefills it did, until their decodes pulled the KV) and flips within seconds of that
    decision; the planner counts the switch once the router's flip shows in Prometheus. Zero failed
    requests, no fallback, no drain given up, and every stream in flight through the switch finishes whole.

    A stand-in (_RoleBridge): the engines run outside the cluster, so the pod's label reaches the router as
    its roles file and Prometheus as the flex engine's target label, written by the test on each change of
    the label, where the router's and Prometheus' pod discovery would carry it in a cluster."""
    from disagg.e2e.operator_fixture import running_operator

    # the operator for this test alone (not the module's fixture): the failure tests after it run without it
    with running_operator(operator_kubeconfig):
        _planner_load_step(flex, api_client, namespace, planner_api, tmp_path)


def _planner_load_step(flex, api_client, namespace, planner_api, tmp_path) -> None:
    from kubernetes import client

    from disagg.api.names import ANNOTATION_SERVING_ROLE_SINCE, LABEL_DEPLOYMENT, LABEL_ROLE, LABEL_SERVING_ROLE
    from disagg.api.v1alpha1 import PLURAL, VERSION
    from disagg.e2e.prometheus import LocalPrometheus
    from disagg.e2e.testing import GROUP
    from disagg.planner import reasons
    from disagg.planner.apply import FIELD_MANAGER, Executor, PlannerMetrics
    from disagg.planner.endpoints import Allowlist, Endpoint
    from disagg.planner.loop import PlannerLoop
    from disagg.planner.metrics_source import PrometheusSource

    setup_started = time.monotonic()
    core, custom = client.CoreV1Api(api_client), client.CustomObjectsApi(api_client)
    url, flex_url = flex["router"].url, flex["url"]
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, _planned_manifest(namespace))
    get = lambda: custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, PLANNED)  # noqa: E731

    def pods() -> dict[str, list]:
        out: dict[str, list] = {}
        for p in core.list_namespaced_pod(namespace, label_selector=f"{LABEL_DEPLOYMENT}={PLANNED}").items:
            if p.metadata.deletion_timestamp is None:
                out.setdefault((p.metadata.labels or {}).get(LABEL_ROLE), []).append(p)
        return out

    wait_for(lambda: (lambda ps: all(len(ps.get(r, [])) == 1 for r in ("prefill", "decode", "flex", "router"))
                      and (ps["flex"][0].metadata.labels or {}).get(LABEL_SERVING_ROLE))(pods()),
             120, "the operator's pods, the flex worker given a role")
    wait_for(lambda: (get().get("status") or {}).get("phase") == "Ready", 120, "the deployment Ready")
    named = {role: ps[0].metadata.name for role, ps in pods().items()}
    # where the step starts: the flex worker serving prefill (the operator gave it decode, the role the tie
    # goes to; a decision for the prompt-heavy traffic before would have made it prefill)
    core.patch_namespaced_pod(named["flex"], namespace, {"metadata": {"labels": {LABEL_SERVING_ROLE: "prefill"}}})

    # the targets as the chart's pod monitors label them (namespace, pod, deployment; a worker's role, a flex
    # worker's its serving role), the vLLM names as its metric relabelling stores them
    def target(u: str, role: str | None, pod: str) -> dict:
        labels = {"namespace": namespace, "pod": pod, "deployment": PLANNED, **({"role": role} if role else {})}
        return {"targets": [u.removeprefix("http://")], "labels": labels}

    def workers(flex_role: str) -> list[dict]:
        return [target(flex["prefill"].url, "prefill", named["prefill"]),
                target(flex["decode"].url, "decode", named["decode"]),
                target(flex["worker"].url, flex_role, named["flex"])]

    prom = LocalPrometheus(tmp_path / "prometheus", [])
    vllm_names = [{"action": "replace", "source_labels": ["__name__"], "regex": "vllm_(.+)",
                   "target_label": "__name__", "replacement": "vllm:${1}"}]
    prom.scrape_configs = [prom.file_sd("workers", workers("prefill"), metric_relabel_configs=vllm_names),
                           prom.file_sd("routers", [target(url, None, named["router"])])]

    def write_role(role: str) -> None:
        flex["roles"].write_text(json.dumps({flex_url: role}))
        prom.set_targets("workers", workers(role))

    source = PrometheusSource.for_endpoint(Endpoint(PLANNED_ENDPOINT, prom.url), timeout=10)
    metrics = PlannerMetrics()
    loop = PlannerLoop(planner_api, Executor(planner_api, metrics), lambda endpoint: source,
                       Allowlist({PLANNED_ENDPOINT: Endpoint(PLANNED_ENDPOINT, prom.url)}), namespace=namespace,
                       scrape_interval=1.0)
    lab = {"namespace": namespace, "deployment": PLANNED}
    planner_stop = threading.Event()
    planner = threading.Thread(target=loop.run, args=(planner_stop, 0.5), daemon=True)
    prompt_heavy = output_heavy = None
    prom.start()
    try:
        with _RoleBridge(core, namespace, named["flex"], write_role) as bridge:
            wait_for(lambda: _serving(flex, "prefill") == 1, 60, "the router to serve prefill on the flex worker")
            flips_before = _switches(flex, "prefill", "decode")
            setup_s = time.monotonic() - setup_started

            # prompt-heavy: long prompts, two tokens each; the planner sees it and keeps the flex worker in prefill
            step_started, prompt_started = time.monotonic(), time.time()
            prompt_heavy = _ClosedLoop(url, PROMPT_HEAVY_CLIENTS, lambda i, k: f"{i}.{k} {PROMPT_HEAVY}",
                                       PROMPT_HEAVY_TOKENS).start()
            wait_for(lambda: (lambda o: o.request_rate and (o.input_tokens_mean or 0) > 200)(
                source.observe(namespace, PLANNED, 90, 5)), 180, "prompt-heavy traffic in Prometheus", interval=1)
            planner.start()

            def planned_prompt_heavy():
                p = (get().get("status") or {}).get("planner") or {}
                return p if (p.get("inputs") or {}).get("inputTokensMean", 0) > 200 else None

            seen = wait_for(planned_prompt_heavy, 120, "a decision on the prompt-heavy traffic", interval=1)
            _say("prompt-heavy decision:", seen["reason"], seen["message"])
            # no switch for prompt-heavy traffic
            assert [r for r, *_ in bridge.seen] == ["prefill"], (bridge.seen, get()["status"]["planner"])
            assert not metrics.registry.get_sample_value(m.PLANNER_DECISIONS, {
                **lab, "role": "decode", "direction": "up", "reason": reasons.ROLE_SWITCHED})

            # the step: output-heavy traffic, short prompts and long answers, more streams than decode runs
            prompt_heavy.finish()
            output_heavy = _ClosedLoop(url, OUTPUT_HEAVY_CLIENTS, lambda i, k: f"Story {i}.{k}: once upon a time",
                                       OUTPUT_HEAVY_TOKENS).start()
            stepped = time.time()
            wait_for(lambda: len(bridge.seen) > 1, 300, "the planner's decision to switch the flex worker",
                     interval=0.5)
            role, seen_at, since = bridge.seen[1]
            assert role == "decode" and since, bridge.seen
            decided = float(since)              # the planner's clock at its decision (whole seconds)
            wait_for(lambda: _switches(flex, "prefill", "decode") > flips_before, 180,
                     "the router's flip of the flex worker to decode", interval=0.2)
            flipped = time.time()
            # within seconds: the drain of what it prefilled (until their decodes, queued, pulled the KV), far
            # inside the drain's bound (120 s), and generous for a loaded 2-core machine
            assert flipped - seen_at < 60, (flipped - seen_at, bridge.seen)
            # (its event comes after the label, the replicas and the status: the flip can come first)
            events = wait_for(lambda: [e for e in core.list_namespaced_event(
                namespace, field_selector=f"involvedObject.name={PLANNED}").items
                if e.reason == reasons.ROLE_SWITCHED and e.source.component == FIELD_MANAGER], 60,
                "the planner's RoleSwitched event")
            assert "1 prefill->decode switched" in events[0].message, [e.message for e in events]
            _say("the decision:", events[0].message)
            # the flex worker decodes; the planner counts the switch once the flip shows in Prometheus
            wait_for(lambda: any(r[2].get("x-disagg-decode") == flex_url for r in output_heavy.done), 180,
                     "a stream decoded on the flex worker")
            decoded = time.time()
            wait_for(lambda: metrics.registry.get_sample_value(m.PLANNER_ROLE_SWITCHES, {
                **lab, "from_role": "prefill", "to_role": "decode", "outcome": m.SWITCH_SWITCHED}) == 1, 60,
                "the planner to count the switch")
            counted = time.time()
            done = output_heavy.finish()
            step_s = time.monotonic() - step_started
            phases = (f"prompt-heavy {stepped - prompt_started:.0f} s, step to flip {flipped - stepped:.0f} s, "
                      f"a whole stream on the flex worker {decoded - flipped:.0f} s, the planner's count "
                      f"{counted - decoded:.0f} s, the streams' end {time.time() - counted:.0f} s")
    finally:
        planner_stop.set()
        for load in (prompt_heavy, output_heavy):    # (after a failure: its streams end before the next test)
            if load is not None:
                load.stopping.set()
                for t in load.threads:
                    t.join(300)
        if planner.is_alive():
            planner.join(30)
        prom.stop()
        source.close()

    assert metrics.registry.get_sample_value(m.PLANNER_DECISIONS, {
        **lab, "role": "decode", "direction": "up", "reason": reasons.ROLE_SWITCHED}) == 1
    flex_pod = core.read_namespaced_pod(named["flex"], namespace)
    assert flex_pod.metadata.labels[LABEL_SERVING_ROLE] == "decode"
    assert flex_pod.metadata.annotations[ANNOTATION_SERVING_ROLE_SINCE] == since
    everything = prompt_heavy.done + done
    errors = [r[5] for r in everything if r[5] is not None]
    assert not errors, errors[:5]
    assert all(r[4]["completion_tokens"] == PROMPT_HEAVY_TOKENS for r in prompt_heavy.done)
    assert all(r[4]["completion_tokens"] == OUTPUT_HEAVY_TOKENS for r in done)
    # the streams in flight on the flex worker through the switch (it prefilled them; they ended after the
    # decision) finished whole
    through = [r for r in done if r[2].get("x-disagg-prefill") == flex_url and r[1] > decided]
    assert through and all(r[4]["completion_tokens"] == OUTPUT_HEAVY_TOKENS for r in through)
    routed = scrape(url)
    failed = {k: v for k, v in routed.items() if k.startswith(m.ROUTER_REQUESTS) and v
              and f'outcome="{m.OUTCOME_SUCCESS}"' not in k}
    assert failed == {}, failed
    assert metric_sum(routed, m.ROUTER_FALLBACKS) == 0
    assert _switches(flex, "prefill", "decode", m.SWITCH_ABANDONED) == 0
    assert metrics.registry.get_sample_value(m.PLANNER_ROLE_SWITCHES, {
        **lab, "from_role": "prefill", "to_role": "decode", "outcome": m.SWITCH_ABANDONED}) is None
    _say(f"planner switch prefill -> decode: decided {decided - stepped:+.1f} s after the load step, the label "
          f"seen {seen_at - decided:.1f} s and the router's flip {flipped - decided:.1f} s after the decision "
          f"(its clock at the pass's start, whole seconds), the flip {flipped - seen_at:.1f} s after the label was "
          f"seen; {len(through)} streams in flight on the flex worker through it, "
          f"{len(everything)} requests, none failed; setup {setup_s:.0f} s, load phases {step_s:.0f} s ({phases})")


@pytest.fixture(scope="module")
def failures(pd, decode_b, jaeger, tmp_path_factory):
    """A second router over the same prefill (through a :class:`_KillingProxy`) and both decode workers:
    every request P/D, round-robin, probes every second (a hung prefill is found after 3 probe timeouts
    of 2 s). It traces every request to Jaeger, so a fallback's trace can be read back."""
    logs = tmp_path_factory.mktemp("pd-failures")
    first = json.loads(Path(pd["router"].argv[-1]).read_text())     # the first router's configuration
    proxy = _KillingProxy(pd["prefill"].url)
    decode_proxies = [_DecodeProxy(w) for w in (pd["decode"], decode_b)]
    for d in decode_proxies:
        d.peers = decode_proxies
    port = free_port()
    config = {"model": first["model"], "tokenizer": first["tokenizer"], "block_size": first["block_size"],
              "port": port, "host": "127.0.0.1", "health_interval_s": 1,
              # a starved router (nice 19 under a load average of 40 here) timed out a local connect after
              # 5 s and, with one decode left, the request failed: the timeouts are not what is tested
              # a slow prefill on a loaded 2-core machine must not turn into a (correct) fallback
              "spec": {"disaggregation": "always", "policy": "round-robin", "connectTimeoutSeconds": 30,
                       "prefillTimeoutSeconds": 120},
              "prefill": [{"url": proxy.url}],
              "decode": [{"url": d.url} for d in decode_proxies],
              "tracing": {"otlpEndpoint": jaeger.otlp_endpoint, "samplingRatio": 1.0}}
    (logs / "router.json").write_text(json.dumps(config))
    r = router(logs / "router.json", port, logs)
    try:
        r.start().wait_ready()
        yield {"router": r, "proxy": proxy, "prefill": pd["prefill"], "decode_proxies": decode_proxies,
               "decodes": {d.url: d.worker for d in decode_proxies}}
    finally:
        r.stop()
        proxy.close()
        for d in decode_proxies:
            d.close()


def _stream(failures) -> tuple[dict, str, list[dict]]:
    """One streamed completion of FAILURE_PROMPT at temperature 0 through the failure router: (route
    headers, text, chunks). A refused, stalled or broken request fails with what the router said and the
    logs of the router and the workers, which a CI run keeps nowhere else."""
    body = {"model": "tiny", "prompt": FAILURE_PROMPT, "max_tokens": MAX_TOKENS_LONG, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{failures['router'].url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks, text = [], []
    try:
        r = urllib.request.urlopen(req, timeout=300)
    except urllib.error.HTTPError as e:
        pytest.fail(f"the router answered {e.code}: {e.read()[:1000]!r}\n{_log_tails(failures)}")
    try:
        with r:
            route = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-disagg-")}
            for line in r:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(line[6:])
                error = event.get("error")
                assert error is None, f"an error event: {str(error)[:300]}"
                chunks.append(event)
                if event["choices"]:
                    text.append(event["choices"][0]["text"])
    except (OSError, AssertionError) as e:       # a stream that stalled (the socket's timeout) or broke
        pytest.fail(f"the stream failed after {len(text)} tokens: {e!r}\n{_log_tails(failures)}")
    return route, "".join(text), chunks


def _assert_fallback_trace(jaeger, route: dict, reason: str) -> None:
    """The fallen-back request's trace, read back from Jaeger by the id the client got: a fallback span
    under the request naming the reason, the first decode attempt (with the prefill's KV) failed, the
    last (local prefill, no KV) served it."""
    from disagg.e2e.jaeger import spans_by_name
    from disagg.router import tracing as t

    trace_id = route[t.TRACE_ID_HEADER]
    # the router exports in batches; the serving decode's llm_request span comes when its request ends
    trace = wait_for(lambda: (tr := jaeger.trace(trace_id)) and t.FALLBACK in (by := spans_by_name(tr))
                     and t.REQUEST in by and tr, 60, f"trace {trace_id} with its fallback span")
    by = spans_by_name(trace)

    def tags(s: dict) -> dict:
        return {tag["key"]: tag["value"] for tag in s["tags"]}
    root = by[t.REQUEST][0]
    assert tags(root)[t.A_PATH] == m.PATH_FALLBACK
    assert reason in [tags(s)[t.A_REASON] for s in by[t.FALLBACK]]
    assert all(s["parent"] == root["spanID"] for s in by[t.FALLBACK])
    # the decode that was handed the dead prefill's KV failed (unless the probes found the prefill gone
    # before it was asked); the last attempt, without KV, served the request
    *failed, served = sorted(by[t.DECODE], key=lambda s: s["startTime"])
    assert [(tags(s)[t.A_KV], tags(s).get("otel.status_code")) for s in failed] in ([], [(True, "ERROR")])
    assert not tags(served)[t.A_KV] and tags(served).get("otel.status_code") != "ERROR", tags(served)


def _log_tails(failures) -> str:
    """The log tails of the failure router and its workers (a CI run keeps them nowhere else)."""
    logs = [failures["router"], failures["prefill"], *failures["decodes"].values()]
    return "\n".join(f"--- {p.name} (log tail):\n{p.tail(60 if p is logs[0] else 25)}" for p in logs)


def _router_sees(failures) -> None:
    """Until the failure router counts healthy exactly the workers alive: a worker killed by a test before
    is out, the prefill (after a SIGCONT) back in."""
    url = failures["router"].url
    decodes = sum(p.proc.poll() is None for p in failures["decodes"].values())

    def settled():
        s = scrape(url)
        return (s.get(f'{m.ROUTER_WORKERS}{{role="prefill",state="healthy"}}'),
                s.get(f'{m.ROUTER_WORKERS}{{role="decode",state="healthy"}}')) == (1, decodes)
    try:
        wait_for(settled, 120, f"the failure router to count the prefill and {decodes} decode(s) healthy")
    except AssertionError as e:
        pytest.fail(f"{e}\n{_log_tails(failures)}")


@pytest.mark.timeout(FIRST_FAILURE_TEST_TIMEOUT)     # run alone (-k), its setup starts decode-b
def test_a_decode_killed_mid_stream_is_continued_with_the_same_text(failures):
    url = failures["router"].url
    _router_sees(failures)
    _, want, chunks = _stream(failures)                    # uninterrupted
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": MAX_TOKENS_LONG,
             "total_tokens": prompt_tokens + MAX_TOKENS_LONG}
    assert {k: chunks[-1]["usage"][k] for k in usage} == usage
    series = f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_MIGRATED}"}}'
    before = scrape(url).get(series, 0)
    proxies = failures["decode_proxies"]
    for d in proxies:
        d.arm(KILL_AFTER)
    try:
        route, text, chunks = _stream(failures)
    finally:
        for d in proxies:
            d.disarm()
    killed = [d for d in proxies if d.fired.is_set()]
    assert len(killed) == 1 and killed[0].worker.proc.poll() is not None   # it was killed mid-stream
    assert failures["decodes"][route["x-disagg-decode"]] is killed[0].worker
    assert text == want
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1
    assert chunks[-1]["usage"] == usage
    after = scrape(url).get(series, 0)
    assert after == before + 1


def test_a_prefill_hung_after_it_answered_leaves_no_decode_waiting(failures):
    url = failures["router"].url
    _router_sees(failures)
    _, want, _ = _stream(failures)
    series = f'{m.ROUTER_FALLBACKS}{{reason="{m.FALLBACK_PREFILL_LOST}"}}'
    before = scrape(url).get(series, 0)
    group = failures["prefill"].proc.pid             # its own session: the worker's process group
    failures["proxy"].arm(lambda: os.killpg(group, signal.SIGSTOP), FAILURE_PROMPT)
    try:
        route, text, chunks = _stream(failures)
    finally:
        os.killpg(group, signal.SIGCONT)
    assert failures["proxy"].done.is_set()
    assert text == want
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS_LONG
    path, reason = route["x-disagg-path"], route.get("x-disagg-fallback")
    counted = scrape(url).get(series, 0) - before
    if path == m.PATH_FALLBACK:      # the decode's pull waited (given up: prefill_lost) or failed
        assert reason in (m.FALLBACK_PREFILL_LOST, m.FALLBACK_KV_TRANSFER)
        assert counted == (1 if reason == m.FALLBACK_PREFILL_LOST else 0)
    else:                             # the pull went through before the prefill stopped
        assert path == m.PATH_REMOTE_PREFILL
        assert counted == 0


def test_a_prefill_killed_after_it_answered_and_requests_in_flight_complete(failures, jaeger):
    """The decode is handed KV that a dead engine holds. vLLM's NIXL connector (0.32,
    kv_load_failure_policy "fail", the default) fails such a request instead of waiting: the handshake
    or the read fails and the request ends with an error before its first token. The router then
    serves it by local prefill on a decode worker (kv_transfer_failed), unless its probes found the prefill
    dead first (prefill_lost: the same local prefill); the client sees the same text. Requests in flight
    on the prefill when it dies, and those sent after, complete too (by whichever fallback meets them:
    prefill_error, kv_transfer_failed, prefill_lost, or local prefill once the router counts it out)."""
    url = failures["router"].url
    _router_sees(failures)
    _, want, _ = _stream(failures)                             # the prefill still alive
    reasons = (m.FALLBACK_KV_TRANSFER, m.FALLBACK_PREFILL_LOST)

    def fallbacks(reasons=reasons) -> float:
        s = scrape(url)
        return sum(s.get(f'{m.ROUTER_FALLBACKS}{{reason="{r}"}}', 0) for r in reasons)
    before = fallbacks()
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = [f"request {i}: " + PROMPTS[1] for i in range(6)]
    failures["proxy"].arm(failures["prefill"].kill, FAILURE_PROMPT)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        others = [pool.submit(_complete, client, p) for p in prompts[:3]]
        killed = pool.submit(_stream, failures)
        assert failures["proxy"].done.wait(300), "the proxy never saw the prefill answer"
        others += [pool.submit(_complete, client, p) for p in prompts[3:]]
        route, text, chunks = killed.result(timeout=300)
        texts = [f.result(timeout=300) for f in others]
    assert failures["prefill"].proc.poll() is not None
    assert text == want
    path, reason = route["x-disagg-path"], route.get("x-disagg-fallback")
    assert path == m.PATH_FALLBACK and reason in reasons
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS_LONG
    assert fallbacks() >= before + 1
    _assert_fallback_trace(jaeger, route, reason)
    empty = [p for p, t in zip(prompts, texts) if not (isinstance(t, str) and t)]
    assert not empty
    raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert raw.headers["x-disagg-path"] != m.PATH_REMOTE_PREFILL
