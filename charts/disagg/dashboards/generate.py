"""Writes the chart's Grafana dashboards (dashboards/*.json) from the metric names in disagg.api.metrics.

    python charts/disagg/dashboards/generate.py          # rewrite the JSON files
    python charts/disagg/dashboards/generate.py --check  # exit 1 when they differ from what this writes

tests/test_dashboards.py runs every panel's queries against a real Prometheus; tests/test_chart.py
checks that the committed JSON is what this script writes. Every query selects
``namespace=~"$namespace", deployment=~"$deployment"`` (labels the chart's monitors put on every series),
but the operator's own counters and phase gauge in the overview's Operator row, which cover every
deployment the operator watches (tests/test_e2e_helm.py queries that row against the real operator).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from disagg.api import metrics as m

HERE = Path(__file__).resolve().parent
SEL = 'namespace=~"$namespace", deployment=~"$deployment"'
RATE = "$__rate_interval"
DS = {"type": "prometheus", "uid": "${datasource}"}


def sel(*extra: str) -> str:
    return "{" + ", ".join((SEL, *extra)) + "}"


def le(var: str) -> str:
    """A bucket boundary in either spelling (Prometheus 2 stores le="1.0", Prometheus 3 le="1")."""
    return f'le=~"${{{var}}}|${{{var}}}.0"'


def rate(metric: str, *extra: str, by: str = "") -> str:
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}{sel(*extra)}[{RATE}]))"


def quantile(q: float, metric: str, by: str = "", *extra: str) -> str:
    labels = ", ".join(x for x in ("le", by) if x)
    return f"histogram_quantile({q}, sum by ({labels}) (rate({metric}_bucket{sel(*extra)}[{RATE}])))"


def mean(metric: str) -> str:
    return f"{rate(metric + '_sum')} / {rate(metric + '_count')}"


# Shares of requests inside the TTFT target and of inter-token gaps inside the ITL target.
TTFT_OK = f"({rate(m.ROUTER_TTFT_SECONDS + '_bucket', le('ttft_target'))} / {rate(m.ROUTER_TTFT_SECONDS + '_count')})"
ITL_OK = f"({rate(m.ROUTER_ITL_SECONDS + '_bucket', le('itl_target'))} / {rate(m.ROUTER_ITL_SECONDS + '_count')})"
SUCCESS = f'outcome="{m.OUTCOME_SUCCESS}"'
REMOTE = f'path="{m.PATH_REMOTE_PREFILL}"'
HEALTHY, UNHEALTHY = 'state="healthy"', 'state="unhealthy"'
SUCCESS_RATE = rate(m.ROUTER_REQUESTS, SUCCESS)


def target(expr: str, legend: str = "") -> dict:
    return {"expr": expr, "legendFormat": legend or "__auto", "range": True, "instant": False}


def quantiles(metric: str, what: str, by: str = "", qs=(0.5, 0.9, 0.99), exemplars: bool = False) -> list[dict]:
    """``exemplars``: Grafana also asks for the series' exemplars (the router's TTFT carries the request's
    trace id in label ``m.EXEMPLAR_TRACE_ID``; a Prometheus data source whose exemplarTraceIdDestinations names it, as
    the chart's grafana.datasources provisions, links each to its trace)."""
    prefix = f"{{{{{by}}}}} " if by else ""
    out = [target(quantile(q, metric, by), f"{prefix}{what} p{round(q * 100)}") for q in qs]
    if exemplars:
        for t in out:
            t["exemplar"] = True
    return out


