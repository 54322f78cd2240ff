"""Where the planner's observations come from: Prometheus (prometheus-api-client).

TTFT and ITL are first-token times and gaps between tokens, never whole durations: the router's histograms
where streams show them, else (a window of non-streaming requests only) vLLM's own TTFT and ITL histograms
of the workers.

The router's metrics (``disagg.api.metrics``) carry ``namespace`` and ``deployment``
labels; the workers' vLLM metrics carry them too plus ``role`` (the chart's pod
monitor copies them from the pods' labels). One :class:`PrometheusSource` per
Prometheus, created once and reused.

Unreachable Prometheus -> ``Observation.unavailable`` with reason ``PrometheusUnreachable``; Prometheus
answering a query with an error (malformed PromQL, a failed evaluation, its own timeout) -> reason
``QueryError``: the first is an outage, the second a bug or an overload that no waiting will fix. Either way
the planner holds and says why, in words of its own: the endpoint's name, an HTTP status, Prometheus'
error type from a fixed set, an exception's class. Nothing the remote end sent is copied into status or
events (an endpoint that is not what it claims could otherwise be read back through them). TLS is verified
(the endpoint's CA file, else the system's trust store) unless the endpoint says ``insecureSkipVerify``. A required series absent or NaN ->
``Observation.missing`` names it. With no traffic the latency quantiles are NaN by nature: not missing,
the deployment is idle.

Windows: ``rate()`` needs two samples inside its window, so a window shorter than two scrape intervals is
empty now and then, and one of under four goes empty whenever a scrape is late or missed. The planner's
window is its interval, but never under :data:`SCRAPES_PER_WINDOW` scrape intervals (:func:`query_window`);
the scrape interval is the planner's ``--scrape-interval`` (the chart passes its pod monitors' interval).

Capacity while saturated (:func:`disagg.planner.decide.learn_capacity`): per worker (``instance``), a
replica whose ``num_requests_waiting`` stayed at 1 or more over the whole window (``min_over_time``) ran
flat out; the mean over those replicas of their uncached prompt tokens/s (prompt tokens less prefix-cache
hits, prefill) or their generation tokens/s and running requests (decode) is what one replica really
serves. The fast path (:meth:`PrometheusSource.observe_queues`) reads the waiting queues and their growth
(``deriv``) over :data:`FAST_SCRAPES` scrape intervals. A queue is the requests waiting for a slot (vLLM's
``num_requests_waiting_by_reason{reason="capacity"}``, where the engines export it), not those a decode
engine holds while their KV is pulled from the prefill.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from typing import Protocol

from disagg.api import metrics as m
from disagg.perf.serving import TAIL_PERCENTILE

from .decide import Observation
from .reasons import PROMETHEUS_UNREACHABLE, QUERY_ERROR

SCRAPES_PER_WINDOW = 4
FAST_SCRAPES = 3                # the fast path's window for a queue's growth (deriv needs two samples)
DEFAULT_SCRAPE_INTERVAL = 15.0  # seconds: the chart's pod monitors' default
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d|w|y)")
_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def parse_duration(text: str | float) -> float:
    """Seconds in a Prometheus duration (``15s``, ``1m30s``, ``500ms``) or a plain number of seconds."""
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        text = text.strip()
        try:
            seconds = float(text)
        except ValueError:
            parts = _DURATION.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ValueError(f"not a Prometheus duration: {text!r} (e.g. 15s, 1m, 1m30s)") from None
            seconds = sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    if not seconds > 0:
        raise ValueError(f"a scrape interval must be positive, not {text!r}")
    return seconds


def query_window(interval_seconds: float, scrape_interval_seconds: float) -> float:
    """The range of the planner's ``rate()`` queries: its interval, at least four scrape intervals."""
    return max(float(interval_seconds), SCRAPES_PER_WINDOW * scrape_interval_seconds)


# Prometheus' HTTP API error types; anything else an endpoint sends is reported as "unknown"
ERROR_TYPES = frozenset({"bad_data", "execution", "timeout", "canceled", "internal", "unavailable", "not_found",
                         "not_acceptable"})


