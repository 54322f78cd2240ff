"""Mid-stream migration against real HTTP upstreams that die mid-stream (tests/sse_upstream.py, cut after
a few tokens) and the router as its own process: the stream is continued from the token ids generated so
far as one client stream (one id, every token once, usage of the whole), the ids the router asked for are
not shown to a client that did not ask for them, and a request whose continuations keep failing ends,
after spec.router.maxMigrations, with an OpenAI error event. Each counted.
The same with real vLLM workers (exact text at temperature 0): tests/test_router_pd.py."""

from __future__ import annotations

import json
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from disagg.api import metrics as m
from disagg.workers.local import scrape

TOKENS, CUT = 20, 5


@contextmanager
def _routed(routers, tiny_model: str, logs: Path, name: str, cut: str, spec: dict):
    """A router in front of one decode upstream whose streams die after CUT tokens (`cut`: the first
    stream only, or continuations too)."""
    from disagg.router.tokenizer import Tokenizer

    tok_id = Tokenizer(tiny_model)._encode("tok ", add_special_tokens=False)[0]    # its text is whole
    up = routers.upstream(logs, f"{name}-upstream", TOKENS, 0.005, CUT, cut, env={"SSE_TOKEN_ID": str(tok_id)})
    with routers.serving(tiny_model, logs, [up], name=name, spec=spec, health_interval_s=60) as r:
        yield r


@pytest.fixture(scope="module")
def dies_once(routers, tiny_model, tmp_path_factory):
    """One decode worker whose every stream dies after CUT tokens; continuations (token-id prompts) run
    to the end. With one worker the continuation goes back to it: it is alive (a real dead worker is
    the vLLM test's)."""
    with _routed(routers, tiny_model, tmp_path_factory.mktemp("dies-once"), "dies-once", "first", {}) as r:
        yield r


@pytest.fixture(scope="module")
def dies_always(routers, tiny_model, tmp_path_factory):
    """Every stream dies after CUT tokens, continuations too; at most 2 migrations."""
    with _routed(routers, tiny_model, tmp_path_factory.mktemp("dies-always"), "dies-always", "all",
                 {"maxMigrations": 2}) as r:
        yield r