class Board:
    def __init__(self, uid: str, title: str, description: str, tags: list[str]):
        self.uid, self.title, self.description, self.tags = uid, title, description, tags
        self.panels: list[dict] = []
        self._x = self._y = 0
        self._row_h = 0

    def row(self, title: str) -> None:
        if self._x:
            self._y += self._row_h
        self._x, self._row_h = 0, 0
        self.panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self._y}, "id": len(self.panels) + 1})
        self._y += 1

    def panel(self, kind: str, title: str, description: str, targets: list[dict], unit: str = "short",
              w: int = 12, h: int = 8, **field_defaults) -> None:
        if self._x + w > 24:
            self._x, self._y = 0, self._y + self._row_h
            self._row_h = 0
        refs = iter("ABCDEFGHIJ")
        defaults = {"unit": unit, **field_defaults}
        p = {"type": kind, "title": title, "description": description, "datasource": DS,
             "gridPos": {"h": h, "w": w, "x": self._x, "y": self._y}, "id": len(self.panels) + 1,
             "targets": [{"datasource": DS, "refId": next(refs), **t} for t in targets],
             "fieldConfig": {"defaults": defaults, "overrides": []}}
        if kind == "timeseries":
            p["options"] = {"legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max", "lastNotNull"]},
                            "tooltip": {"mode": "multi", "sort": "desc"}}
            defaults.setdefault("custom", {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never", "spanNulls": True})
        elif kind == "stat":
            p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                            "colorMode": "value", "graphMode": "area", "textMode": "auto"}
            for t in p["targets"]:
                t.update(range=False, instant=True)
        self.panels.append(p)
        self._x += w
        self._row_h = max(self._row_h, h)

    def json(self) -> dict:
        return {
            "uid": self.uid, "title": self.title, "description": self.description, "tags": ["disagg", *self.tags],
            "editable": True, "graphTooltip": 1, "schemaVersion": 39, "version": 1, "timezone": "browser",
            "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "fiscalYearStartMonth": 0, "liveNow": False,
            "annotations": {"list": [{"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"},
                                      "enable": True, "hide": True, "iconColor": "rgba(0, 211, 255, 1)",
                                      "name": "Annotations & Alerts", "type": "dashboard"}]},
            "links": [{"title": "disagg dashboards", "type": "dashboards", "tags": ["disagg"], "asDropdown": True,
                       "includeVars": True, "keepTime": True}],
            "templating": {"list": variables()},
            "panels": self.panels,
        }


def _query_var(name: str, label: str, query: str) -> dict:
    return {"name": name, "label": label, "type": "query", "datasource": DS, "definition": query,
            "query": {"query": query, "refId": f"{name}-var"}, "refresh": 2, "sort": 1, "multi": True,
            "includeAll": True, "allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "options": [], "hide": 0, "regex": ""}


def _custom_var(name: str, label: str, values: list[str], default: str, description: str) -> dict:
    return {"name": name, "label": label, "type": "custom", "description": description, "query": ",".join(values),
            "current": {"selected": True, "text": default, "value": default}, "hide": 0, "multi": False,
            "includeAll": False,
            "options": [{"selected": v == default, "text": v, "value": v} for v in values]}


def variables() -> list[dict]:
    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
        _query_var("namespace", "Namespace", f"label_values({m.ROUTER_REQUESTS}, namespace)"),
        _query_var("deployment", "DisaggDeployment",
                   f'label_values({m.ROUTER_REQUESTS}{{namespace=~"$namespace"}}, deployment)'),
        _custom_var("ttft_target", "TTFT target (s)", ["0.1", "0.25", "0.5", "1", "2.5", "5", "10"], "1",
                    "Time-to-first-token target: a bucket boundary of the router's latency histogram."),
        _custom_var("itl_target", "ITL target (s)", ["0.01", "0.025", "0.05", "0.1", "0.25", "0.5"], "0.05",
                    "Inter-token latency target: a bucket boundary of the router's latency histogram."),
    ]