class QueryRefused(Exception):
    """Prometheus answered, with an error (its API's ``{"status": "error"}``). Carries the HTTP status and the
    error type only: Prometheus' message stays out of status (it is the remote end's text)."""

    def __init__(self, status: int, error_type: str):
        self.status = status
        self.error_type = error_type if error_type in ERROR_TYPES else "unknown"
        super().__init__(f"HTTP {status}, {self.error_type}")


class NotPrometheus(Exception):
    """An answer that is not Prometheus' API (a proxy's error page, another server): as good as unreachable."""

    def __init__(self, status: int):
        self.status = status
        super().__init__(f"HTTP {status}")


class MetricsSource(Protocol):
    def observe(self, namespace: str, name: str, percentile: float, window_seconds: float) -> Observation: ...

    # optional (the fast path between decisions): the waiting queues, their growth and the ready replicas
    # def observe_queues(self, namespace: str, name: str, window_seconds: float) -> Observation: ...
    # optional (spec.flex): the flex pool's drains and per-pod load
    # def observe_flex(self, namespace: str, name: str) -> FlexSignals: ...


@dataclass(frozen=True)
class Labels:
    namespace: str = "namespace"
    deployment: str = "deployment"
    role: str = "role"


def _quantile(q: float, metric: str, sel: str, window: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{sel}}}[{window}])))"


def _mean(metric: str, sel: str, window: str) -> str:
    return f"sum(rate({metric}_sum{{{sel}}}[{window}])) / sum(rate({metric}_count{{{sel}}}[{window}]))"


def _waiting(sel: str, role: str, role_value: str, over: str = "") -> tuple[str, str]:
    """A role's queue, per series, as two selectors (``over``: a range, ``[5s]``): the requests waiting for a
    slot (vLLM's waiting by reason ``capacity``), where the engines say so; else all waiting. A decode engine
    counts among its waiting requests those whose KV is still being pulled from the prefill (reason
    ``deferred``): on a busy CPU, or a slow link, one or two at any time with no queue at all."""
    def both(metric: str) -> str:
        return f"{metric}|{metric.replace(':', '_')}"
    by_reason = (f'{{__name__=~"{both(m.VLLM_NUM_REQUESTS_WAITING_BY_REASON)}",{sel},{role}="{role_value}",'
                 f'reason="{m.VLLM_WAITING_CAPACITY}"}}{over}')
    waiting = f'{{__name__=~"{both(m.VLLM_NUM_REQUESTS_WAITING)}",{sel},{role}="{role_value}"}}{over}'
    return by_reason, waiting