def _events(url: str, endpoint: str, body: dict) -> list[dict]:
    req = urllib.request.Request(f"{url}{endpoint}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = [line.decode().rstrip("\n") for line in r if line.startswith(b"data: ")]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_a_stream_cut_mid_way_is_continued_as_one_stream(dies_once):
    before = scrape(dies_once.url).get(f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_MIGRATED}"}}', 0)
    client = OpenAI(base_url=f"{dies_once.url}/v1", api_key="unused", max_retries=0)
    chunks = list(client.completions.create(model="tiny", prompt="x", max_tokens=TOKENS, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "tok " * TOKENS
    assert len({c.id for c in chunks}) == 1
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (3, TOKENS)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    chat = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                               max_tokens=TOKENS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == "tok " * TOKENS
    assert {c.object for c in chat} == {"chat.completion.chunk"} and len({c.id for c in chat}) == 1
    assert all(c.usage is None for c in chat)              # not asked for
    after = scrape(dies_once.url)
    assert after[f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_MIGRATED}"}}'] == before + 2
    assert after[f'{m.ROUTER_REQUESTS}{{outcome="success",path="{m.PATH_LOCAL_PREFILL}"}}'] >= 2


def test_token_ids_reach_only_a_client_that_asked(dies_once):
    plain = _events(dies_once.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": TOKENS,
                                                        "stream": True})
    assert not any("token_ids" in c["choices"][0] or "prompt_token_ids" in c["choices"][0] for c in plain)
    asked = _events(dies_once.url, "/v1/chat/completions",
                    {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": TOKENS,
                     "stream": True, "return_token_ids": True})
    assert sum(len(c["choices"][0].get("token_ids") or []) for c in asked) == TOKENS
    assert [c.get("prompt_token_ids") for c in asked if c.get("prompt_token_ids")] == [[1, 2, 3]]


def test_migrations_are_bounded_then_the_client_gets_an_error_event(dies_always):
    before = scrape(dies_always.url)
    client = OpenAI(base_url=f"{dies_always.url}/v1", api_key="unused", max_retries=0)
    stream = client.completions.create(model="tiny", prompt="x", max_tokens=TOKENS, stream=True)
    text = []
    with pytest.raises(openai.APIError) as err:
        for c in stream:
            text.append(c.choices[0].text)
    assert "".join(text) == "tok " * (3 * CUT)             # the first stream and two continuations
    assert "decode worker" in str(err.value)
    after = scrape(dies_always.url)

    def grew(series: str) -> float:
        return after.get(series, 0) - before.get(series, 0)
    assert grew(f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_MIGRATED}"}}') == 2
    assert grew(f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_EXHAUSTED}"}}') == 1
    assert grew(f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_UPSTREAM_ERROR}",path="{m.PATH_LOCAL_PREFILL}"}}') == 1


def test_a_request_migration_cannot_continue_exactly_is_not_migrated(dies_once):
    """logprobs: the continuation's would not be the original's; the client gets the error event."""
    before = scrape(dies_once.url).get(f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_UNSUPPORTED}"}}', 0)
    client = OpenAI(base_url=f"{dies_once.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIError):
        for _ in client.completions.create(model="tiny", prompt="x", max_tokens=TOKENS, stream=True, logprobs=1):
            pass
    after = scrape(dies_once.url)[f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_UNSUPPORTED}"}}']
    assert after == before + 1


def test_a_continuation_starts_where_the_text_is_whole(tiny_model):
    """Generated ids that end inside a UTF-8 character (vLLM held their text back) are generated again by
    the continuation: a prompt ending inside a character would have vLLM print the whole prompt as the
    continuation's first text. Their ids, which a client that asked already has, are not sent twice."""
    from disagg.router.migration import TokenLog
    from disagg.router.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model)
    prompt = tok._encode("Hello there", add_special_tokens=False)
    word = tok._encode(" world", add_special_tokens=False)
    euro = tok._encode("€", add_special_tokens=False)          # 3 bytes: 3 byte tokens in this vocabulary
    assert len(euro) >= 2 and tok.decode(euro[:1]).endswith("\ufffd")
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 50, "return_token_ids": True}
    log = TokenLog("/v1/completions", body, prompt, tok.decode)
    first = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny", "choices": [
        {"index": 0, "text": " world", "prompt_token_ids": prompt, "token_ids": word + euro[:1]}]},
        separators=(",", ":"))
    log.scan(b"data: " + first.encode())
    assert log.generated() == word + euro[:1]
    assert log.resume_at() == len(word)
    cont = log.continuation()
    assert cont["prompt"] == prompt + word and cont["max_tokens"] == 50 - len(word)
    log.start_continuation()
    nxt = json.dumps({"id": "cmpl-2", "object": "text_completion", "created": 2, "model": "tiny", "choices": [
        {"index": 0, "text": "€", "prompt_token_ids": None, "token_ids": euro}]}, separators=(",", ":"))
    out = json.loads(log.scan(b"data: " + nxt.encode())[6:])
    assert out["id"] == "cmpl-1" and out["choices"][0]["text"] == "€"
    assert out["choices"][0]["token_ids"] == euro[1:]            # the first the client had
    assert log.generated() == word + euro


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "not-streamed"])
def test_a_decode_waiting_for_kv_from_a_lost_prefill_is_given_up(routers, tiny_model, tmp_path, stream):
    """The prefill answers (KV params) and dies; the decode it handed them to waits for that KV for ever
    (SSE_KV_WAIT, as vLLM pulling from a hung engine: a stream's headers and no token, or no answer at
    all). Once the router's probe finds the prefill gone, it gives that decode up and the request
    prefills locally: completed, named, counted; streamed or not."""
    prefill = routers.upstream(tmp_path, "prefill", TOKENS, 0.005, env={"SSE_EXIT_AFTER_PREFILL": "1"})
    decode = routers.upstream(tmp_path, "decode", TOKENS, 0.005, env={"SSE_KV_WAIT": "1"})
    with routers.serving(tiny_model, tmp_path, [decode], prefill=[prefill], spec={"disaggregation": "always"},
                         health_interval_s=0.5) as r:
        client = OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0, timeout=120)
        raw = client.completions.with_raw_response.create(model="tiny", prompt="x", max_tokens=TOKENS, stream=stream)
        route = (raw.headers["x-disagg-path"], raw.headers.get("x-disagg-fallback"))
        assert route == (m.PATH_FALLBACK, m.FALLBACK_PREFILL_LOST)
        answer = raw.parse()
        text = "".join(c.choices[0].text for c in answer if c.choices) if stream else answer.choices[0].text
        assert text == "tok " * TOKENS
        assert prefill.proc.poll() is not None                 # it did die after it answered
        s = scrape(r.url)
        assert s[f'{m.ROUTER_FALLBACKS}{{reason="{m.FALLBACK_PREFILL_LOST}"}}'] == 1
        assert s[f'{m.ROUTER_REQUESTS}{{outcome="success",path="{m.PATH_FALLBACK}"}}'] == 1


