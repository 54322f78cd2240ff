"""A port that serves a worker's ``/metrics`` and nothing else.

vLLM serves its metrics on the same port as its OpenAI API, and a NetworkPolicy admits by port, not
path: whoever may scrape could also send prompts, past the router's API keys and admission. This
relay runs in the worker's supervisor (the pod's first process), answers ``GET /metrics`` on its own
port with what vLLM's loopback ``/metrics`` returns, and every other path with 404, so the policy can
admit Prometheus here and nowhere else (``disagg.api.contract.WORKER_METRICS_PORT``).

Standard library only: the supervisor runs in the worker image's Python, beside vLLM, without the
router's or the operator's dependencies.
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

# A scrape waits at most this long for vLLM (Prometheus' own scrape timeout is usually 10 s).
UPSTREAM_TIMEOUT_SECONDS = 8.0
# vLLM's exposition is tens of kB (hundreds with many LoRA adapters or histograms); a larger answer is
# not relayed whole into this process's memory.
MAX_BODY_BYTES = 16 * 2**20
PATH = "/metrics"


def _handler(upstream: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "disagg-worker-metrics"

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path.split("?", 1)[0] != PATH:
                self._answer(404, b"only /metrics is served on this port\n")
                return
            try:
                with urllib.request.urlopen(upstream, timeout=UPSTREAM_TIMEOUT_SECONDS) as r:
                    body = r.read(MAX_BODY_BYTES + 1)
                    ctype = r.headers.get("Content-Type", "text/plain; version=0.0.4")
            except (urllib.error.URLError, OSError) as e:
                # the engine is starting or gone: Prometheus marks the target down, as it would direct
                self._answer(503, f"vLLM's metrics are not available: {e}\n".encode())
                return
            if len(body) > MAX_BODY_BYTES:
                self._answer(502, b"vLLM's metrics exceed the relay's size limit\n")
                return
            self._answer(200, body, ctype)

        def _answer(self, status: int, body: bytes, ctype: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:  # one line per scrape would drown the engine's log
            pass

    return Handler


def serve(port: int, engine_port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Start relaying ``http://127.0.0.1:<engine_port>/metrics`` on ``host:port`` in a daemon thread."""
    server = ThreadingHTTPServer((host, port), _handler(f"http://127.0.0.1:{engine_port}{PATH}"))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics-port", daemon=True).start()
    return server
