"""Workers that die under a request, with real vLLM (CPU build, tiny model) and real NIXL transfer: a
prefill and two decode workers behind the router, disaggregating every request.

- A decode worker killed (SIGKILL) mid-stream: the router continues the client's stream on the other decode
  worker from the token ids generated so far; at temperature 0 the client's text is the uninterrupted
  run's, its usage counts every token once, and the migration is counted.
- A prefill worker hung (SIGSTOP) right after it answered: the request completes with the same text,
  never hangs. Whether the decode's pull needs the stopped engine varies from run to run here (seen: it
  waited, and the router gave it up when its probes found the prefill unhealthy, prefill_lost; and it
  went through); a decode that waits for ever is tests/test_router_migration.py's.
- A prefill worker killed right after it answered (its KV computed, not yet pulled by the decode): vLLM
  fails the decode's KV load; the request still completes, by local prefill, with the same text; counted.

Mid-stream is made deterministic by counting: the decode is killed once the client holds KILL_AFTER
tokens of a stream MAX_TOKENS long (ignore_eos: it cannot end earlier)."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disagg.api import metrics as m
from disagg.e2e.testing import wait_for
from disagg.workers.local import cpu_settings, free_port, router, scrape, stop_all, worker
from disagg.workers.testing import tiny_model, worker_python  # noqa: F401  (fixtures)

# Out of `make test` for now, visibly (a skip with its reason): three vLLM engines on two cores start in
# 3-6 minutes or not within the 300 s wait, and the hung-prefill case failed once in a clean-clone run.
# The deterministic checks of migration and prefill_lost run in tests/test_router_migration.py against
# real HTTP upstreams; this module is their real-engine proof, run on purpose until its workers share
# tests/test_router_pd.py's pair (one more decode) instead of starting their own.
pytestmark = pytest.mark.skipif(not os.environ.get("DISAGG_PD_FAILURES"),
                                reason="three CPU vLLM engines on two cores: set DISAGG_PD_FAILURES=1 to run")

PROMPT = "The quick brown fox jumps over the lazy dog " * 6
MAX_TOKENS, KILL_AFTER = 160, 16


class _KillingProxy:
    """HTTP in front of the prefill worker: passes requests through; once armed with an action (kill or
    stop the prefill worker), it runs it after the worker answered a request and before the router gets
    that answer, so the decode is handed KV held by a dead or hung engine."""

    def __init__(self, target: str):
        self.target, self.action, self.done = target, None, threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _pass(self, body: bytes | None):
                req = urllib.request.Request(f"{proxy.target}{self.path}", data=body, method=self.command,
                                             headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(req, timeout=300) as r:
                        status, data = r.status, r.read()
                except urllib.error.HTTPError as e:
                    status, data = e.code, e.read()
                except OSError:
                    status, data = 502, b'{"error": {"message": "prefill unreachable"}}'
                if proxy.action is not None and self.command == "POST" and status == 200:
                    action, proxy.action = proxy.action, None
                    action()
                    proxy.done.set()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._pass(None)

            def do_POST(self):
                self._pass(self.rfile.read(int(self.headers.get("Content-Length", 0))))

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def arm(self, action) -> None:
        self.done.clear()
        self.action = action

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def pd2(tiny_model, worker_python, tmp_path_factory):
    """prefill (core 0), decode-a (core 1), decode-b (core 0) and the router; every request P/D."""
    logs = tmp_path_factory.mktemp("pd-failures")
    s = {"prefill": cpu_settings("prefill", tiny_model, "0"), "decode-a": cpu_settings("decode", tiny_model, "1"),
         "decode-b": cpu_settings("decode", tiny_model, "0")}
    procs = {name: worker(name, st, worker_python, logs) for name, st in s.items()}
    proxy = _KillingProxy(f"http://127.0.0.1:{s['prefill'].port}")
    port = free_port()

    def endpoint(st, url=None):
        return {"url": url or f"http://127.0.0.1:{st.port}", "kv_events": f"tcp://127.0.0.1:{st.kv_events_port}",
                "kv_replay": f"tcp://127.0.0.1:{st.kv_replay_port}"}
    config = {"model": "tiny", "tokenizer": tiny_model, "block_size": s["prefill"].block_size, "port": port,
              # probes every second: a hung prefill is found (3 probe timeouts of 2 s) within seconds
              "host": "127.0.0.1", "max_model_len": s["prefill"].max_model_len, "health_interval_s": 1,
              "spec": {"disaggregation": "always", "policy": "round-robin"},
              # a slow prefill on a loaded 2-core machine must not turn into a (correct) fallback
              "prefill_timeout_s": 120,
              "prefill": [endpoint(s["prefill"], proxy.url)],
              "decode": [endpoint(s["decode-a"]), endpoint(s["decode-b"])]}
    (logs / "router.json").write_text(json.dumps(config))
    procs["router"] = router(logs / "router.json", port, logs)
    try:
        for name in s:
            procs[name].start()
        for name in s:
            procs[name].wait_ready()
        procs["router"].start().wait_ready()
        procs["proxy"] = proxy
        yield procs
    finally:
        stop_all([p for name, p in procs.items() if name != "proxy"])
        proxy.close()


def _stream(url: str, on_chunk=None) -> tuple[dict, str, list[dict]]:
    """One streamed completion at temperature 0: (route headers, text, chunks); ``on_chunk(route, n)``
    after the n-th token chunk."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks, text = [], []
    with urllib.request.urlopen(req, timeout=300) as r:
        route = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-disagg-")}
        for line in r:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            chunks.append(event)
            if event["choices"]:
                text.append(event["choices"][0]["text"])
                if on_chunk:
                    on_chunk(route, len(text))
    return route, "".join(text), chunks