def test_a_continuation_waiting_for_kv_from_a_lost_prefill_is_given_up(routers, tiny_model, tmp_path):
    """A stream cut mid-way is continued P/D: the prefill answers the continuation (KV params) and dies,
    and the decode waits for that KV for ever. Once the router's probe finds the prefill gone, the
    continuation is given up there and prefilled by the decode worker: the client's one stream ends
    whole, counted as a migration and a prefill_lost fallback, well before the first-token timeout."""
    from disagg.router.tokenizer import Tokenizer

    tok_id = Tokenizer(tiny_model)._encode("tok ", add_special_tokens=False)[0]
    prefill = routers.upstream(tmp_path, "prefill", TOKENS, 0.005, env={"SSE_EXIT_AFTER_PREFILL": "continuation"})
    decode = routers.upstream(tmp_path, "decode", TOKENS, 0.005, CUT, "first",
                              env={"SSE_KV_WAIT": "continuation", "SSE_TOKEN_ID": str(tok_id)})
    with routers.serving(tiny_model, tmp_path, [decode], prefill=[prefill], spec={"disaggregation": "always"},
                         health_interval_s=0.5) as r:
        events = _events(r.url, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": TOKENS,
                                                     "stream": True})
        assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == "tok " * TOKENS
        assert len({e["id"] for e in events}) == 1
        assert prefill.proc.poll() is not None                 # it did die after answering the continuation
        s = scrape(r.url)
        assert s[f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_MIGRATED}"}}'] == 1
        assert s[f'{m.ROUTER_FALLBACKS}{{reason="{m.FALLBACK_PREFILL_LOST}"}}'] == 1


def test_a_prompt_not_tokenized_up_front_is_tokenized_only_when_a_continuation_needs_it():
    """A router that skips tokenizing (round-robin or least-loaded, disaggregation never) hands the log a
    way to get the prompt's ids: called only when a continuation asks for the prompt and the worker's
    first chunk did not carry it; the worker's ids, when sent, are used instead."""
    from disagg.router.migration import TokenLog

    calls = []

    def lazy() -> list[int]:
        calls.append(1)
        return [1, 2, 3]

    def chunk(prompt_ids) -> bytes:
        return b"data: " + json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": "tiny",
                                       "choices": [{"index": 0, "text": "x", "prompt_token_ids": prompt_ids,
                                                    "token_ids": [7]}]}, separators=(",", ":")).encode()

    body = {"model": "tiny", "prompt": "abc", "max_tokens": 5}
    told = TokenLog("/v1/completions", body, lazy)
    told.scan(chunk([4, 5]))
    assert told.prompt == [4, 5] and not calls
    silent = TokenLog("/v1/completions", body, lazy)
    silent.scan(chunk(None))
    assert not calls
    assert silent.prompt == [1, 2, 3] and silent.prompt == [1, 2, 3] and len(calls) == 1


def test_a_router_that_does_not_tokenize_counts_prompt_tokens_from_the_workers_usage(routers, tiny_model, tmp_path):
    """Round-robin with disaggregation never skips tokenizing: the prompt-token metrics then come from
    the worker's usage (the upstream reports 3 prompt tokens a stream, 1 a non-streamed answer), once
    each request succeeds, whether or not the client asked for usage."""
    up = routers.upstream(tmp_path, "upstream", TOKENS, 0.001)
    with routers.serving(tiny_model, tmp_path, [up], spec={"policy": "round-robin"}) as r:
        body = {"model": "tiny", "prompt": "x", "max_tokens": 4, "stream": True}
        assert all("usage" not in e or e["usage"] is None for e in _events(r.url, "/v1/completions", body))
        _events(r.url, "/v1/completions", dict(body, stream_options={"include_usage": True}))
        OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0).completions.create(
            model="tiny", prompt="x", max_tokens=4)
        s = scrape(r.url)
        assert s[f"{m.ROUTER_INPUT_TOKENS}_count"] == 3
        assert s[f"{m.ROUTER_INPUT_TOKENS}_sum"] == 3 + 3 + 1
        assert s[m.ROUTER_PROMPT_TOKENS] == 7
        assert s[m.ROUTER_CACHED_PROMPT_TOKENS] == 0