def queries(namespace: str, name: str, percentile: float, window_seconds: float,
            labels: Labels = Labels()) -> dict[str, str]:
    """The PromQL the planner runs, by Observation field."""
    sel = f'{labels.namespace}="{namespace}",{labels.deployment}="{name}"'
    w = f"{max(int(round(window_seconds)), 1)}s"
    q = percentile / 100.0
    role = labels.role

    def vllm(metric: str, role_value: str) -> str:
        # vLLM's names have a colon; an OpenMetrics scrape of a recent prometheus_client stores them with an
        # underscore instead: match either spelling
        both = f"{metric}|{metric.replace(':', '_')}"
        return f'{{__name__=~"{both}",{sel},{role}="{role_value}"}}'

    def engine_quantile(metric: str, role_value: str) -> str:
        return (f"histogram_quantile({q}, sum by (le) (rate("
                f"{vllm(metric + '_bucket', role_value)}[{w}])))")

    def queue(role_value: str) -> str:
        by_reason, waiting = _waiting(sel, role, role_value)
        return f"(sum({by_reason}) or sum({waiting}))"

    def saturated(role_value: str) -> str:
        # the workers of the role whose queue never emptied over the window (one series each)
        by_reason, waiting = _waiting(sel, role, role_value, f"[{w}]")
        return (f"((min by (instance) (min_over_time({by_reason})) or min by (instance) (min_over_time({waiting})))"
                " >= 1)")

    def per_saturated(expr: str, role_value: str) -> str:
        # the mean over saturated workers of a per-worker expression; empty when none was saturated
        return (f"sum(({expr}) and on (instance) {saturated(role_value)}) / "
                f"count({saturated(role_value)})")

    def per_worker_rate(metric: str, role_value: str) -> str:
        return f"sum by (instance) (rate({vllm(metric + '_total', role_value)}[{w}]))"

    return {
        "request_rate": f"sum(rate({m.ROUTER_REQUESTS}{{{sel}}}[{w}]))",
        "ttft": _quantile(q, m.ROUTER_TTFT_SECONDS, sel, w),
        "itl": _quantile(q, m.ROUTER_ITL_SECONDS, sel, w),
        # the router sees first tokens and gaps of streams only; with no stream in the window, the engines'
        # own histograms stand in (prefill's TTFT plus decode's, which with KV transfer follows it)
        "ttft_streams": f"sum(rate({m.ROUTER_TTFT_SECONDS}_count{{{sel}}}[{w}]))",
        "itl_streams": f"sum(rate({m.ROUTER_ITL_SECONDS}_count{{{sel}}}[{w}]))",
        "engine_ttft_prefill": engine_quantile(m.VLLM_TTFT_SECONDS, "prefill"),
        "engine_ttft_decode": engine_quantile(m.VLLM_TTFT_SECONDS, "decode"),
        "engine_itl": engine_quantile(m.VLLM_ITL_SECONDS, "decode"),
        "input_tokens_mean": _mean(m.ROUTER_INPUT_TOKENS, sel, w),
        "input_tokens_p": _quantile(q, m.ROUTER_INPUT_TOKENS, sel, w),
        # the prompt mix's tail beside the SLO's percentile (a Pareto or multi-tenant tail the p90 hides)
        "input_tokens_tail": _quantile(TAIL_PERCENTILE / 100.0, m.ROUTER_INPUT_TOKENS, sel, w),
        "output_tokens_mean": _mean(m.ROUTER_OUTPUT_TOKENS, sel, w),
        "output_tokens_p": _quantile(q, m.ROUTER_OUTPUT_TOKENS, sel, w),
        "prefix_hit_ratio": (f"sum(rate({m.ROUTER_CACHED_PROMPT_TOKENS}{{{sel}}}[{w}])) / "
                             f"sum(rate({m.ROUTER_PROMPT_TOKENS}{{{sel}}}[{w}]))"),
        "prefill_queue": queue("prefill"),
        "decode_queue": queue("decode"),
        "prefill_running": f"sum({vllm(m.VLLM_NUM_REQUESTS_RUNNING, 'prefill')})",
        "decode_running": f"sum({vllm(m.VLLM_NUM_REQUESTS_RUNNING, 'decode')})",
        "decode_kv_usage": f"avg({vllm(m.VLLM_KV_CACHE_USAGE, 'decode')})",
        # LoRA adapters some decode worker holds (each router reports the same workers: max by adapter)
        "lora_adapters": (f'count(max by (adapter) ({m.ROUTER_ADAPTER_WORKERS}{{{sel},role="decode"}}) > 0)'),
        # replicas serving: the engines reporting
        "prefill_ready": f"count(sum by (instance) ({vllm(m.VLLM_NUM_REQUESTS_RUNNING, 'prefill')}))",
        "decode_ready": f"count(sum by (instance) ({vllm(m.VLLM_NUM_REQUESTS_RUNNING, 'decode')}))",
        # what a saturated replica serves (learn_capacity)
        "prefill_saturated_tokens": per_saturated(
            f"{per_worker_rate(m.VLLM_PROMPT_TOKENS, 'prefill')} - "
            f"{per_worker_rate(m.VLLM_PREFIX_CACHE_HITS, 'prefill')}", "prefill"),
        "decode_saturated_tokens": per_saturated(per_worker_rate(m.VLLM_GENERATION_TOKENS, "decode"), "decode"),
        "decode_saturated_batch": per_saturated(
            f"sum by (instance) (avg_over_time({vllm(m.VLLM_NUM_REQUESTS_RUNNING, 'decode')}[{w}]))", "decode"),
    }