def test_a_decode_killed_mid_stream_is_continued_with_the_same_text(pd2):
    url = pd2["router"].url
    route, want, chunks = _stream(url)                    # uninterrupted
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    before = scrape(url).get(f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_MIGRATED}"}}', 0)
    by_url = {p.url: p for name, p in pd2.items() if name.startswith("decode")}

    def kill_at(route: dict, n: int) -> None:
        if n == KILL_AFTER:
            by_url[route["x-disagg-decode"]].kill()

    route, text, chunks = _stream(url, kill_at)
    assert by_url[route["x-disagg-decode"]].proc.poll() is not None     # it was killed mid-stream
    assert text == want
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-1]["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": MAX_TOKENS,
                                   "total_tokens": prompt_tokens + MAX_TOKENS}
    after = scrape(url)
    assert after[f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_MIGRATED}"}}'] == before + 1


def _prefill_healthy(url: str) -> None:
    """Until the router counts the prefill worker healthy (it routes to it again)."""
    wait_for(lambda: scrape(url).get(f'{m.ROUTER_WORKERS}{{role="prefill",state="healthy"}}') == 1, 120,
             "the router to count the prefill worker healthy")


def test_a_prefill_hung_after_it_answered_leaves_no_decode_waiting(pd2):
    url = pd2["router"].url
    _prefill_healthy(url)
    _, want, _ = _stream(url)
    series = f'{m.ROUTER_FALLBACKS}{{reason="{m.FALLBACK_PREFILL_LOST}"}}'
    before = scrape(url).get(series, 0)
    group = pd2["prefill"].proc.pid             # its own session: the worker's process group
    pd2["proxy"].arm(lambda: os.killpg(group, signal.SIGSTOP))
    try:
        route, text, chunks = _stream(url)
    finally:
        os.killpg(group, signal.SIGCONT)
    assert pd2["proxy"].done.is_set()
    assert text == want
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    if route["x-disagg-path"] == m.PATH_FALLBACK:      # the decode waited: given up, counted
        assert route.get("x-disagg-fallback") in (m.FALLBACK_PREFILL_LOST, m.FALLBACK_KV_TRANSFER)
        assert scrape(url)[f'{m.ROUTER_FALLBACKS}{{reason="{route["x-disagg-fallback"]}"}}'] >= 1
    else:
        assert route["x-disagg-path"] == m.PATH_REMOTE_PREFILL
        assert scrape(url).get(series, 0) == before


def test_a_prefill_killed_after_it_answered_leaves_no_decode_waiting(pd2):
    """The decode is handed KV that a dead engine holds. vLLM's NIXL connector (0.32,
    kv_load_failure_policy "fail", the default) fails such a request instead of waiting: the handshake
    or the read fails and the request ends with an error before its first token. The router then
    serves it by local prefill on a decode worker (kv_transfer_failed), unless its probes found the prefill
    dead first (prefill_lost: the same local prefill); the client sees the same text."""
    url = pd2["router"].url
    _, want, _ = _stream(url)                             # the prefill still alive
    reasons = (m.FALLBACK_KV_TRANSFER, m.FALLBACK_PREFILL_LOST)

    def fallbacks() -> float:
        s = scrape(url)
        return sum(s.get(f'{m.ROUTER_FALLBACKS}{{reason="{r}"}}', 0) for r in reasons)
    before = fallbacks()
    _prefill_healthy(url)
    pd2["proxy"].arm(pd2["prefill"].kill)
    route, text, chunks = _stream(url)
    assert pd2["proxy"].done.is_set() and pd2["prefill"].proc.poll() is not None
    assert text == want
    assert route["x-disagg-path"] == m.PATH_FALLBACK and route.get("x-disagg-fallback") in reasons
    assert chunks[-1]["usage"]["completion_tokens"] == MAX_TOKENS
    assert fallbacks() == before + 1
