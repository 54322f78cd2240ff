"""A real Prometheus (the distribution's ``prometheus`` binary) on loopback, for tests,
and an exporter serving the router's and vLLM's metrics with values a test controls.
Queries go through prometheus-api-client (the planner's client too).

Prometheus scrapes the ``/metrics`` endpoints it is given every second and keeps its
data in a temporary directory. ``stop()`` and ``start()`` let a test take it away and
bring it back (the same data directory and port).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import signal
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from prometheus_api_client import PrometheusApiClientException, PrometheusConnect
from urllib3.util.retry import Retry

from disagg.api import metrics as m

from .localcluster.controlplane import free_port


class PrometheusNotInstalled(RuntimeError):
    pass


class _Client(PrometheusConnect):
    """prometheus-api-client, plus the two read endpoints its 0.7.2 lacks (alerts, rules), made the way
    its own calls are. No retries: a test waits on conditions itself."""

    def __init__(self, url: str):
        super().__init__(url=url, disable_ssl=True, timeout=30, retry=Retry(total=0))

    def _data(self, path: str, params: dict | None = None):
        response = self._session.request(method="GET", url=f"{self.url}/api/v1/{path}", headers=self.headers,
                                         auth=self.auth, timeout=self._timeout, params=params)
        if response.status_code != 200:
            raise PrometheusApiClientException(f"HTTP Status Code {response.status_code} ({response.content!r})")
        return response.json()["data"]

    def get_alerts(self) -> list[dict]:
        return self._data("alerts")["alerts"]

    def get_rules(self) -> list[dict]:
        return self._data("rules")["groups"]


def kubernetes_prometheus() -> Path:
    """The Prometheus binary with Kubernetes service discovery, built into the cache when absent."""
    out = subprocess.run(["bash", str(Path(__file__).resolve().parent / "localcluster" / "build-prometheus.sh")],
                         check=True, stdout=subprocess.PIPE, text=True)
    return Path(out.stdout.strip().splitlines()[-1]) / "prometheus"


class LocalPrometheus:
    def __init__(self, state_dir: Path, targets: list[str], scrape_interval: str = "1s",
                 scrape_configs: list[dict] | None = None, rule_groups: list[dict] | None = None,
                 kubernetes_sd: bool = False, tls: tuple[Path, Path, Path] | None = None,
                 exemplars: bool = False):
        """Scrapes `targets` as one job, or the jobs of `scrape_configs` given in full; evaluates
        `rule_groups` (recording and alerting rules) when given. `kubernetes_sd`: the Prometheus built with
        Kubernetes service discovery (build-prometheus.sh) instead of Debian's, which has none. `tls`:
        (certificate, key, CA file) to serve HTTPS with (its web config file), for clients that verify it.
        `exemplars`: keep the exemplars it scrapes (a feature flag in Prometheus 2; :meth:`exemplars`)."""
        if kubernetes_sd:
            binary = str(kubernetes_prometheus())
        else:
            binary = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists()
                                                     else None)
        if not binary:
            raise PrometheusNotInstalled("prometheus is not installed: `make prometheus` installs Debian's package")
        self.binary = binary
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.tls = tls
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.targets = targets
        self.scrape_interval = scrape_interval
        self.scrape_configs = scrape_configs
        self.rule_groups = rule_groups
        self.features = ["--enable-feature=exemplar-storage"] if exemplars else []
        self._proc: subprocess.Popen | None = None
        self._client: _Client | None = None

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

    def file_sd(self, job: str, groups: list[dict], **extra) -> dict:
        """A scrape job whose targets come from a file (file_sd), for `scrape_configs`: `groups` (each
        {"targets": ["host:port"], "labels": {...}}) written now; :meth:`set_targets` rewrites them while
        Prometheus runs (read again within a second), as a service discovery's relabelled targets change
        under a running Prometheus. `extra`: more of the job's fields (metric_relabel_configs, ...)."""
        self.set_targets(job, groups)
        return {"job_name": job, "file_sd_configs": [{"files": [str(self._targets_path(job))],
                                                      "refresh_interval": "1s"}], **extra}

    def _targets_path(self, job: str) -> Path:
        return self.dir / f"targets-{job}.json"

    def set_targets(self, job: str, groups: list[dict]) -> None:
        """The targets of a :meth:`file_sd` job, replaced whole (written aside and renamed: never half read)."""
        path = self._targets_path(job)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        tmp.replace(path)

    @property
    def client(self) -> _Client:
        """prometheus-api-client on this Prometheus (made on first use, kept across stop/start)."""
        if self._client is None:
            self._client = _Client(self.url)
        return self._client

    def query(self, expr: str, time: float | None = None) -> list[dict]:
        """An instant query's result (raises PrometheusApiClientException on a query error)."""
        return self.client.custom_query(expr, params={"time": time} if time is not None else None)

    def query_range(self, expr: str, start: float, end: float, step: str) -> list[dict]:
        return self.client.custom_query_range(expr, dt.datetime.fromtimestamp(start, dt.timezone.utc),
                                              dt.datetime.fromtimestamp(end, dt.timezone.utc), step)

    def label_values(self, label: str, match: str | None = None) -> list[str]:
        return self.client.get_label_values(label, params={"match[]": match} if match else None)

    def scrape_targets(self) -> dict:
        """What Prometheus scrapes now: activeTargets (with health) and droppedTargets."""
        return self.client.get_targets()

    def alerts(self) -> list[dict]:
        return self.client.get_alerts()

    def exemplars(self, expr: str, start: float, end: float) -> list[dict]:
        """The exemplars of the series an expression selects (what Grafana asks for a panel's query with
        exemplars on): [{seriesLabels, exemplars: [{labels, value, timestamp}]}]."""
        return self.client._data("query_exemplars", {"query": expr, "start": start, "end": end})

    def rules(self) -> list[dict]:
        """Rule groups, each rule with its health and last error."""
        return self.client.get_rules()

    def api(self, path: str, **params) -> dict:
        """Prometheus' HTTP API answer ({"status": "success", "data": ...}, or {"status": "error",
        "error": ...} for a refused query) for the endpoints the tests read, through the client above."""
        try:
            if path == "query":
                data: object = {"result": self.query(params["query"], params.get("time"))}
            elif path == "query_range":
                data = {"result": self.query_range(params["query"], params["start"], params["end"], params["step"])}
            elif path.startswith("label/") and path.endswith("/values"):
                data = self.label_values(path.split("/")[1], params.get("match[]"))
            elif path == "targets":
                data = self.scrape_targets()
            elif path == "alerts":
                data = {"alerts": self.alerts()}
            elif path == "rules":
                data = {"groups": self.rules()}
            else:
                raise ValueError(f"no client call for /api/v1/{path}")
        except PrometheusApiClientException as e:
            return {"status": "error", "error": str(e)}
        return {"status": "success", "data": data}

    def start(self, timeout: float = 60) -> LocalPrometheus:
        log = (self.dir / "prometheus.log").open("ab")
        self._proc = subprocess.Popen(
            [self.binary, f"--config.file={self._config()}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h", *self._web_config(),
             *self.features],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {self.tail()}")
            if self.ready():
                return self
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout:.0f}s: {self.tail()}")

    def _web_config(self) -> list[str]:
        if not self.tls:
            return []
        cert, key, _ = self.tls
        path = self.dir / "web.yml"
        path.write_text(yaml.safe_dump({"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}}))
        return [f"--web.config.file={path}"]

    def ready(self) -> bool:
        context = ssl.create_default_context(cafile=str(self.tls[2])) if self.tls else None
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1, context=context) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
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
    # requests an engine holds blocked meanwhile (a decode's remote KV still loading), per role: counted in
    # its waiting requests; with ``by_reason`` the engines also say which wait for a slot (vLLM's
    # num_requests_waiting_by_reason: capacity = *_waiting, deferred = these)
    waiting_deferred: dict[str, float] = field(default_factory=dict)
    by_reason: bool = False
    streamed: float = 1.0       # share of requests streamed: the router sees TTFT and ITL of those only
    prefill_ttft: float = 0.25  # the workers' own vLLM TTFT (seconds), every request
    decode_ttft: float = 0.05
    # a flex pool (spec.flex): the workers the routers have draining out of each role, and per flex pod
    # (name -> (serving role, requests running)) its engine's series, labelled with its pod as the chart's
    # pod monitor labels them
    flex_draining: dict[str, float] = field(default_factory=dict)
    flex_pods: dict[str, tuple[str, float]] = field(default_factory=dict)
    # the switches the routers carried out, (from role, to role) -> how many (after their drain)
    flex_switched: dict[tuple[str, str], float] = field(default_factory=dict)


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
        ttft_buckets = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.5, 2, 4, 8, 16)
        self.engine_ttft = Histogram(m.VLLM_TTFT_SECONDS, "engine ttft", labels + ["role"], registry=r,
                                     buckets=ttft_buckets)
        self.engine_itl = Histogram(m.VLLM_ITL_SECONDS, "engine itl", labels + ["role"], registry=r,
                                    buckets=(0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.08, 0.16, 0.32))
        self.waiting = Gauge(m.VLLM_NUM_REQUESTS_WAITING, "waiting", labels + ["role"], registry=r)
        self.waiting_by_reason = Gauge(m.VLLM_NUM_REQUESTS_WAITING_BY_REASON, "waiting by reason",
                                       labels + ["role", "reason"], registry=r)
        # (pod "" is no label at all: the role's series as before)
        self.running = Gauge(m.VLLM_NUM_REQUESTS_RUNNING, "running", labels + ["role", "pod"], registry=r)
        self.flex = Gauge(m.ROUTER_FLEX_WORKERS, "flex workers", labels + ["role", "state"], registry=r)
        self.switches = Counter(m.ROUTER_ROLE_SWITCHES, "role switches", labels + ["from_role", "to_role", "outcome"],
                                registry=r)
        self.kv = Gauge(m.VLLM_KV_CACHE_USAGE, "kv usage", labels + ["role"], registry=r)
        # what the engines served: prompt tokens (and prefix-cache hits) at prefill, generated tokens at decode
        self.engine_prompt = Counter(m.VLLM_PROMPT_TOKENS, "engine prompt tokens", labels + ["role"], registry=r)
        self.engine_hits = Counter(m.VLLM_PREFIX_CACHE_HITS, "engine prefix cache hits", labels + ["role"],
                                   registry=r)
        self.engine_generated = Counter(m.VLLM_GENERATION_TOKENS, "engine generated tokens", labels + ["role"],
                                        registry=r)
        self.traffic = Traffic()
        self._switched: dict[tuple[str, str], float] = {}
        self.port = free_port()
        self.server, self._thread = start_http_server(self.port, addr="127.0.0.1", registry=r)
        self._stop = threading.Event()
        self._player = threading.Thread(target=self._play, daemon=True)
        self._player.start()

    def _play(self):
        tick = 0.05
        owed = streams = 0.0
        while not self._stop.wait(tick):
            t = self.traffic
            owed += t.rate * tick
            lab = {"namespace": self.namespace, "deployment": self.deployment}
            while owed >= 1:
                owed -= 1
                self.requests.labels(**lab, outcome=m.OUTCOME_SUCCESS, path=m.PATH_REMOTE_PREFILL).inc()
                streams += t.streamed
                if streams >= 1:
                    streams -= 1
                    self.ttft.labels(**lab).observe(t.ttft)
                    self.itl.labels(**lab).observe(t.itl)
                self.engine_ttft.labels(**lab, role="prefill").observe(t.prefill_ttft)
                self.engine_ttft.labels(**lab, role="decode").observe(t.decode_ttft)
                self.engine_itl.labels(**lab, role="decode").observe(t.itl)
                self.inp.labels(**lab).observe(t.input_tokens)
                self.out.labels(**lab).observe(t.output_tokens)
                self.prompt.labels(**lab).inc(t.input_tokens)
                self.cached.labels(**lab).inc(t.input_tokens * t.cached_fraction)
                self.engine_prompt.labels(**lab, role="prefill").inc(t.input_tokens)
                self.engine_hits.labels(**lab, role="prefill").inc(t.input_tokens * t.cached_fraction)
                self.engine_generated.labels(**lab, role="decode").inc(t.output_tokens)
            for role, waiting in (("prefill", t.prefill_waiting), ("decode", t.decode_waiting)):
                deferred = t.waiting_deferred.get(role, 0.0)
                self.waiting.labels(**lab, role=role).set(waiting + deferred)
                if t.by_reason:
                    self.waiting_by_reason.labels(**lab, role=role, reason=m.VLLM_WAITING_CAPACITY).set(waiting)
                    self.waiting_by_reason.labels(**lab, role=role, reason="deferred").set(deferred)
                else:
                    self.waiting_by_reason.clear()
                self.running.labels(**lab, role=role, pod="").set(1)
                self.kv.labels(**lab, role=role).set(0.5)
                self.flex.labels(**lab, role=role, state="draining").set(t.flex_draining.get(role, 0))
            for pod, (role, running) in t.flex_pods.items():
                self.running.labels(**lab, role=role, pod=pod).set(running)
            for (frm, to), n in t.flex_switched.items():
                if n > self._switched.get((frm, to), 0):
                    self.switches.labels(**lab, from_role=frm, to_role=to, outcome=m.SWITCH_SWITCHED).inc(
                        n - self._switched.get((frm, to), 0))
                    self._switched[(frm, to)] = n

    def close(self):
        self._stop.set()
        self._player.join()
        self.server.shutdown()


@contextmanager
def scraped_exporter(namespace: str, deployment: str, directory: Path) -> Iterator[tuple[MetricsExporter, LocalPrometheus]]:
    """A :class:`MetricsExporter` for one deployment and a :class:`LocalPrometheus` (its data in ``directory``)
    scraping it: the metrics world of the planner's tests on the local control plane."""
    exporter = MetricsExporter(namespace, deployment)
    try:
        prom = LocalPrometheus(directory, [f"127.0.0.1:{exporter.port}"]).start()
        try:
            yield exporter, prom
        finally:
            prom.stop()
    finally:
        exporter.close()