def queue_queries(namespace: str, name: str, window_seconds: float, labels: Labels = Labels()) -> dict[str, str]:
    """The fast path's PromQL: each role's waiting queue now, its growth (requests/s) over the window and
    the replicas serving."""
    sel = f'{labels.namespace}="{namespace}",{labels.deployment}="{name}"'
    w = f"{max(int(round(window_seconds)), 1)}s"
    out = {}
    for role_value in ("prefill", "decode"):
        by_reason, waiting = _waiting(sel, labels.role, role_value)
        running = (f'{{__name__=~"{m.VLLM_NUM_REQUESTS_RUNNING}|{m.VLLM_NUM_REQUESTS_RUNNING.replace(":", "_")}",'
                   f'{sel},{labels.role}="{role_value}"}}')
        out[f"{role_value}_queue"] = f"(sum({by_reason}) or sum({waiting}))"
        out[f"{role_value}_queue_growth"] = f"(sum(deriv({by_reason}[{w}])) or sum(deriv({waiting}[{w}])))"
        out[f"{role_value}_ready"] = f"count(sum by (instance) ({running}))"
    return out


def flex_queries(namespace: str, name: str, labels: Labels = Labels()) -> dict[str, str]:
    """What the planner reads of a flex pool (spec.flex) beside its pods: the workers each role's routers
    have draining for a switch (a router process per series; each sees every worker, so the largest count
    is the one furthest behind), the switches the routers carried out (their flips, by direction and
    outcome, summed over the router processes), and per pod the requests running and waiting on its engine
    (the chart's pod monitor labels a flex worker's series with its serving role and its pod)."""
    sel = f'{labels.namespace}="{namespace}",{labels.deployment}="{name}"'
    engine = "|".join(f"{n}|{n.replace(':', '_')}" for n in (m.VLLM_NUM_REQUESTS_RUNNING, m.VLLM_NUM_REQUESTS_WAITING))
    return {"draining": f'max by (role) ({m.ROUTER_FLEX_WORKERS}{{{sel},state="draining"}})',
            "switches": f"sum by (from_role, to_role, outcome) ({m.ROUTER_ROLE_SWITCHES}{{{sel}}})",
            "load": f'sum by (pod) ({{__name__=~"{engine}",{sel},pod!=""}})'}


@dataclass(frozen=True)
class FlexSignals:
    """A flex pool as its routers and engines report it (:meth:`PrometheusSource.observe_flex`)."""

    draining: dict[str, float] | None = None   # role -> workers draining out of it; None: not known
    load: dict[str, float] | None = None       # pod -> requests running and waiting on its engine
    # (from role, to role, outcome) -> the routers' flips so far (disagg_router_role_switches_total); None:
    # not known
    switches: dict[tuple[str, str, str], float] | None = None
    error: str = ""

    def flips(self, frm: str, to: str) -> tuple[float, float] | None:
        """The routers' flips from ``frm`` to ``to`` so far: (after the drain, past its bound); None: not
        known (a router that never flipped that way has no series: 0)."""
        if self.switches is None:
            return None
        return (self.switches.get((frm, to, m.SWITCH_SWITCHED), 0.0),
                self.switches.get((frm, to, m.SWITCH_ABANDONED), 0.0))


# needed whenever there is traffic; the rest is used when present
REQUIRED_WITH_TRAFFIC = ("ttft", "itl", "input_tokens_mean", "output_tokens_mean")


