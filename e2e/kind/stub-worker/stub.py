"""A stand-in for the worker entrypoint on clusters without GPUs (the kind e2e provider).

It is installed as `disagg.workers` in its image, so it runs under the command the operator gives
worker pods (`python -m disagg.workers serve --role ... --port 8000 ... -- <engine args>`), ignores
everything but the role and the port, and answers what the pod's probes and the router's health checks
ask: GET /health, /metrics, /v1/models. It serves no completions (POST answers 503): the kind suite
tests the control plane, placement and rollouts with real kubelets, not inference.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="disagg.workers (e2e stub)")
    parser.add_argument("action", nargs="?", default="serve")
    parser.add_argument("--role", default="decode")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="stub")
    args, _ = parser.parse_known_args(argv[: argv.index("--")] if "--" in argv else argv)

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *_):
            pass

        def _send(self, status: int, body: bytes, ctype: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, b"", "text/plain")
            elif self.path == "/metrics":
                text = f'vllm:num_requests_running{{model_name="{args.served_model_name}"}} 0\n'
                self._send(200, text.encode(), "text/plain; version=0.0.4")
            elif self.path == "/v1/models":
                body = {"object": "list", "data": [{"id": args.served_model_name, "object": "model"}]}
                self._send(200, json.dumps(body).encode(), "application/json")
            else:
                self._send(404, b"", "text/plain")

        def do_POST(self):
            message = {"error": {"message": f"e2e stub {args.role} worker: no inference", "type": "stub"}}
            self._send(503, json.dumps(message).encode(), "application/json")

    server = ThreadingHTTPServer(("0.0.0.0", args.port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(json.dumps({"msg": "e2e stub worker", "role": args.role, "port": args.port}), flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