def overview() -> Board:
    b = Board("disagg-overview", "disagg / Overview",
              "Goodput, SLO attainment, latency percentiles, request rate and token lengths of DisaggDeployments, "
              "as their routers measure them.", ["overview"])
    b.row("Service level")
    pct = {"min": 0, "max": 1}
    b.panel("stat", "Goodput", "Successful requests per second inside both targets (TTFT share x ITL share).",
            [target(f"{SUCCESS_RATE} * {TTFT_OK} * {ITL_OK}", "goodput")], "reqps", w=6, h=5)
    b.panel("stat", "SLO attainment", "Share of requests inside the TTFT target times share of inter-token gaps "
            "inside the ITL target.", [target(f"{TTFT_OK} * {ITL_OK}", "attainment")], "percentunit", w=6, h=5,
            thresholds={"mode": "absolute", "steps": [{"color": "red", "value": None},
                                                      {"color": "orange", "value": 0.9},
                                                      {"color": "green", "value": 0.95}]}, **pct)
    b.panel("stat", "Request rate", "All requests the routers answered, per second.",
            [target(rate(m.ROUTER_REQUESTS), "requests/s")], "reqps", w=6, h=5)
    b.panel("stat", "Error ratio", "Share of requests not answered successfully (client errors included).",
            [target(f"1 - ({SUCCESS_RATE} / {rate(m.ROUTER_REQUESTS)})", "errors")], "percentunit", w=6, h=5,
            **pct)
    b.panel("timeseries", "Goodput and request rate", "Per DisaggDeployment.", [
        target(f"{rate(m.ROUTER_REQUESTS, SUCCESS, by='namespace, deployment')}"
               f" * on (namespace, deployment) "
               f"({rate(m.ROUTER_TTFT_SECONDS + '_bucket', le('ttft_target'), by='namespace, deployment')}"
               f" / {rate(m.ROUTER_TTFT_SECONDS + '_count', by='namespace, deployment')})"
               f" * on (namespace, deployment) "
               f"({rate(m.ROUTER_ITL_SECONDS + '_bucket', le('itl_target'), by='namespace, deployment')}"
               f" / {rate(m.ROUTER_ITL_SECONDS + '_count', by='namespace, deployment')})",
               "{{deployment}} goodput"),
        target(rate(m.ROUTER_REQUESTS, by="namespace, deployment"), "{{deployment}} requests")], "reqps")
    b.panel("timeseries", "SLO attainment", "Share of requests inside the TTFT target and of inter-token gaps "
            "inside the ITL target.", [target(TTFT_OK, "TTFT <= ${ttft_target}s"),
                                       target(ITL_OK, "ITL <= ${itl_target}s"),
                                       target(f"{TTFT_OK} * {ITL_OK}", "both")], "percentunit", **pct)
    b.row("Latency")
    b.panel("timeseries", "Time to first token", "As the client sees it, from the request's arrival at the router. "
            "With tracing on, exemplars (the dots) link sampled requests to their traces.",
            quantiles(m.ROUTER_TTFT_SECONDS, "TTFT", exemplars=True) + [target("vector(${ttft_target})", "target")],
            "s",
            w=8)
    b.panel("timeseries", "Inter-token latency", "Time between streamed tokens.",
            quantiles(m.ROUTER_ITL_SECONDS, "ITL") + [target("vector(${itl_target})", "target")], "s", w=8)
    b.panel("timeseries", "Request duration", "From arrival at the router to the last token.",
            quantiles(m.ROUTER_E2E_SECONDS, "duration", qs=(0.5, 0.9)), "s", w=8)
    b.row("Traffic")
    b.panel("timeseries", "Requests by outcome", "Requests per second by outcome.",
            [target(rate(m.ROUTER_REQUESTS, by="outcome"), "{{outcome}}")], "reqps", w=8)
    b.panel("timeseries", "Prompt length", "Prompt tokens per request.",
            quantiles(m.ROUTER_INPUT_TOKENS, "input", qs=(0.5, 0.9)) + [target(mean(m.ROUTER_INPUT_TOKENS),
                                                                                "input mean")], "short", w=8)
    b.panel("timeseries", "Output length", "Generated tokens per request.",
            quantiles(m.ROUTER_OUTPUT_TOKENS, "output", qs=(0.5, 0.9)) + [target(mean(m.ROUTER_OUTPUT_TOKENS),
                                                                                  "output mean")], "short", w=8)
    operator_row(b)
    return b