def _client(url: str, timeout: float, verify: bool | str = True):
    from prometheus_api_client import PrometheusConnect
    from urllib3.util.retry import Retry

    class Client(PrometheusConnect):
        """prometheus-api-client whose instant query keeps Prometheus' error answer (its ``custom_query``
        folds every non-200 answer into one exception carrying the raw body)."""

        def instant(self, promql: str, at: float | None = None) -> list[dict]:
            params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
            response = self._session.request(method="GET", url=f"{self.url}/api/v1/query", params=params,
                                             verify=self._session.verify, headers=self.headers, auth=self.auth,
                                             cert=self._session.cert, timeout=self._timeout)
            try:
                body = response.json()
            except ValueError:  # not Prometheus' API answering (a proxy's error page): as good as unreachable
                raise NotPrometheus(response.status_code) from None
            if not isinstance(body, dict):
                raise NotPrometheus(response.status_code)
            if response.status_code == 200 and body.get("status") == "success":
                try:
                    return list(body["data"]["result"])
                except (KeyError, TypeError):
                    raise NotPrometheus(response.status_code) from None
            if body.get("status") == "error":
                raise QueryRefused(response.status_code, str(body.get("errorType", "")))
            raise NotPrometheus(response.status_code)

    # no retries inside one observation: the planner's next interval is the retry
    c = Client(url=url, disable_ssl=verify is False, timeout=timeout, retry=Retry(total=0))
    c._session.verify = verify   # a CA file (str), the system's trust store (True) or off (False)
    return c


