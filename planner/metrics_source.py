"""Where the planner's observations come from: Prometheus (prometheus-api-client).

The router's metrics (``disagg.api.metrics``) carry ``namespace`` and ``deployment``
labels; the workers' vLLM metrics carry them too plus ``role`` (the chart's pod
monitor copies them from the pods' labels). One :class:`PrometheusSource` per
Prometheus, created once and reused.

Unreachable Prometheus -> ``Observation.unavailable`` (the planner holds and says
why); a required series absent or NaN -> ``Observation.missing`` names it. With no
traffic the latency quantiles are NaN by nature: not missing, the deployment is idle.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Protocol

from disagg.api import metrics as m

from .decide import Observation


class MetricsSource(Protocol):
    def observe(self, namespace: str, name: str, percentile: float, window_seconds: float) -> Observation: ...


@dataclass(frozen=True)
class Labels:
    namespace: str = "namespace"
    deployment: str = "deployment"
    role: str = "role"


def _quantile(q: float, metric: str, sel: str, window: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({metric}_bucket{{{sel}}}[{window}])))"


def _mean(metric: str, sel: str, window: str) -> str:
    return f"sum(rate({metric}_sum{{{sel}}}[{window}])) / sum(rate({metric}_count{{{sel}}}[{window}]))"


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

    return {
        "request_rate": f"sum(rate({m.ROUTER_REQUESTS}{{{sel}}}[{w}]))",
        "ttft": _quantile(q, m.ROUTER_TTFT_SECONDS, sel, w),
        "itl": _quantile(q, m.ROUTER_ITL_SECONDS, sel, w),
        "input_tokens_mean": _mean(m.ROUTER_INPUT_TOKENS, sel, w),
        "input_tokens_p": _quantile(q, m.ROUTER_INPUT_TOKENS, sel, w),
        "output_tokens_mean": _mean(m.ROUTER_OUTPUT_TOKENS, sel, w),
        "output_tokens_p": _quantile(q, m.ROUTER_OUTPUT_TOKENS, sel, w),
        "prefix_hit_ratio": (f"sum(rate({m.ROUTER_CACHED_PROMPT_TOKENS}{{{sel}}}[{w}])) / "
                             f"sum(rate({m.ROUTER_PROMPT_TOKENS}{{{sel}}}[{w}]))"),
        "prefill_queue": f"sum({vllm(m.VLLM_NUM_REQUESTS_WAITING, 'prefill')})",
        "decode_queue": f"sum({vllm(m.VLLM_NUM_REQUESTS_WAITING, 'decode')})",
        "prefill_running": f"sum({vllm(m.VLLM_NUM_REQUESTS_RUNNING, 'prefill')})",
        "decode_running": f"sum({vllm(m.VLLM_NUM_REQUESTS_RUNNING, 'decode')})",
        "decode_kv_usage": f"avg({vllm(m.VLLM_KV_CACHE_USAGE, 'decode')})",
    }


# needed whenever there is traffic; the rest is used when present
REQUIRED_WITH_TRAFFIC = ("ttft", "itl", "input_tokens_mean", "output_tokens_mean")


class PrometheusSource:
    def __init__(self, url: str, timeout: float = 5.0, labels: Labels = Labels()):
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        self.url = url
        self.labels = labels
        # no retries inside one observation: the planner's next interval is the retry
        self._client = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout, retry=Retry(total=0))

    def close(self) -> None:
        self._client.close()

    def _scalar(self, promql: str) -> float | None:
        result = self._client.custom_query(promql)
        if not result:
            return None
        value = float(result[0]["value"][1])
        return value if math.isfinite(value) else None

    def observe(self, namespace: str, name: str, percentile: float, window_seconds: float) -> Observation:
        now = time.time()
        values: dict[str, float | None] = {}
        try:
            for key, promql in queries(namespace, name, percentile, window_seconds, self.labels).items():
                values[key] = self._scalar(promql)
        except Exception as e:  # connection refused, timeout, HTTP error: hold and say so
            return Observation.unavailable(now, f"Prometheus at {self.url} unreachable: {type(e).__name__}: "
                                                f"{str(e)[:200]}")
        rate = values["request_rate"]
        if rate is None:
            return Observation(time=now, missing=(m.ROUTER_REQUESTS,))
        missing: tuple[str, ...] = ()
        if rate > 0:
            names = {"ttft": m.ROUTER_TTFT_SECONDS, "itl": m.ROUTER_ITL_SECONDS,
                     "input_tokens_mean": m.ROUTER_INPUT_TOKENS, "output_tokens_mean": m.ROUTER_OUTPUT_TOKENS}
            missing = tuple(names[k] for k in REQUIRED_WITH_TRAFFIC if values[k] is None)
        hit = values["prefix_hit_ratio"]
        return Observation(
            time=now, request_rate=rate, ttft=values["ttft"], itl=values["itl"],
            input_tokens_mean=values["input_tokens_mean"], input_tokens_p=values["input_tokens_p"],
            output_tokens_mean=values["output_tokens_mean"], output_tokens_p=values["output_tokens_p"],
            prefix_hit_ratio=min(max(hit, 0.0), 1.0) if hit is not None else 0.0,
            prefill_queue=values["prefill_queue"], decode_queue=values["decode_queue"],
            prefill_running=values["prefill_running"], decode_running=values["decode_running"],
            decode_kv_usage=values["decode_kv_usage"], missing=missing)