def fleet_rate(metric: str, by: str = "") -> str:
    """The operator's own counters: one operator for every DisaggDeployment, so not selected by them."""
    group = f" by ({by})" if by else ""
    return f"sum{group} (rate({metric}[{RATE}]))"


CONDITIONS = 'type=~"Ready|GangScheduled|Degraded"'


def operator_row(b: Board) -> None:
    """The operator's metrics (disagg_operator_*, scraped through the chart's ServiceMonitor with the
    labels the operator sets). Conditions are per DisaggDeployment; the rest covers every deployment the
    operator watches."""
    b.row("Operator")
    b.panel("timeseries", "Conditions", "The operator's conditions per DisaggDeployment: 1 True, 0 False, "
            "with their reason (GangScheduled False with InsufficientCapacity or GangTimeout: the gang cannot "
            "be placed).", [target(f"max by (deployment, type, reason) ({m.OPERATOR_CONDITION}{sel(CONDITIONS)})",
                                   "{{deployment}} {{type}} ({{reason}})")],
            "short", w=12, decimals=0, min=0, max=1)
    b.panel("timeseries", "DisaggDeployments by phase", "Every DisaggDeployment the operator watches, by phase.",
            [target(f"sum by (phase) ({m.OPERATOR_DEPLOYMENTS})", "{{phase}}")], "short", w=12, decimals=0)
    b.panel("timeseries", "Gang wait", "From the first pod of a gang to its whole minimum set bound (all "
            "deployments).", [target(f"histogram_quantile({q}, sum by (le) "
                                     f"(rate({m.OPERATOR_GANG_WAIT_SECONDS}_bucket[{RATE}])))", f"p{round(q * 100)}")
                              for q in (0.5, 0.9)], "s", w=8)
    b.panel("timeseries", "Reconciles by result", "Reconciles per second (all deployments): applied, unchanged, "
            "conflict, error, invalid, blocked.",
            [target(fleet_rate(m.OPERATOR_RECONCILES, "result"), "{{result}}")], "ops", w=8)
    b.panel("timeseries", "API writes and reverted hand edits", "Server-side applies of children by kind, status "
            "writes, and children someone else changed that the operator restored (by kind and field manager).", [
                target(fleet_rate(m.OPERATOR_CHILD_WRITES, "kind"), "{{kind}} applies"),
                target(fleet_rate(m.OPERATOR_STATUS_WRITES), "status writes"),
                target(fleet_rate(m.OPERATOR_DRIFT_REVERTS, "kind, manager"), "{{kind}} reverted ({{manager}})")],
            "ops", w=8)


def vllm(metric: str, *extra: str) -> str:
    return f"{metric}{sel(*extra)}"


