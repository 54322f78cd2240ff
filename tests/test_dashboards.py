"""Every panel of the chart's Grafana dashboards, queried against a real Prometheus that scraped real metrics.

One stack for the module: a prefill and a decode vLLM (CPU build, tiny model) moving KV over NIXL, the
router in front of them (conditional disaggregation, so requests take the remote-prefill, local-prefill
and fallback paths; started after the workers published KV events, so it catches up from their replay
sockets: a KV index resync; one decode stream cut mid-way by a proxy: a migration), and the planner's
metrics exporter fed by the planner's own decisions on what Prometheus shows. Prometheus scrapes them as the chart's monitors would on a cluster: the PodMonitors'
relabelings and metric relabelings and the ServiceMonitor's honorLabels, taken from `helm template`,
applied to targets labelled as the operator labels pods. It also evaluates the chart's PrometheusRule.

Each panel's queries run with Grafana's variables replaced by concrete values; a query error, or a panel
target with no finite value, fails the test. Panels whose series only exist on a GPU cluster would be
listed in GPU_ONLY with the reason (none are); panels only a rollout across KV revisions fills are in
NEEDS_ROLLOUT. The overview's Operator row (the operator's own metrics) is queried against the real
operator by tests/test_e2e_helm.py instead.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from disagg.api import contract
from disagg.api import metrics as m
from disagg.e2e.prometheus import LocalPrometheus
from disagg.e2e.suite import dashboard_rows
from disagg.e2e.testing import wait_for
from disagg.workers.local import cpu_settings, free_port, metric_sum, router, scrape, wait_metric, worker

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "disagg"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
NS, NAME = "team-a", "tiny"
OPERATOR_NS = "disagg-system"
RATE_INTERVAL = "1m"
VARIABLES = {"namespace": NS, "deployment": NAME, "ttft_target": "1", "itl_target": "0.05",
             "__rate_interval": RATE_INTERVAL}
# dashboard title -> panel title -> why it cannot have data without GPUs
GPU_ONLY: dict[str, dict[str, str]] = {}
# dashboard title -> panel title -> why this stack cannot make its data (and which test makes the series)
NEEDS_ROLLOUT: dict[str, dict[str, str]] = {
    "disagg / Router": {
        "Pairing refusals by reason": "a refusal needs healthy workers of two KV revisions and no complete pair "
                                      "(a rollout); tests/test_router_pairing.py counts one over real HTTP"},
}
# The overview's Operator row reads the operator's own metrics: its queries run against a Prometheus
# scraping the real operator in tests/test_e2e_helm.py (test_operator_panels_and_gang_alert_...).
NEEDS_OPERATOR = {"disagg / Overview": "Operator"}

pytestmark = pytest.mark.timeout(1800)

SHARED = "You are a careful assistant for a parser project. Answer in one short line. " * 3
LONG = [f"{SHARED}Question {i}: which arguments does parse_args accept, and what does it return for case {i}?"
        for i in range(12)]
SHORT = ["Hi.", "Say hello.", "Count to three.", "Name a color.", "Two plus two?", "Bye."]
WARM_UP = "warm-up " * 40       # sent to each worker before the router starts: two full KV blocks, no shared prefix


class FaultyProxy:
    """An HTTP proxy in front of a worker, as a failing pod would behave. While ``failing`` it answers 503
    to every POST (a broken prefill; its /health and /metrics keep answering). After :meth:`cut_next`, the
    next event stream it relays is cut after ``events`` SSE events: the connection closes without the end
    of the chunked body, as a decode worker dying mid-stream."""

    def __init__(self, upstream: str):
        self.upstream, self.failing = upstream, False
        self._cut: int | None = None
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"      # chunked bodies: a cut one is visibly incomplete

            def log_message(self, *args):
                pass

            def _relay(self, body: bytes | None):
                self.close_connection = True
                if body is not None and proxy.failing:
                    return self._send(503, b'{"error": {"message": "prefill broken by the test"}}')
                up = urllib.parse.urlsplit(proxy.upstream)
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=300)
                try:
                    conn.request(self.command, self.path, body=body, headers={
                        "Content-Type": self.headers.get("Content-Type", "application/json")})
                    r = conn.getresponse()
                    ctype = r.getheader("Content-Type") or "application/json"
                    if not ctype.startswith("text/event-stream"):
                        return self._send(r.status, r.read(), ctype)
                    self._stream(r, ctype, proxy.take_cut())
                finally:
                    conn.close()

            def _stream(self, r, ctype: str, cut: int | None):
                self.send_response(r.status)
                self.send_header("Content-Type", ctype)
                self.send_header("Transfer-Encoding", "chunked")
                self.send_header("Connection", "close")
                self.end_headers()
                events = 0
                for line in iter(r.readline, b""):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                    events += line.startswith(b"data: ")
                    if cut is not None and events >= cut:
                        return                   # no last chunk: the router sees the stream break
                self.wfile.write(b"0\r\n\r\n")

            def _send(self, status: int, body: bytes, ctype: str | None = "application/json"):
                self.send_response(status)
                self.send_header("Content-Type", ctype or "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                self._relay(None)

            def do_POST(self):
                self._relay(self.rfile.read(int(self.headers.get("Content-Length", 0))))

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def cut_next(self, events: int) -> None:
        with self._lock:
            self._cut = events

    def take_cut(self) -> int | None:
        with self._lock:
            cut, self._cut = self._cut, None
            return cut

    def close(self):
        self.server.shutdown()


def replay_holds(endpoint: str) -> bool:
    """Whether a worker's KV events replay socket answers with at least one batch."""
    import zmq.asyncio

    from disagg.router.events import fetch_replay

    async def ask():
        ctx = zmq.asyncio.Context()
        try:
            return await fetch_replay(ctx, endpoint, 0, timeout=5)
        finally:
            ctx.term()
    return bool(asyncio.run(ask()))


