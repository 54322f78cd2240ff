"""The worker's metrics port (workers/metrics_port.py) relays vLLM's /metrics and nothing else, so a
NetworkPolicy that admits Prometheus there admits it to no model API; and the default KV buffer device
follows the worker's build. The upstream here is a plain HTTP server standing in for vLLM's API port
(its /metrics and its /v1 routes); the real relay in front of a real vLLM runs in tests/test_dashboards.py
and, in pods, in tests/test_e2e_realnode.py."""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from disagg.workers import metrics_port
from disagg.workers.command import build, kv_transfer_config
from disagg.workers.settings import WorkerSettings

METRICS = b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 2.0\n"


class _Engine(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = METRICS if self.path == "/metrics" else b'{"object": "list", "data": [{"id": "tiny"}]}'
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4" if self.path == "/metrics" else "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *_):
        pass


@pytest.fixture
def engine():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Engine)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


def _get(url: str, data: bytes | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_metrics_port_serves_metrics_and_no_api(engine):
    relay = metrics_port.serve(0, engine, host="127.0.0.1")
    try:
        base = f"http://127.0.0.1:{relay.server_address[1]}"
        assert _get(f"{base}/metrics") == (200, METRICS)
        # the engine answers these on its own port; the relay never does
        for path in ("/v1/models", "/v1/completions", "/health", "/metrics/../v1/models", "/"):
            status, _ = _get(f"{base}{path}")
            assert status == 404, path
        status, _ = _get(f"{base}/v1/completions", data=b'{"prompt": "hi"}')
        assert status == 501, "no method but GET is served"
    finally:
        relay.shutdown()


def test_an_engine_not_answering_is_a_503_not_a_hang():
    relay = metrics_port.serve(0, 1, host="127.0.0.1")   # nothing listens on port 1
    try:
        status, body = _get(f"http://127.0.0.1:{relay.server_address[1]}/metrics")
        assert status == 503 and b"not available" in body
    finally:
        relay.shutdown()


@pytest.mark.parametrize("cpu, device, want", [(True, "auto", "cpu"), (False, "auto", "cuda"),
                                               (True, "cuda", "cuda"), (False, "cpu", "cpu")])
def test_the_default_buffer_device_follows_the_build(cpu, device, want):
    """`auto` (the spec's default) is host memory on the CPU build, where vLLM refuses a CUDA buffer; an
    explicit choice is passed on as given (and vLLM names it if it cannot serve it)."""
    s = WorkerSettings(role="decode", model="/m", cpu=cpu, kv_buffer_device=device)
    assert kv_transfer_config(s)["kv_buffer_device"] == want
    assert f'"kv_buffer_device":"{want}"' in " ".join(build(s).argv)
