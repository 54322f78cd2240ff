"""Observed latency against the deployment's targets: ``status.latency`` and the ``SLOMet`` condition.

Pure: from the planner's :class:`~.decide.Observation` (TTFT and ITL at ``spec.slo.percentile``, read from
Prometheus) and ``spec.slo``. The planner writes the result for every deployment with ``spec.slo``, with
or without ``spec.planner.enabled``: the TTFT-ms and ITL-ms columns of ``kubectl get dd`` show it.

SLOMet is True or False only on numbers; Unknown, with a reason saying why, when there are none to judge
(``PrometheusUnreachable`` or ``QueryError``, as the planner's decision says; the router's series absent;
no traffic in the window).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.api import metrics as m
from disagg.api.v1alpha1 import SLOSpec

from .decide import Observation
from .reasons import BOTH_ABOVE, ITL_ABOVE, NO_METRICS, NO_TRAFFIC, TARGETS_MET, TTFT_ABOVE



@dataclass(frozen=True)
class Verdict:
    status: str          # "True", "False", "Unknown"
    reason: str
    message: str
    latency: dict        # status.latency (camelCase), figures present only when measured

    def condition(self) -> tuple[str, str, str]:
        return self.status, self.reason, self.message


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def judge(obs: Observation, slo: SLOSpec, window_seconds: float) -> Verdict:
    p = slo.percentile
    label = f"p{p:g}"
    latency: dict = {"percentile": p}
    if obs.error:
        return Verdict("Unknown", obs.error_reason, obs.error, latency)
    if obs.request_rate is None:
        return Verdict("Unknown", NO_METRICS, f"no {m.ROUTER_REQUESTS} series for this deployment in Prometheus: "
                                              "is the router scraped?", latency)
    if obs.ttft is not None:
        latency["ttftMs"] = _ms(obs.ttft)
    if obs.itl is not None:
        latency["itlMs"] = _ms(obs.itl)
    if obs.request_rate == 0 or obs.ttft is None or obs.itl is None:
        missing = ", ".join(n for n, v in ((m.ROUTER_TTFT_SECONDS, obs.ttft), (m.ROUTER_ITL_SECONDS, obs.itl))
                            if v is None)
        if obs.request_rate == 0:
            return Verdict("Unknown", NO_TRAFFIC, f"no requests in the last {window_seconds:g} s", latency)
        return Verdict("Unknown", NO_METRICS, f"{obs.request_rate:.3g} requests/s but no {missing} in the last "
                                              f"{window_seconds:g} s", latency)
    ttft_ms, itl_ms = latency["ttftMs"], latency["itlMs"]
    ttft_ok, itl_ok = ttft_ms <= slo.ttft_ms, itl_ms <= slo.itl_ms
    message = (f"{label} TTFT {ttft_ms:g} ms {'<=' if ttft_ok else '>'} target {slo.ttft_ms:g} ms, "
               f"{label} ITL {itl_ms:g} ms {'<=' if itl_ok else '>'} target {slo.itl_ms:g} ms "
               f"(last {window_seconds:g} s, {obs.request_rate:.3g} requests/s)")
    if ttft_ok and itl_ok:
        return Verdict("True", TARGETS_MET, message, latency)
    reason = BOTH_ABOVE if not (ttft_ok or itl_ok) else TTFT_ABOVE if not ttft_ok else ITL_ABOVE
    return Verdict("False", reason, message, latency)