def prefill_decode() -> Board:
    b = Board("disagg-prefill-decode", "disagg / Prefill and decode",
              "Replicas, queues, KV cache and NIXL KV transfers of the prefill and decode workers (vLLM's metrics, "
              "labelled with their role by the chart's PodMonitor).", ["workers", "vllm", "nixl"])
    b.row("Replicas and load")
    b.panel("timeseries", "Replicas: desired and ready", "Desired: the planner's decision (planner on). Ready: "
            "workers the routers see healthy; not ready: known but failing their health check.", [
                target(f"max by (role) ({m.PLANNER_DESIRED_REPLICAS}{sel()})", "{{role}} desired"),
                target(f"max by (role) ({m.ROUTER_WORKERS}{sel(HEALTHY)})", "{{role}} ready"),
                target(f"max by (role) ({m.ROUTER_WORKERS}{sel(UNHEALTHY)})", "{{role}} not ready")],
            "short", w=8, decimals=0)
    b.panel("timeseries", "Queued requests", "Requests waiting in the engines' queues, by role.",
            [target(f"sum by (role) ({vllm(m.VLLM_NUM_REQUESTS_WAITING)})", "{{role}} waiting")], "short", w=8)
    b.panel("timeseries", "Running requests", "Requests in the engines' running batches, by role.",
            [target(f"sum by (role) ({vllm(m.VLLM_NUM_REQUESTS_RUNNING)})", "{{role}} running")], "short", w=8)
    b.panel("timeseries", "KV cache usage", "Share of the GPU KV cache in use: mean and fullest worker, by role.", [
        target(f"avg by (role) ({vllm(m.VLLM_KV_CACHE_USAGE)})", "{{role}} mean"),
        target(f"max by (role) ({vllm(m.VLLM_KV_CACHE_USAGE)})", "{{role}} max")], "percentunit", min=0, max=1)
    b.panel("timeseries", "Engine prefix cache hit ratio", "Prompt tokens found in each engine's prefix cache.", [
        target(f"{rate(m.VLLM_PREFIX_CACHE_HITS + '_total', by='role')} / "
               f"{rate(m.VLLM_PREFIX_CACHE_QUERIES + '_total', by='role')}", "{{role}}")], "percentunit",
        min=0, max=1)
    b.row("NIXL KV transfer")
    b.panel("timeseries", "Transfer time", "Duration of one NIXL KV-cache transfer (decode pulling prefilled "
            "blocks).", quantiles(m.VLLM_NIXL_XFER_TIME_SECONDS, "transfer", by="role"), "s", w=8)
    b.panel("timeseries", "Bytes transferred", "KV-cache bytes moved over NIXL per second, by role.",
            [target(rate(m.VLLM_NIXL_BYTES_TRANSFERRED + "_sum", by="role"), "{{role}}")], "Bps", w=8)
    b.panel("timeseries", "Transfers and failures", "NIXL transfers per second, and failed transfers "
            "(handshake and notification failures included).", [
                target(rate(m.VLLM_NIXL_BYTES_TRANSFERRED + "_count", by="role"), "{{role}} transfers"),
                target(rate(m.VLLM_NIXL_FAILED_TRANSFERS + "_total", by="role"), "{{role}} failed")], "ops", w=8)
    b.panel("timeseries", "Bytes per transfer", "Size of one NIXL transfer.",
            quantiles(m.VLLM_NIXL_BYTES_TRANSFERRED, "size", qs=(0.5, 0.9)), "bytes", w=24)
    return b


