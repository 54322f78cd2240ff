"""What the router reads from a worker is bounded (router/config.py): a non-streamed answer over
MAX_ANSWER_BYTES is a 502 in OpenAI's shape and a counted upstream_error, never the whole answer held
in memory; a worker's error body is cut at MAX_ERROR_BODY_BYTES; a KV event replay over
MAX_KV_REPLAY_BYTES counts as no replay. The workers are real HTTP servers (an aiohttp app written below,
started through the ``routers`` fixture as tests/sse_upstream.py is) and a real ZMQ ROUTER socket."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
import zmq
import zmq.asyncio

from disagg.api import metrics as m
from disagg.router.config import MAX_ANSWER_BYTES, MAX_ERROR_BODY_BYTES, MAX_KV_REPLAY_BYTES
from disagg.router.events import END_SEQ, fetch_replay
from disagg.workers.local import metric_sum, scrape

OVER = MAX_ANSWER_BYTES + 16 * 2**20        # a worker's answer past the bound, by a margin

# The prompt says what the worker does: a 200 answer larger than the router reads (chunked, or with its
# Content-Length), or a 400 whose error body is; anything else is refused as vLLM refuses a prompt past
# its context (a 400 in OpenAI's shape, the message the client must get).
HOSTILE_WORKER = f'''
import json, sys
from aiohttp import web

OVER = {OVER}
HEAD = b'{{"id": "x", "object": "text_completion", "model": "tiny", "choices": [{{"index": 0, "text": "'
TAIL = b'", "finish_reason": "length"}}]}}'


async def generate(request):
    body = await request.json()
    prompt = body.get("prompt") or ""
    if prompt.startswith("huge-length"):
        return web.Response(body=HEAD + b"a" * OVER + TAIL, content_type="application/json")
    if prompt.startswith("huge"):
        status = 400 if prompt.startswith("huge-error") else 200
        resp = web.StreamResponse(status=status, headers={{"Content-Type": "application/json"}})
        await resp.prepare(request)
        await resp.write(b'{{"error": {{"message": "' if status == 400 else HEAD)
        sent = 0
        try:
            while sent < OVER:
                await resp.write(b"a" * 2**20)
                sent += 2**20
            await resp.write(b'"}}}}' if status == 400 else TAIL)
        except ConnectionError:         # the router stopped reading, as it must
            return resp
        await resp.write_eof()
        return resp
    return web.json_response({{"error": {{"message": "This model's maximum context length is 1024 tokens. However, "
                                                     "you requested 2000 tokens.", "type": "BadRequestError",
                                          "param": None, "code": 400}}}}, status=400)


async def health(request):
    return web.Response(text="ok")


app = web.Application(client_max_size=2**20)
app.router.add_post("/v1/completions", generate)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
'''


@pytest.fixture(scope="module")
def served(routers, tiny_model, tmp_path_factory):
    """A router that does not tokenize (round-robin, no disaggregation: the worker refuses over-long
    prompts) in front of the hostile worker, one decode attempt."""
    logs = tmp_path_factory.mktemp("worker-bounds")
    script = logs / "hostile_worker.py"
    script.write_text(HOSTILE_WORKER)
    worker = routers.upstream(logs, "hostile-worker", script=str(script))
    with routers.serving(tiny_model, logs, [worker], spec={"policy": "round-robin"}, decode_attempts=1) as r:
        yield r


def _post(url: str, prompt: str, stream: bool = False) -> tuple[int, bytes]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "stream": stream}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.mark.parametrize("prompt", ["huge-chunked", "huge-length"])
def test_an_answer_larger_than_the_router_reads_is_a_502_and_an_upstream_error(served, prompt):
    before = metric_sum(scrape(served.url), m.ROUTER_REQUESTS)
    errors = scrape(served.url).get(f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_UPSTREAM_ERROR}",'
                                    f'path="{m.PATH_LOCAL_PREFILL}"}}', 0)
    status, body = _post(served.url, prompt)
    assert status == 502, (status, body[:300])
    err = json.loads(body)["error"]
    assert err["type"] == "upstream_error" and f"({MAX_ANSWER_BYTES} bytes)" in err["message"], err
    s = scrape(served.url)
    assert metric_sum(s, m.ROUTER_REQUESTS) == before + 1
    assert s[f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_UPSTREAM_ERROR}",path="{m.PATH_LOCAL_PREFILL}"}}'] == \
        errors + 1
    assert served.proc.poll() is None


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_an_error_body_larger_than_the_router_reads_is_cut(served, stream):
    """The worker's 400 is passed on (its status, OpenAI's shape) without its body: cut at
    MAX_ERROR_BODY_BYTES it is no JSON, so the message is the router's own."""
    status, body = _post(served.url, "huge-error", stream)
    assert status == 400, (status, body[:300])
    assert len(body) < MAX_ERROR_BODY_BYTES, len(body)
    err = json.loads(body)["error"]
    assert err["message"] == "the worker refused the request (HTTP 400)", err


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_workers_refusal_is_passed_on_and_counted_as_upstream_rejected(served, stream):
    """A prompt past the context, refused by the worker (the router does not tokenize here): the client
    gets the worker's 400 and message, and the request is counted (it was counted nowhere)."""
    key = f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_UPSTREAM_REJECTED}",path="{m.PATH_LOCAL_PREFILL}"}}'
    before = scrape(served.url)
    status, body = _post(served.url, "a prompt past the context", stream)
    assert status == 400, body
    err = json.loads(body)["error"]
    assert "maximum context length" in err["message"] and err["type"] == "BadRequestError", err
    after = scrape(served.url)
    assert after.get(key, 0) == before.get(key, 0) + 1
    assert metric_sum(after, m.ROUTER_REQUESTS) == metric_sum(before, m.ROUTER_REQUESTS) + 1


class _Replayer:
    """A KV event replay socket (vLLM's: a ZMQ ROUTER) that answers any request with ``batches`` batches of
    ``size`` bytes each, then the end marker."""

    def __init__(self, batches: int, size: int) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.batches, self.size, self.sent = batches, size, 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            identity, _, _start = self.sock.recv_multipart()
            payload = b"x" * self.size
            for seq in range(self.batches):
                self.sock.send_multipart((identity, b"", b"kv-events", seq.to_bytes(8, "big"), payload))
                self.sent += 1
            self.sock.send_multipart((identity, b"", b"kv-events", END_SEQ.to_bytes(8, "big"), b""))
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self.sock.close(linger=0)
        self._thread.join(timeout=30)
        self.ctx.term()


def _fetch(endpoint: str, timeout: float = 30):
    async def ask():
        ctx = zmq.asyncio.Context()
        try:
            return await fetch_replay(ctx, endpoint, 0, timeout=timeout)
        finally:
            ctx.term()
    return asyncio.run(ask())


def test_a_replay_larger_than_the_router_reads_counts_as_none():
    batch = 2**20
    over = _Replayer(MAX_KV_REPLAY_BYTES // batch + 8, batch)
    try:
        assert _fetch(over.endpoint) is None
    finally:
        over.close()
    within = _Replayer(4, batch)               # and one within the bound is taken whole
    try:
        got = _fetch(within.endpoint)
        assert [(seq, len(p)) for seq, p in got] == [(i, batch) for i in range(4)]
    finally:
        within.close()