class PrometheusSource:
    def __init__(self, url: str, timeout: float = 5.0, labels: Labels = Labels(), verify: bool | str = True,
                 name: str | None = None):
        """``name``: the allowlist entry it reads (how status refers to it); ``verify``: as ``requests``'."""
        self.url = url
        self.name = name
        self.labels = labels
        self._client = _client(url, timeout, verify)

    @classmethod
    def for_endpoint(cls, endpoint, timeout: float = 5.0) -> PrometheusSource:
        """A source for one :class:`disagg.planner.endpoints.Endpoint` of the allowlist."""
        return cls(endpoint.url, timeout, verify=endpoint.verify, name=endpoint.name)

    @property
    def what(self) -> str:
        return f"Prometheus endpoint {self.name!r}" if self.name else f"Prometheus at {self.url}"

    def close(self) -> None:
        self._client.close()

    def _scalar(self, promql: str, at: float | None = None) -> float | None:
        result = self._client.instant(promql, at)
        if not result:
            return None
        value = float(result[0]["value"][1])
        return value if math.isfinite(value) else None

    def observe(self, namespace: str, name: str, percentile: float, window_seconds: float) -> Observation:
        now = time.time()
        values: dict[str, float | None] = {}
        reads: list[tuple[str, str, float | None]] = []
        try:
            for key, promql in queries(namespace, name, percentile, window_seconds, self.labels).items():
                try:
                    values[key] = self._scalar(promql, now)   # one instant for all (observe_queues says why)
                except QueryRefused as e:
                    # the query is the planner's own text; Prometheus' message is not repeated
                    return Observation.unavailable(
                        now, f"{self.what} refused the {key} query ({e}); query: {promql[:300]}", QUERY_ERROR,
                        tuple(reads))
                reads.append((key, promql, values[key]))
        except NotPrometheus as e:
            return Observation.unavailable(now, f"{self.what} unreachable: not Prometheus' API answering ({e})",
                                           PROMETHEUS_UNREACHABLE)
        except Exception as e:  # connection refused, timeout, TLS: hold and say so (the class, not its text)
            return Observation.unavailable(now, f"{self.what} unreachable ({type(e).__name__})",
                                           PROMETHEUS_UNREACHABLE)
        rate = values["request_rate"]
        if rate is None:
            return Observation(time=now, missing=(m.ROUTER_REQUESTS,), reads=tuple(reads))
        ttft, itl = values["ttft"], values["itl"]
        if not values["ttft_streams"]:  # no streamed first token in the window: the engines' TTFT
            engine = [values[k] for k in ("engine_ttft_prefill", "engine_ttft_decode") if values[k] is not None]
            # (the sum of the roles' percentiles: an upper bound on the percentile of their sum)
            ttft = sum(engine) if engine else None
        if not values["itl_streams"]:
            itl = values["engine_itl"]
        values["ttft"], values["itl"] = ttft, itl
        missing: tuple[str, ...] = ()
        if rate > 0:
            names = {"ttft": f"{m.ROUTER_TTFT_SECONDS} (streams) or {m.VLLM_TTFT_SECONDS}",
                     "itl": f"{m.ROUTER_ITL_SECONDS} (streams) or {m.VLLM_ITL_SECONDS}",
                     "input_tokens_mean": m.ROUTER_INPUT_TOKENS, "output_tokens_mean": m.ROUTER_OUTPUT_TOKENS}
            missing = tuple(names[k] for k in REQUIRED_WITH_TRAFFIC if values[k] is None)
        hit = values["prefix_hit_ratio"]
        return Observation(
            time=now, request_rate=rate, ttft=ttft, itl=itl,
            input_tokens_mean=values["input_tokens_mean"], input_tokens_p=values["input_tokens_p"],
            input_tokens_tail=values["input_tokens_tail"],
            output_tokens_mean=values["output_tokens_mean"], output_tokens_p=values["output_tokens_p"],
            prefix_hit_ratio=min(max(hit, 0.0), 1.0) if hit is not None else 0.0,
            prefill_queue=values["prefill_queue"], decode_queue=values["decode_queue"],
            prefill_running=values["prefill_running"], decode_running=values["decode_running"],
            decode_kv_usage=values["decode_kv_usage"], prefill_ready=values["prefill_ready"],
            lora_adapters=values["lora_adapters"],
            decode_ready=values["decode_ready"], prefill_saturated_tokens=values["prefill_saturated_tokens"],
            decode_saturated_tokens=values["decode_saturated_tokens"],
            decode_saturated_batch=values["decode_saturated_batch"], missing=missing, reads=tuple(reads))

    def _vector(self, promql: str, label: str) -> dict[str, float]:
        return {r["metric"].get(label, ""): float(r["value"][1]) for r in self._client.instant(promql)
                if math.isfinite(float(r["value"][1]))}

    def _vector_by(self, promql: str, *labels: str) -> dict[tuple[str, ...], float]:
        return {tuple(r["metric"].get(k, "") for k in labels): float(r["value"][1])
                for r in self._client.instant(promql) if math.isfinite(float(r["value"][1]))}

    def observe_flex(self, namespace: str, name: str) -> FlexSignals:
        """The flex pool's drains and per-pod load; on any failure, nothing known and why (the planner
        then treats a switch it asked for as draining until its bound, and every worker as idle)."""
        q = flex_queries(namespace, name, self.labels)
        try:
            return FlexSignals(draining=self._vector(q["draining"], "role"), load=self._vector(q["load"], "pod"),
                               switches=self._vector_by(q["switches"], "from_role", "to_role", "outcome"))
        except QueryRefused as e:
            return FlexSignals(error=f"{self.what} refused a flex query ({e})")
        except Exception as e:
            return FlexSignals(error=f"{self.what} unreachable ({type(e).__name__})")

    def observe_queues(self, namespace: str, name: str, window_seconds: float) -> Observation:
        """The fast path's snapshot: waiting queues, their growth and the ready replicas (no traffic figures)."""
        now = time.time()
        values: dict[str, float | None] = {}
        reads: list[tuple[str, str, float | None]] = []
        try:
            # every query at the same instant: a scrape landing between two of them would otherwise pair a
            # queue read before it with a growth read after it (a growing queue that is empty)
            for key, promql in queue_queries(namespace, name, window_seconds, self.labels).items():
                values[key] = self._scalar(promql, now)
                reads.append((key, promql, values[key]))
        except QueryRefused as e:
            return Observation.unavailable(now, f"{self.what} refused a queue query ({e})", QUERY_ERROR)
        except Exception as e:  # (the next full decision reports an outage in status; this one only holds)
            return Observation.unavailable(now, f"{self.what} unreachable ({type(e).__name__})",
                                           PROMETHEUS_UNREACHABLE)
        return Observation(time=now, **values, reads=tuple(reads))