def joins(url: str) -> float:
    """KV index resyncs of reason join the router at ``url`` counted."""
    return sum(v for k, v in scrape(url).items()
               if k.startswith(m.ROUTER_KV_INDEX_RESYNCS + "{") and f'reason="{m.RESYNC_JOIN}"' in k)


def relabel(rules: list[dict]) -> list[dict]:
    """Prometheus Operator relabelings (camelCase) as Prometheus relabel_configs."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{keys.get(k, k): (v.lower() if k == "action" else v) for k, v in r.items()} for r in rules]


def chart_monitors() -> dict[str, dict]:
    from disagg.e2e.localcluster import binaries

    out = subprocess.run([str(binaries() / "helm"), "template", "disagg", str(CHART), "--namespace", OPERATOR_NS,
                          "--api-versions", "monitoring.coreos.com/v1"], check=True, capture_output=True, text=True)
    objs = [d for d in yaml.safe_load_all(out.stdout) if d]
    return {o["kind"] + "/" + o["metadata"].get("labels", {}).get("app.kubernetes.io/component", ""): o
            for o in objs if o["kind"] in ("PodMonitor", "ServiceMonitor", "PrometheusRule")}


def scrape_configs(monitors: dict[str, dict], pods: dict[str, tuple[str, str, str]], planner: str) -> list[dict]:
    """Jobs as the Prometheus Operator generates them from the chart's monitors, for `pods`
    (name -> (role, host:port, the container port's name)) labelled as the operator labels its pods."""
    jobs = []
    for component in ("routers", "workers"):
        pm = monitors[f"PodMonitor/{component}"]
        roles = pm["spec"]["selector"]["matchExpressions"][0]["values"]
        endpoint = pm["spec"]["podMetricsEndpoints"][0]
        jobs.append({
            "job_name": f"podMonitor/{OPERATOR_NS}/{pm['metadata']['name']}",
            "metrics_path": endpoint["path"],
            "static_configs": [{"targets": [addr], "labels": {
                "__meta_kubernetes_namespace": NS, "__meta_kubernetes_pod_name": pod,
                "__meta_kubernetes_pod_label_serving_disagg_dev_deployment": NAME,
                "__meta_kubernetes_pod_label_serving_disagg_dev_role": role,
                "__meta_kubernetes_pod_container_port_name": port_name}}
                for pod, (role, addr, port_name) in pods.items() if role in roles],
            # what the Prometheus Operator puts before a PodMonitor's own relabelings
            "relabel_configs": [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                                *relabel(endpoint.get("relabelings", []))],
            "metric_relabel_configs": relabel(endpoint.get("metricRelabelings", [])),
        })
    sm = monitors["ServiceMonitor/operator"]
    endpoint = next(e for e in sm["spec"]["endpoints"] if e["port"] == "planner-metrics")
    jobs.append({"job_name": f"serviceMonitor/{OPERATOR_NS}/{sm['metadata']['name']}",
                 "honor_labels": endpoint["honorLabels"], "metrics_path": endpoint["path"],
                 "static_configs": [{"targets": [planner], "labels": {"namespace": OPERATOR_NS,
                                                                      "pod": "disagg-operator-0"}}]})
    return jobs


@dataclass
class Stack:
    prometheus: LocalPrometheus
    router_url: str
    decode_url: str
    start: float
    end: float


def _post(url: str, body: dict) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            assert r.status == 200
            r.read()
    except urllib.error.HTTPError as e:   # the router's OpenAI-style error says which worker failed and how
        raise AssertionError(f"{url}: HTTP {e.code}: {e.read()[:2000]!r}") from e


def _complete(url: str, prompt: str, stream: bool, max_tokens: int = 8) -> None:
    _post(f"{url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                    "stream": stream})


def _chat(url: str, text: str) -> None:
    _post(f"{url}/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}],
                                         "max_tokens": 8, "temperature": 0, "stream": True})


class PlannerFeed:
    """The planner's decision path without a cluster: observe through Prometheus, decide, record the
    decision in the planner's metrics (served over HTTP like the planner pod's), every ``interval`` seconds."""

    def __init__(self, interval: float = 3.0):
        from prometheus_client import start_http_server

        from disagg.planner import decide as dc
        from disagg.planner.apply import PlannerMetrics
        from disagg.perf.model import PerfModel

        self.dc, self.interval = dc, interval
        self.metrics = PlannerMetrics()
        self.port = free_port()
        self.server, _ = start_http_server(self.port, addr="127.0.0.1", registry=self.metrics.registry)
        self.source = None
        self.model = PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM")
        self.target = dc.Target(prefill=1, decode=1, ttft_target=1.0, itl_target=0.05, cooldown=60.0,
                                interval=interval, startup=10.0)
        self.memory = dc.Memory()
        self.decisions = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def connect(self, prometheus_url: str) -> PlannerFeed:
        from disagg.planner.metrics_source import PrometheusSource

        self.source = PrometheusSource(prometheus_url, timeout=5)
        return self

    def start(self) -> PlannerFeed:
        self._thread.start()
        return self

    def step(self) -> None:
        obs = self.source.observe(NS, NAME, 90, 20)
        decision, self.memory = self.dc.decide(obs, self.target, self.memory, self.model, now=time.time())
        self.metrics.record(NS, NAME, decision, self.target)
        self.decisions += 1

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.step()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.source:
            self.source.close()
        self.server.shutdown()


def _prometheus_sum(prom: LocalPrometheus, selector: str) -> float | None:
    result = prom.api("query", query=f"sum({selector})").get("data", {}).get("result")
    return float(result[0]["value"][1]) if result else None


@pytest.fixture(scope="module")
def stack(tiny_model, worker_python, tmp_path_factory):  # noqa: F811
    logs = tmp_path_factory.mktemp("dashboards")
    # each worker's metrics on their own port, relayed by its supervisor, as in a pod
    prefill_s = cpu_settings("prefill", tiny_model, "0", metrics_port=free_port())
    decode_s = cpu_settings("decode", tiny_model, "1", metrics_port=free_port())
    procs = {"prefill": worker("prefill", prefill_s, worker_python, logs),
             "decode": worker("decode", decode_s, worker_python, logs)}
    closers = []
    try:
        for name in ("prefill", "decode"):
            procs[name].start()
        proxy = FaultyProxy(procs["prefill"].url)
        closers.append(proxy.close)
        decode_proxy = FaultyProxy(procs["decode"].url)
        closers.append(decode_proxy.close)
        for name in ("prefill", "decode"):
            procs[name].wait_ready(timeout=900)
        # the router's ports picked once the engines are up: during their minutes of start-up another
        # process on a busy machine (any outgoing connection) may take a port picked before
        port, metrics_port = free_port(), free_port()
        config = {"model": "tiny", "tokenizer": tiny_model, "block_size": 32, "max_model_len": 1024, "port": port,
                  "metrics_port": metrics_port, "host": "127.0.0.1", "health_interval_s": 2,
                  "spec": {"disaggregation": "conditional", "localPrefillThresholdTokens": 48,
                           "prefillTimeoutSeconds": 120},
                  "prefill": [{"url": proxy.url, "kv_events": f"tcp://127.0.0.1:{prefill_s.kv_events_port}",
                               "kv_replay": f"tcp://127.0.0.1:{prefill_s.kv_replay_port}"}],
                  "decode": [{"url": decode_proxy.url, "kv_events": f"tcp://127.0.0.1:{decode_s.kv_events_port}",
                              "kv_replay": f"tcp://127.0.0.1:{decode_s.kv_replay_port}"}]}
        (logs / "router.json").write_text(json.dumps(config))
        procs["router"] = router(logs / "router.json", port, logs)
        # KV events published before the router subscribes: it catches up from each worker's replay
        # socket on start (a join resync, the KV index resyncs panel's data)
        for name, s in (("prefill", prefill_s), ("decode", decode_s)):
            _post(f"{procs[name].url}/v1/completions", {"model": "tiny", "prompt": WARM_UP, "max_tokens": 1})
            wait_for(lambda: replay_holds(f"tcp://127.0.0.1:{s.kv_replay_port}"), 60,
                     f"the {name} worker's replay socket to hold its KV events", interval=0.5)
        procs["router"].start().wait_ready()
        # with a metrics port, the router's serving port has no /metrics (the clients' port): read it there
        router_metrics = f"http://127.0.0.1:{metrics_port}"
        wait_for(lambda: joins(router_metrics) >= 2, 60, "the router to catch up on both workers' KV events",
                 interval=0.5)

        monitors = chart_monitors()
        groups = monitors["PrometheusRule/"]["spec"]["groups"]
        for g in groups:
            g["interval"] = "2s"      # evaluate the chart's rules often enough for a short test
        feed = PlannerFeed()
        closers.append(feed.close)
        # the router scraped on its process's own metrics port, as the chart's monitor does in a cluster
        pods = {"tiny-router-0": ("router", f"127.0.0.1:{metrics_port}", contract.router_metrics_port_name(0)),
                "tiny-prefill-0": ("prefill", f"127.0.0.1:{prefill_s.metrics_port}", contract.WORKER_METRICS_PORT_NAME),
                "tiny-decode-0": ("decode", f"127.0.0.1:{decode_s.metrics_port}", contract.WORKER_METRICS_PORT_NAME)}
        prom = LocalPrometheus(logs / "prometheus", [], rule_groups=groups,
                               scrape_configs=scrape_configs(monitors, pods, f"127.0.0.1:{feed.port}"))
        prom.start()
        closers.append(prom.stop)
        feed.connect(prom.url)
        feed.step()   # before any traffic: the planner holds for want of metrics
        feed.start()
        # every target scraped before the traffic starts: it takes a few seconds with today's engines,
        # and a counter whose every change came before its first scrape shows no increase (rates of
        # 0, TTFT ratios of 0/0: every panel "no data", as in one run where Prometheus first scraped the
        # router after the last request)
        targets = len(pods) + 1                           # and the planner feed's exporter
        wait_for(lambda: (r := prom.api("query", query="count(up == 1)").get("data", {}).get("result"))
                 and int(float(r[0]["value"][1])) == targets, 60, f"Prometheus to scrape all {targets} targets",
                 interval=0.5)

        start = time.time()
        url = procs["router"].url
        try:
            for i, prompt in enumerate(LONG[:8]):              # remote prefill (long, uncached tails)
                _complete(url, prompt, stream=i % 2 == 0)
                if i == 0:
                    # the first request's series (its path's requests, TTFT and duration histograms) scraped
                    # before the rest add to them: a series is created by its first event, and one whose
                    # every event falls between two scrapes shows no increase. A CI run answered all 21
                    # requests within one second, between two 1 s scrapes: rates of 0, the ratios and
                    # quantiles of 0/0, and 4 of 6 tests failed "no data".
                    wait_for(lambda: _prometheus_sum(prom, f'{m.ROUTER_REQUESTS}{{namespace="{NS}"}}') == 1, 60,
                             "Prometheus to scrape the router's first request", interval=0.2)
            for text in SHORT:                                 # local prefill (short)
                _chat(url, text)
            proxy.failing = True                               # a broken prefill: fallback to local prefill
            for prompt in LONG[8:11]:
                _complete(url, prompt, stream=True)
            proxy.failing = False
            for prompt in LONG[11:] + LONG[:2]:                # prefix hits on the prefill worker
                _complete(url, prompt, stream=True, max_tokens=12)
            # a decode stream cut after its first token (the first event carries it, so the cut is
            # mid-stream): continued on the decode (migrated), or ended by the router if that event
            # already held the last token (not_needed); either way one migration counted
            decode_proxy.cut_next(2)
            _complete(url, SHORT[0], stream=True, max_tokens=12)
            routed = scrape(router_metrics)
            served = metric_sum(routed, m.ROUTER_REQUESTS)
            assert served == 21, routed
            assert routed.get(f'{m.ROUTER_FALLBACKS}{{reason="{m.FALLBACK_PREFILL_ERROR}"}}', 0) == 3, routed
            assert metric_sum(routed, m.ROUTER_MIGRATIONS) == 1, routed
            assert sum(routed.get(f'{m.ROUTER_MIGRATIONS}{{outcome="{o}"}}', 0)
                       for o in (m.MIGRATION_MIGRATED, m.MIGRATION_NOT_NEEDED)) == 1, routed
            # vLLM publishes NIXL stats at its logging interval
            wait_metric(procs["decode"].url, m.VLLM_NIXL_BYTES_TRANSFERRED + "_count", 1, timeout=60)
            # until Prometheus holds the last values and the planner decided on them
            decisions = feed.decisions
            wait_for(lambda: _prometheus_sum(prom, f'{m.ROUTER_REQUESTS}{{namespace="{NS}"}}') == served, 60,
                     "Prometheus to scrape the router's last counts", interval=1)
            wait_for(lambda: feed.decisions >= decisions + 2, 60, "two more planner decisions", interval=0.5)
            # every target scraped, and the chart's rules (every 2 s) evaluated, after the last decision
            mark = time.time() + 2

            def scraped_since() -> bool:
                r = prom.api("query", query="min(timestamp(up))").get("data", {}).get("result")
                return bool(r) and float(r[0]["value"][1]) > mark
            wait_for(scraped_since, 60, "a scrape of every target after the last decision", interval=0.5)
        except Exception as e:   # what the processes said is the only record a CI failure leaves
            raise AssertionError("\n".join(f"--- {n}.log (tail) ---\n{p.tail(60)}" for n, p in procs.items())) from e
        yield Stack(prom, url, procs["decode"].url, start, time.time())
    finally:
        for close in reversed(closers):
            close()
        for p in procs.values():
            p.stop()


def substitute(expr: str) -> str:
    for name, value in sorted(VARIABLES.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    assert "$" not in expr, expr
    return expr


def finite(result: list[dict]) -> bool:
    values = [v for s in result for _, v in (s.get("values") or [s["value"]])]
    return any(math.isfinite(float(v)) for v in values)


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out += [p] if p.get("targets") else []
        out += [q for q in p.get("panels", []) if q.get("targets")]
    return out


@pytest.mark.parametrize("path", DASHBOARDS, ids=[p.stem for p in DASHBOARDS])
def test_every_panel_has_data(stack, path):
    dashboard = json.loads(path.read_text())
    skip = set(GPU_ONLY.get(dashboard["title"], {})) | set(NEEDS_ROLLOUT.get(dashboard["title"], {}))
    if dashboard["title"] in NEEDS_OPERATOR:
        skip |= {p["title"] for p in dashboard_rows(dashboard)[NEEDS_OPERATOR[dashboard["title"]]]}
    failures, checked = [], 0
    for panel in panels(dashboard):
        if panel["title"] in skip:
            continue
        for t in panel["targets"]:
            expr = substitute(t["expr"])
            if t.get("instant"):
                r = stack.prometheus.api("query", query=expr, time=stack.end)
            else:
                r = stack.prometheus.api("query_range", query=expr, start=stack.start, end=stack.end, step="2s")
            checked += 1
            if r.get("status") != "success":
                failures.append(f"{panel['title']} [{t['refId']}]: query error {r.get('error')}: {expr}")
            elif not finite(r["data"]["result"]):
                failures.append(f"{panel['title']} [{t['refId']}]: no data: {expr}")
    assert checked >= 10
    assert not failures, "\n".join(failures)


def test_template_variables_list_the_deployment(stack):
    for path in DASHBOARDS:
        variables = {v["name"]: v for v in json.loads(path.read_text())["templating"]["list"]}
        for name, want in (("namespace", NS), ("deployment", NAME)):
            query = variables[name]["query"]["query"]
            inner, label = query.removeprefix("label_values(").removesuffix(")").rsplit(", ", 1)
            assert label == name
            r = stack.prometheus.api(f"label/{label}/values", **{"match[]": substitute(inner)})
            assert r["status"] == "success" and want in r["data"], (path.name, query, r)
        for name in ("ttft_target", "itl_target"):
            assert VARIABLES[name] in [o["value"] for o in variables[name]["options"]]


def test_chart_rules_evaluate_on_real_metrics(stack):
    groups = stack.prometheus.api("rules")["data"]["groups"]
    rules = [r for g in groups for r in g["rules"]]
    assert len(rules) >= 20
    bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
    assert not bad, bad
    for record in ("disagg:goodput:rate5m", "disagg:slo_attainment:ratio_rate5m",
                   "disagg:ttft_slo_errors:ratio_rate5m", "disagg:itl_slo_errors:ratio_rate5m",
                   "disagg:router_ttft_seconds:p90_5m"):
        r = stack.prometheus.api("query", query=f'{record}{{namespace="{NS}", deployment="{NAME}"}}',
                                 time=stack.end)
        assert r["status"] == "success" and finite(r["data"]["result"]), (record, r)
    # healthy workers on both sides, transfers without failures, the one cut stream continued: the no-ready,
    # NIXL and failed-migration alerts stay quiet
    alerts = {a["labels"]["alertname"] for a in stack.prometheus.api("alerts")["data"]["alerts"]}
    assert not alerts & {"DisaggNoReadyDecode", "DisaggNoReadyPrefill", "DisaggNIXLTransferFailures",
                         "DisaggMigrationsFailing"}, alerts
    # and their expressions see the series they alert on
    for expr in (f'disagg_router_workers{{namespace="{NS}", deployment="{NAME}", role="decode", state="healthy"}}',
                 f'vllm:nixl_num_failed_transfers_total{{namespace="{NS}", deployment="{NAME}", role="decode"}}',
                 f'disagg_planner_metrics_available{{namespace="{NS}", deployment="{NAME}"}}',
                 f'{m.ROUTER_MIGRATIONS}{{namespace="{NS}", deployment="{NAME}"}}',
                 f'{m.ROUTER_KV_INDEX_RESYNCS}{{namespace="{NS}", deployment="{NAME}"}}'):
        r = stack.prometheus.api("query", query=expr, time=stack.end)
        assert r["status"] == "success" and r["data"]["result"], expr