def router() -> Board:
    b = Board("disagg-router", "disagg / Router",
              "The routers' decisions: path per request (remote prefill, local prefill, fallback), workers "
              "chosen, prefix hits and fallbacks; admission (queue, wait, 429s); streams migrated after a "
              "worker failure, pairings refused across KV revisions, and the prefix index's resyncs.", ["router"])
    b.row("Paths")
    b.panel("timeseries", "Requests by path", "Successful requests per second by the path they took.",
            [target(rate(m.ROUTER_REQUESTS, SUCCESS, by="path"), "{{path}}")], "reqps")
    b.panel("stat", "Prefilled remotely", "Share of successful requests whose prompt a prefill worker computed.",
            [target(f"{rate(m.ROUTER_REQUESTS, SUCCESS, REMOTE)}"
                    f" / {SUCCESS_RATE}", "remote prefill")], "percentunit", w=6, min=0, max=1)
    b.panel("stat", "Prefix hit ratio", "Prompt tokens the chosen prefilling worker already held.",
            [target(f"{rate(m.ROUTER_CACHED_PROMPT_TOKENS)} / {rate(m.ROUTER_PROMPT_TOKENS)}", "hit ratio")],
            "percentunit", w=6, min=0, max=1)
    b.panel("timeseries", "Fallbacks by reason", "Requests that left the disaggregated path: a failed or slow "
            "prefill (prefill_error, prefill_timeout), a decode retried elsewhere before its first token "
            "(decode_retry), a failed KV transfer (kv_transfer_failed), a decode given up while it waited for KV "
            "from a prefill that went unhealthy (prefill_lost).",
            [target(rate(m.ROUTER_FALLBACKS, by="reason"), "{{reason}}")], "reqps")
    b.panel("timeseries", "Prefix hit ratio over time", "Cached over routed prompt tokens.",
            [target(f"{rate(m.ROUTER_CACHED_PROMPT_TOKENS, by='namespace, deployment')} / "
                    f"{rate(m.ROUTER_PROMPT_TOKENS, by='namespace, deployment')}", "{{deployment}}")],
            "percentunit", min=0, max=1)
    b.row("Decisions")
    b.panel("timeseries", "Routing decisions by worker", "Workers chosen per second, by role.",
            [target(rate(m.ROUTER_ROUTING_DECISIONS, by="role, worker"), "{{role}} {{worker}}")], "ops")
    b.panel("timeseries", "Routing decision time", "Time to pick a worker (tokenization excluded).",
            quantiles(m.ROUTER_ROUTING_SECONDS, "decide", by="role", qs=(0.5, 0.99)), "s")
    b.panel("timeseries", "In-flight requests per worker", "As the routers count them.",
            [target(f"sum by (role, worker) ({m.ROUTER_ACTIVE_REQUESTS}{sel()})", "{{role}} {{worker}}")], "short")
    b.panel("timeseries", "Known workers", "Workers the routers discovered, by role and health.",
            [target(f"max by (role, state) ({m.ROUTER_WORKERS}{sel()})", "{{role}} {{state}}")], "short",
            decimals=0)
    b.row("Admission")
    b.panel("timeseries", "Queued and in-flight requests", "Requests waiting for admission in the routers' "
            "queues (spec.router.maxQueued) and requests admitted (at most spec.router.maxInFlight per router "
            "process). Alert: DisaggRouterQueueing.",
            [target(f"sum ({m.ROUTER_QUEUE_DEPTH}{sel()})", "queued"),
             target(f"sum ({m.ROUTER_IN_FLIGHT}{sel()})", "in flight")], "short", w=8)
    b.panel("timeseries", "Admission wait", "Time admitted requests waited in the routers' queues (0 for those "
            "admitted at once): part of their TTFT, which counts from arrival.",
            quantiles(m.ROUTER_QUEUE_WAIT_SECONDS, "wait"), "s", w=8)
    b.panel("timeseries", "Rejected requests (429)", "Requests refused per second, by reason: queue_full (every "
            "slot and the queue taken), queue_timeout (queued past spec.router.queueTimeoutSeconds). "
            "Alert: DisaggRouterRejecting.",
            [target(rate(m.ROUTER_REJECTED, by="reason"), "{{reason}}")], "reqps", w=8)
    b.row("Worker failures and rollouts")
    b.panel("timeseries", "Migrations by outcome", "Decode streams that failed after their first token, per "
            "second, by what became of them: migrated (continued on a decode worker from the token ids so far; "
            "the client saw one stream), not_needed (failed after its last token), and the client got an error "
            "event: exhausted (spec.router.maxMigrations reached), failed (no decode worker took the "
            "continuation), unsupported (logprobs, tools, structured output). Alert: DisaggMigrationsFailing.",
            [target(rate(m.ROUTER_MIGRATIONS, by="outcome"), "{{outcome}}")], "ops")
    b.panel("timeseries", "Pairing refusals by reason", "Requests whose decode was not paired with a healthy "
            "prefill because that prefill was of another KV revision (other_revision): no revision had a ready "
            "prefill and decode, so they ran decode-only. Brief during a rollout; sustained, a new revision "
            "never got a ready pair. Alert: DisaggPairingRefused.",
            [target(rate(m.ROUTER_PAIRING_REFUSALS, by="reason"), "{{reason}}")], "reqps")
    b.row("Prefix index")
    b.panel("timeseries", "Indexed blocks", "KV blocks in the routers' prefix index, by role.",
            [target(f"max by (role) ({m.ROUTER_INDEXED_BLOCKS}{sel()})", "{{role}}")], "short", w=8)
    b.panel("timeseries", "KV event batches", "KV event batches from the workers applied to the index, per second.",
            [target(rate(m.ROUTER_KV_EVENT_BATCHES), "batches/s")], "ops", w=8)
    b.panel("timeseries", "KV index resyncs", "Times a worker's prefix-index entries were repaired, per second, by "
            "why (join: events published before the router subscribed; gap: batches lost on the socket; "
            "restart: a new engine) and how (replayed: exact again from the worker's replay socket; dropped: "
            "its entries dropped and rebuilt from what remained), and KV event batches not received live. "
            "Alert on dropped: DisaggKVIndexResyncsDropped.",
            [target(rate(m.ROUTER_KV_INDEX_RESYNCS, by="reason, outcome"), "{{reason}} {{outcome}}"),
             target(rate(m.ROUTER_KV_EVENT_BATCHES_MISSED), "batches missed/s")], "ops", w=8)
    return b


