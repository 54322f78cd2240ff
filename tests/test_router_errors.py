"""Bad requests get 400s (404 for an unknown model) with OpenAI error bodies naming the problem;
no workers gets 503. The router runs as a process with the model's real tokenizer and no workers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest

from disagg.workers.local import free_port, router


@pytest.fixture(scope="module")
def url(tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("router-errors")
    port = free_port()
    (logs / "router.json").write_text(json.dumps({
        "model": "tiny", "tokenizer": tiny_model, "block_size": 32, "max_model_len": 256, "port": port, "host": "127.0.0.1",
        "spec": {"maxBodyBytes": 64 * 1024}, "prefill": [], "decode": []}))
    p = router(logs / "router.json", port, logs).start()
    try:
        p.wait_ready(path="/v1/models", timeout=60)
        yield p.url
    finally:
        p.stop()


def _post(url: str, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


GOOD = {"model": "tiny", "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("body,status,param,words", [
    (b"{not json", 400, None, "not valid JSON"),
    (b"[1, 2]", 400, None, "JSON object"),
    (json.dumps({"prompt": "x"}).encode(), 400, "model", "Field required"),
    (json.dumps({**GOOD, "max_tokens": 0}).encode(), 400, "max_tokens", "greater than or equal to 1"),
    (json.dumps({**GOOD, "temperature": 9}).encode(), 400, "temperature", "less than or equal to 2"),
    (json.dumps({**GOOD, "n": 3}).encode(), 400, "n", "1"),
    (json.dumps({**GOOD, "prompt": ""}).encode(), 400, "prompt", "at least 1"),
    (json.dumps({**GOOD, "prompt": "word " * 400}).encode(), 400, "prompt", "context is 256 tokens"),
    (json.dumps({**GOOD, "prompt": "word " * 5000}).encode(), 400, "prompt", "context is 256 tokens"),
    (json.dumps({**GOOD, "max_tokens": 250, "prompt": "word " * 20}).encode(), 400, "max_tokens", "exceed"),
    (json.dumps({**GOOD, "kv_transfer_params": {"do_remote_prefill": True}}).encode(), 400,
     "kv_transfer_params", "None"),
    (json.dumps({**GOOD, "prompt": "x" * 100_000}).encode(), 413, None, "larger than the router accepts"),
    (json.dumps({**GOOD, "model": "gpt-9"}).encode(), 404, "model", "gpt-9"),
], ids=["malformed", "not-object", "no-model", "max-tokens", "temperature", "n", "empty-prompt",
        "prompt-too-long", "long-prompt-tokenized-off-loop", "prompt-plus-output-too-long", "kv-params-from-client", "oversized-body",
        "unknown-model"])
def test_bad_completion_requests(url, body, status, param, words):
    code, err = _post(url, "/v1/completions", body)
    assert code == status
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["code"] == status and words in err["error"]["message"]
    assert err["error"]["param"] == param


def test_bad_chat_request_names_the_field(url):
    code, err = _post(url, "/v1/chat/completions",
                      json.dumps({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}).encode())
    assert code == 400 and err["error"]["param"] == "messages.0.role"
    code, err = _post(url, "/v1/chat/completions", json.dumps({"model": "tiny", "messages": []}).encode())
    assert code == 400 and err["error"]["param"] == "messages"


def test_no_workers_is_503_through_the_openai_client(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], stream=True)
    assert e.value.status_code == 503
    assert e.value.body["type"] == "service_unavailable" and "no healthy decode workers" in e.value.body["message"]


def test_unknown_route_is_an_openai_error(url):
    code, err = _post(url, "/v1/embeddings", b"{}")
    assert code == 404 and err["error"]["code"] == 404
