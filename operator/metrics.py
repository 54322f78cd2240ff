"""The operator's own Prometheus metrics (names from disagg.api.metrics), served on
``DISAGG_OPERATOR_METRICS_PORT`` (default 8000; 0 turns the endpoint off)."""

from __future__ import annotations

import logging
import os
import threading

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, start_http_server

from disagg.api import metrics as m

log = logging.getLogger("disagg.operator")

reconciles = Counter(m.OPERATOR_RECONCILES.removesuffix("_total"), "Reconciles of a DisaggDeployment by result.",
                     ["result"])
child_writes = Counter(m.OPERATOR_CHILD_WRITES.removesuffix("_total"), "Server-side applies of child objects.",
                       ["kind"])
drift_reverts = Counter(m.OPERATOR_DRIFT_REVERTS.removesuffix("_total"),
                        "Child objects whose spec someone else changed, restored to the rendered spec.",
                        ["kind", "manager"])
group_restarts = Counter(m.OPERATOR_GROUP_RESTARTS.removesuffix("_total"),
                         "Multi-pod replicas recreated as a whole after one of their pods failed or went.",
                         ["namespace", "deployment", "role"])
flex_workers = Gauge(m.OPERATOR_FLEX_WORKERS, "Flex workers by the role their pod's serving-role label says.",
                     ["namespace", "deployment", "role"])
role_switches = Counter(m.OPERATOR_ROLE_SWITCHES.removesuffix("_total"),
                        "Flex workers' serving-role label changes the operator saw.",
                        ["namespace", "deployment", "from_role", "to_role"])
status_writes = Counter(m.OPERATOR_STATUS_WRITES.removesuffix("_total"), "Status subresource writes.")
gang_wait = Histogram(m.OPERATOR_GANG_WAIT_SECONDS, "From the first pod of a gang to the whole minimum set bound.",
                      buckets=(1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600))
deployments = Gauge(m.OPERATOR_DEPLOYMENTS, "DisaggDeployments by phase.", ["phase"])
condition = Gauge(m.OPERATOR_CONDITION, "1 for each condition's current status=True, 0 for False, by reason.",
                  ["namespace", "deployment", "type", "reason"])

_started = threading.Lock()
_port: int | None = None


def port() -> int | None:
    """The endpoint's port in this process, once served."""
    return _port


def serve() -> int | None:
    """Start the endpoint once per process (the tests run the operator several times in one)."""
    global _port
    with _started:
        if _port is None:
            port = int(os.environ.get("DISAGG_OPERATOR_METRICS_PORT", "8000"))
            if port == 0:
                return None
            server, _ = start_http_server(port, registry=REGISTRY)
            _port = server.server_port
            log.info("metrics on :%d/metrics", _port)
        return _port


_conditions: dict[tuple[str, str], dict[str, tuple[str, ...]]] = {}
_phases: dict[tuple[str, str], str] = {}


def observe_status(namespace: str, name: str, status: dict | None) -> None:
    """Keep the condition and phase gauges equal to a deployment's status (None: it is gone)."""
    key = (namespace, name)
    old = _conditions.pop(key, {})
    new: dict[str, tuple[str, ...]] = {}
    for c in (status or {}).get("conditions") or []:
        labels = (namespace, name, c["type"], c.get("reason") or "")
        new[c["type"]] = labels
        condition.labels(*labels).set(1 if c["status"] == "True" else 0)
    for ctype, labels in old.items():
        if new.get(ctype) != labels:
            condition.remove(*labels)
    if status is None:
        _phases.pop(key, None)
    else:
        _conditions[key] = new
        _phases[key] = status.get("phase") or "Pending"
    counts: dict[str, int] = {}
    for phase in _phases.values():
        counts[phase] = counts.get(phase, 0) + 1
    for phase in set(counts) | {"Pending", "Progressing", "Ready", "Degraded", "Failed"}:
        deployments.labels(phase).set(counts.get(phase, 0))
