"""A real Prometheus (the distribution's ``prometheus`` binary) on loopback, for tests,
and an exporter serving the router's and vLLM's metrics with values a test controls.

Prometheus scrapes the ``/metrics`` endpoints it is given every second and keeps its
data in a temporary directory. ``stop()`` and ``start()`` let a test take it away and
bring it back (the same data directory and port).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import yaml

from disagg.api import metrics as m

from .localcluster.controlplane import free_port


class PrometheusNotInstalled(RuntimeError):
    pass


class LocalPrometheus:
    def __init__(self, state_dir: Path, targets: list[str], scrape_interval: str = "1s",
                 scrape_configs: list[dict] | None = None, rule_groups: list[dict] | None = None):
        """Scrapes `targets` as one job, or the jobs of `scrape_configs` given in full; evaluates
        `rule_groups` (recording and alerting rules) when given."""
        binary = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists()
                                                 else None)
        if not binary:
            raise PrometheusNotInstalled("prometheus is not installed: `make prometheus` installs Debian's package")
        self.binary = binary
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets = targets
        self.scrape_interval = scrape_interval
        self.scrape_configs = scrape_configs
        self.rule_groups = rule_groups
        self._proc: subprocess.Popen | None = None

    def _config(self) -> Path:
        path = self.dir / "prometheus.yml"
        config = {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": self.scrape_configs if self.scrape_configs is not None else
            [{"job_name": "exporters", "static_configs": [{"targets": self.targets}]}],
        }
        if self.rule_groups:
            rules = self.dir / "rules.yaml"
            rules.write_text(yaml.safe_dump({"groups": self.rule_groups}))
            config["rule_files"] = [str(rules)]
        path.write_text(yaml.safe_dump(config))
        return path

    def api(self, path: str, **params) -> dict:
        """GET /api/v1/<path>: the decoded answer, errors included (status "error")."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read() or b"{}") | {"status": "error", "http": e.code}

    def start(self, timeout: float = 60) -> LocalPrometheus:
        log = (self.dir / "prometheus.log").open("ab")
        self._proc = subprocess.Popen(
            [self.binary, f"--config.file={self._config()}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {self.tail()}")
            if self.ready():
                return self
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout:.0f}s: {self.tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._proc = None

    def tail(self, lines: int = 20) -> str:
        path = self.dir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@dataclass
class Traffic:
    rate: float = 10.0          # requests/s
    ttft: float = 0.3           # seconds
    itl: float = 0.02
    input_tokens: int = 2000
    output_tokens: int = 200
    cached_fraction: float = 0.25
    prefill_waiting: float = 0.0
    decode_waiting: float = 0.0


class MetricsExporter:
    """A router-and-workers look-alike: real /metrics over HTTP, values the test controls."""

    def __init__(self, namespace: str, deployment: str):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

        self.namespace, self.deployment = namespace, deployment
        self.registry = CollectorRegistry()
        labels = ["namespace", "deployment"]
        r = self.registry
        self.requests = Counter(m.ROUTER_REQUESTS, "requests", labels + ["outcome", "path"], registry=r)
        self.ttft = Histogram(m.ROUTER_TTFT_SECONDS, "ttft", labels, registry=r,
                              buckets=(0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.5, 2, 4, 8, 16))
        self.itl = Histogram(m.ROUTER_ITL_SECONDS, "itl", labels, registry=r,
                             buckets=(0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.08, 0.16, 0.32))
        tokens = tuple(2.0 ** k for k in range(4, 18))
        self.inp = Histogram(m.ROUTER_INPUT_TOKENS, "input tokens", labels, registry=r, buckets=tokens)
        self.out = Histogram(m.ROUTER_OUTPUT_TOKENS, "output tokens", labels, registry=r, buckets=tokens)
        self.prompt = Counter(m.ROUTER_PROMPT_TOKENS, "prompt tokens", labels, registry=r)
        self.cached = Counter(m.ROUTER_CACHED_PROMPT_TOKENS, "cached prompt tokens", labels, registry=r)
        self.waiting = Gauge(m.VLLM_NUM_REQUESTS_WAITING, "waiting", labels + ["role"], registry=r)
        self.running = Gauge(m.VLLM_NUM_REQUESTS_RUNNING, "running", labels + ["role"], registry=r)
        self.kv = Gauge(m.VLLM_KV_CACHE_USAGE, "kv usage", labels + ["role"], registry=r)
        self.traffic = Traffic()
        self.port = free_port()
        self.server, self._thread = start_http_server(self.port, addr="127.0.0.1", registry=r)
        self._stop = threading.Event()
        self._player = threading.Thread(target=self._play, daemon=True)
        self._player.start()

    def _play(self):
        tick = 0.05
        owed = 0.0
        while not self._stop.wait(tick):
            t = self.traffic
            owed += t.rate * tick
            lab = {"namespace": self.namespace, "deployment": self.deployment}
            while owed >= 1:
                owed -= 1
                self.requests.labels(**lab, outcome=m.OUTCOME_SUCCESS, path=m.PATH_REMOTE_PREFILL).inc()
                self.ttft.labels(**lab).observe(t.ttft)
                self.itl.labels(**lab).observe(t.itl)
                self.inp.labels(**lab).observe(t.input_tokens)
                self.out.labels(**lab).observe(t.output_tokens)
                self.prompt.labels(**lab).inc(t.input_tokens)
                self.cached.labels(**lab).inc(t.input_tokens * t.cached_fraction)
            for role, waiting in (("prefill", t.prefill_waiting), ("decode", t.decode_waiting)):
                self.waiting.labels(**lab, role=role).set(waiting)
                self.running.labels(**lab, role=role).set(1)
                self.kv.labels(**lab, role=role).set(0.5)

    def close(self):
        self._stop.set()
        self._player.join()
        self.server.shutdown()
