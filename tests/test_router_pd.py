"""A prefill and a decode vLLM (CPU build, tiny model) with real NIXL transfer, behind the router,
answering the official openai client; the reference is one aggregated vLLM server."""

from __future__ import annotations

import concurrent.futures
import json

import pytest
from openai import OpenAI

from disagg.api import metrics as m
from disagg.workers.local import cpu_settings, free_port, metric_sum, router, scrape, wait_metric, worker
from disagg.workers.testing import tiny_model, worker_python  # noqa: F401  (fixtures)

PROMPTS = ["def parse_args(argv): return the namespace of", "The quick brown fox jumps over the lazy dog " * 6]
CHATS = [[{"role": "user", "content": "Say hello to the parser."}],
         [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Wrap this text " * 10}]]
MAX_TOKENS = 12


def _complete(client: OpenAI, prompt: str) -> str:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     seed=7).choices[0].text


def _chat(client: OpenAI, messages) -> str:
    return client.chat.completions.create(model="tiny", messages=messages, max_tokens=MAX_TOKENS,
                                          temperature=0).choices[0].message.content


@pytest.fixture(scope="module")
def reference(tiny_model, worker_python, tmp_path_factory):
    """What one ordinary (aggregated, no NIXL) vLLM server answers, at temperature 0."""
    logs = tmp_path_factory.mktemp("reference")
    agg = worker("aggregated", cpu_settings("decode", tiny_model, "0-1", kv_transfer=False), worker_python, logs)
    agg.start()
    try:
        agg.wait_ready()
        client = OpenAI(base_url=f"{agg.url}/v1", api_key="unused")
        answers = {"completions": [_complete(client, p) for p in PROMPTS], "chat": [_chat(client, c) for c in CHATS]}
    finally:
        agg.stop()          # before the P/D workers start: two cores are all there is
    return answers


@pytest.fixture(scope="module")
def pd(reference, tiny_model, worker_python, tmp_path_factory):
    """prefill (core 0) + decode (core 1) + the router, disaggregating every request."""
    logs = tmp_path_factory.mktemp("pd")
    prefill_s = cpu_settings("prefill", tiny_model, "0")
    decode_s = cpu_settings("decode", tiny_model, "1")
    port = free_port()
    # no max_model_len: the router learns the workers' (1024, cpu_settings) from their /v1/models
    config = {"model": "tiny", "tokenizer": tiny_model, "block_size": prefill_s.block_size, "port": port,
              "host": "127.0.0.1", "spec": {"disaggregation": "always"}, "health_interval_s": 60,
              # vLLM CPU workers sometimes stall for one NIXL lease (30 s) on a loaded 2-core machine; the
              # test checks the P/D path, so a slow prefill must not turn into a (correct) fallback
              "prefill_timeout_s": 120,
              "prefill": [{"url": f"http://127.0.0.1:{prefill_s.port}",
                           "kv_events": f"tcp://127.0.0.1:{prefill_s.kv_events_port}"}],
              "decode": [{"url": f"http://127.0.0.1:{decode_s.port}",
                          "kv_events": f"tcp://127.0.0.1:{decode_s.kv_events_port}"}]}
    (logs / "router.json").write_text(json.dumps(config))
    procs = {"prefill": worker("prefill", prefill_s, worker_python, logs),
             "decode": worker("decode", decode_s, worker_python, logs),
             "router": router(logs / "router.json", port, logs)}
    try:
        for name in ("prefill", "decode"):
            procs[name].start()
        for name in ("prefill", "decode"):
            procs[name].wait_ready()
        procs["router"].start().wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


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



def test_prefill_killed_mid_run_requests_complete_by_local_prefill(pd):
    client = OpenAI(base_url=f"{pd['router'].url}/v1", api_key="unused", max_retries=0)
    before = metric_sum(scrape(pd["router"].url), m.ROUTER_FALLBACKS)
    prompts = [f"request {i}: " + PROMPTS[1] for i in range(6)]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        running = [pool.submit(_complete, client, p) for p in prompts[:3]]
        pd["prefill"].kill()
        running += [pool.submit(_complete, client, p) for p in prompts[3:]]
        texts = [f.result(timeout=120) for f in running]
    assert all(isinstance(t, str) and t for t in texts)
    after = scrape(pd["router"].url)
    assert metric_sum(after, m.ROUTER_FALLBACKS) > before
    assert after.get(f'{m.ROUTER_REQUESTS}{{outcome="success",path="{m.PATH_FALLBACK}"}}', 0) >= 1
    raw = client.completions.with_raw_response.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert raw.headers["x-disagg-path"] != m.PATH_REMOTE_PREFILL, dict(raw.headers)

