"""A real Jaeger on loopback (its v2 binary, built from its Go module into the cache by
``localcluster/build-jaeger.sh``), for the tracing tests: it receives OTLP (gRPC and HTTP) from the router and
the vLLM workers, keeps traces in memory, and answers its query API, through which the tests read them.

Every port is a free one of loopback's (its own configuration file, not the all-in-one defaults), so several
test runs on one machine never collide.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from .localcluster.controlplane import free_port


def jaeger_binary() -> Path:
    """The Jaeger binary, built into the cache when absent (minutes, the first time)."""
    out = subprocess.run(["bash", str(Path(__file__).resolve().parent / "localcluster" / "build-jaeger.sh")],
                         check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1]) / "jaeger"


class LocalJaeger:
    def __init__(self, state_dir: Path, otlp_host: str = "127.0.0.1") -> None:
        """``otlp_host``: the address its OTLP receivers listen on (the real node's bridge address, for pods
        to export to); its query API stays on loopback."""
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ports = {name: free_port() for name in ("otlp_grpc", "otlp_http", "query_http", "query_grpc")}
        self.otlp_host = otlp_host
        # where OTLP/gRPC exporters send (the router's, vLLM's): an http:// endpoint is plaintext
        self.otlp_endpoint = f"http://{otlp_host}:{self.ports['otlp_grpc']}"
        self.otlp_http_endpoint = f"http://{otlp_host}:{self.ports['otlp_http']}"
        self.url = f"http://127.0.0.1:{self.ports['query_http']}"
        self._proc: subprocess.Popen | None = None

    def _config(self) -> Path:
        p = self.ports
        config = {
            "service": {
                "extensions": ["jaeger_storage", "jaeger_query"],
                "pipelines": {"traces": {"receivers": ["otlp"], "processors": ["batch"],
                                         "exporters": ["jaeger_storage_exporter"]}},
                # no internal metrics server (its default port is fixed), nor traces of its own
                "telemetry": {"metrics": {"level": "none"}, "traces": {"level": "none"}, "logs": {"level": "info"}},
            },
            "extensions": {
                "jaeger_storage": {"backends": {"memstore": {"memory": {"max_traces": 100000}}}},
                "jaeger_query": {"storage": {"traces": "memstore"},
                                 "http": {"endpoint": f"127.0.0.1:{p['query_http']}"},
                                 "grpc": {"endpoint": f"127.0.0.1:{p['query_grpc']}"}},
            },
            "receivers": {"otlp": {"protocols": {"grpc": {"endpoint": f"{self.otlp_host}:{p['otlp_grpc']}"},
                                                 "http": {"endpoint": f"{self.otlp_host}:{p['otlp_http']}"}}}},
            # spans reach the store a fraction of a second after they arrive
            "processors": {"batch": {"timeout": "200ms"}},
            "exporters": {"jaeger_storage_exporter": {"trace_storage": "memstore"}},
        }
        path = self.dir / "jaeger.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self, timeout: float = 60) -> LocalJaeger:
        binary = jaeger_binary()
        log = (self.dir / "jaeger.log").open("ab")
        self._proc = subprocess.Popen([str(binary), f"--config={self._config()}"], stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"jaeger exited with {self._proc.returncode}: {self.tail()}")
            if self.ready():
                return self
            time.sleep(0.2)
        raise RuntimeError(f"jaeger not ready after {timeout:.0f}s: {self.tail()}")

    def ready(self) -> bool:
        try:
            self.api("/api/services")
            return True
        except OSError:
            return False

    def api(self, path: str) -> dict:
        """A GET on the query API (``/api/...``), its JSON."""
        with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as r:
            return json.loads(r.read())

    def trace(self, trace_id: str) -> dict | None:
        """The trace (Jaeger's JSON: spans, processes) as stored now, or None when it has not arrived."""
        try:
            data = self.api(f"/api/traces/{trace_id}").get("data") or []
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise
        return data[0] if data else None

    def services(self) -> list[str]:
        return self.api("/api/services").get("data") or []

    def tail(self, lines: int = 30) -> str:
        path = self.dir / "jaeger.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, grace: float = 2) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds: its traces are in memory, and a stopping Jaeger
        (v1.75.0) waits 10 s for an export of its own to localhost:4317, which the configuration cannot
        turn off."""
        if self._proc and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._proc = None


def spans_by_name(trace: dict) -> dict[str, list[dict]]:
    """A Jaeger trace's spans by operation name, each with its ``service`` (its process's serviceName) and
    ``parent`` (the span id its CHILD_OF reference names, or None) added."""
    out: dict[str, list[dict]] = {}
    for s in trace["spans"]:
        parents = [r["spanID"] for r in s.get("references", []) if r.get("refType") == "CHILD_OF"]
        span = {**s, "service": trace["processes"][s["processID"]]["serviceName"],
                "parent": parents[0] if parents else None}
        out.setdefault(s["operationName"], []).append(span)
    return out