def planner() -> Board:
    b = Board("disagg-planner", "disagg / Planner",
              "The SLO planner's decisions against the latency it observed and the load it predicted.", ["planner"])
    b.row("Decisions")
    b.panel("timeseries", "Desired replicas", "Replicas the planner chose, by role.",
            [target(f"max by (role) ({m.PLANNER_DESIRED_REPLICAS}{sel()})", "{{role}}")], "short", decimals=0)
    b.panel("timeseries", "Decisions by direction", "Decisions per interval by role and direction (up, down, hold).",
            [target(f"sum by (role, direction) (increase({m.PLANNER_DECISIONS}{sel()}[{RATE}]))",
                    "{{role}} {{direction}}")], "short")
    b.panel("timeseries", "Decisions by reason", "Why the planner decided what it did.",
            [target(f"sum by (reason) (increase({m.PLANNER_DECISIONS}{sel()}[{RATE}]))", "{{reason}}")], "short")
    b.panel("stat", "Metrics available", "1 while the planner reads every series it needs; 0: it holds.",
            [target(f"min({m.PLANNER_METRICS_AVAILABLE}{sel()})", "available")], "bool_yes_no", w=12,
            mappings=[], thresholds={"mode": "absolute", "steps": [{"color": "red", "value": None},
                                                                   {"color": "green", "value": 1}]})
    b.row("Inputs")
    b.panel("timeseries", "TTFT: observed and target", "The planner's observation at the SLO percentile, the "
            "routers' p90 and the target.", [
                target(f"max({m.PLANNER_OBSERVED_TTFT_SECONDS}{sel()})", "planner observed"),
                target(quantile(0.9, m.ROUTER_TTFT_SECONDS), "router p90"),
                target("vector(${ttft_target})", "target")], "s", w=8)
    b.panel("timeseries", "ITL: observed and target", "The planner's observation at the SLO percentile, the "
            "routers' p90 and the target.", [
                target(f"max({m.PLANNER_OBSERVED_ITL_SECONDS}{sel()})", "planner observed"),
                target(quantile(0.9, m.ROUTER_ITL_SECONDS), "router p90"),
                target("vector(${itl_target})", "target")], "s", w=8)
    b.panel("timeseries", "Request rate: predicted and observed", "The planner's prediction for its next "
            "interval against the routers' measured rate.", [
                target(f"max({m.PLANNER_PREDICTED_REQUEST_RATE}{sel()})", "predicted"),
                target(rate(m.ROUTER_REQUESTS), "observed")], "reqps", w=8)
    return b


BOARDS = {"overview": overview, "prefill-decode": prefill_decode, "router": router, "planner": planner}


def render() -> dict[str, str]:
    return {f"{name}.json": json.dumps(make().json(), indent=2) + "\n" for name, make in BOARDS.items()}


def main(argv: list[str]) -> int:
    stale = []
    for name, text in render().items():
        path = HERE / name
        if "--check" in argv:
            if not path.exists() or path.read_text() != text:
                stale.append(name)
        else:
            path.write_text(text)
    if stale:
        print(f"stale dashboards: {', '.join(stale)}; run python {Path(__file__).relative_to(Path.cwd())}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
