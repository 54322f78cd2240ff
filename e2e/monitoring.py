"""The chart's Prometheus Operator objects as a plain Prometheus would run them, for clusters without the
Prometheus Operator (the local control plane): each PodMonitor and ServiceMonitor becomes a scrape job
with Kubernetes service discovery against the cluster's API server, relabelled the way the Prometheus
Operator generates it (selector, port and phase filters, namespace/pod/container/job/endpoint labels,
then the monitor's own relabelings); each PrometheusRule becomes a rule group file.

Only the parts of the Prometheus Operator's generation that the chart uses are covered: label selectors
with matchLabels and `In` expressions, namespaceSelector any/matchNames, named ports (or a PodMonitor
endpoint without one: every container port), path, interval,
honorLabels, relabelings and metricRelabelings. A monitor using anything else is refused with a clear
error rather than scraped differently from a real cluster.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import yaml

MONITOR_KINDS = ("PodMonitor", "ServiceMonitor", "PrometheusRule")


def chart_objects(helm: Path, chart: Path, release: str, namespace: str, *values: str) -> list[dict[str, Any]]:
    """`helm template` of the chart as installed with these values, with the monitoring API present."""
    out = subprocess.run([str(helm), "template", release, str(chart), "--namespace", namespace,
                          "--api-versions", "monitoring.coreos.com/v1", *values],
                         check=True, capture_output=True, text=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _sanitize(label: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", label)


def relabel(rules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prometheus Operator relabelings (camelCase) as Prometheus relabel_configs."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{keys.get(k, k): (v.lower() if k == "action" else v) for k, v in r.items()} for r in rules]


def _selector_keep(selector: dict[str, Any], meta: str) -> list[dict[str, Any]]:
    """keep rules for a label selector over `__meta_kubernetes_<meta>_label_*`."""
    out = []
    for key, value in (selector.get("matchLabels") or {}).items():
        s = _sanitize(key)
        out.append({"action": "keep", "source_labels": [f"__meta_kubernetes_{meta}_label_{s}",
                                                        f"__meta_kubernetes_{meta}_labelpresent_{s}"],
                    "regex": f"({re.escape(value)});true"})
    for expr in selector.get("matchExpressions") or []:
        if expr["operator"] != "In":
            raise ValueError(f"matchExpressions operator {expr['operator']!r} is not translated")
        s = _sanitize(expr["key"])
        out.append({"action": "keep", "source_labels": [f"__meta_kubernetes_{meta}_label_{s}",
                                                        f"__meta_kubernetes_{meta}_labelpresent_{s}"],
                    "regex": "(" + "|".join(re.escape(v) for v in expr["values"]) + ");true"})
    return out


def _namespaces(monitor: dict[str, Any]) -> dict[str, Any]:
    sel = monitor["spec"].get("namespaceSelector") or {}
    if sel.get("any"):
        return {}
    return {"names": sel.get("matchNames") or [monitor["metadata"]["namespace"]]}


def _sd(role: str, monitor: dict[str, Any], kubeconfig: Path) -> list[dict[str, Any]]:
    sd: dict[str, Any] = {"role": role, "kubeconfig_file": str(kubeconfig)}
    names = _namespaces(monitor)
    if names:
        sd["namespaces"] = names
    return [sd]


def pod_monitor_jobs(pm: dict[str, Any], kubeconfig: Path) -> list[dict[str, Any]]:
    ns, name = pm["metadata"]["namespace"], pm["metadata"]["name"]
    jobs = []
    for i, ep in enumerate(pm["spec"]["podMetricsEndpoints"]):
        if set(ep) & {"portNumber", "targetPort"}:
            raise ValueError(f"PodMonitor {name}: only named ports (or none: every port) are translated")
        # no port: every container port of the pod is a target (the monitor's relabelings pick among them)
        by_port = [{"action": "keep", "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                    "regex": ep["port"]}] if "port" in ep else []
        endpoint = [{"target_label": "endpoint", "replacement": ep["port"]}] if "port" in ep else []
        job = {
            "job_name": f"podMonitor/{ns}/{name}/{i}",
            "honor_labels": bool(ep.get("honorLabels", False)),
            "metrics_path": ep.get("path", "/metrics"),
            "kubernetes_sd_configs": _sd("pod", pm, kubeconfig),
            "relabel_configs": [
                *_selector_keep(pm["spec"].get("selector") or {}, "pod"),
                *by_port,
                {"action": "drop", "source_labels": ["__meta_kubernetes_pod_phase"], "regex": "(Failed|Succeeded)"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"target_label": "job", "replacement": f"{ns}/{name}"},
                *endpoint,
                *relabel(ep.get("relabelings") or []),
            ],
            "metric_relabel_configs": relabel(ep.get("metricRelabelings") or []),
        }
        if ep.get("interval"):
            job["scrape_interval"] = ep["interval"]
        jobs.append(job)
    return jobs


def service_monitor_jobs(sm: dict[str, Any], kubeconfig: Path) -> list[dict[str, Any]]:
    ns, name = sm["metadata"]["namespace"], sm["metadata"]["name"]
    jobs = []
    for i, ep in enumerate(sm["spec"]["endpoints"]):
        job = {
            "job_name": f"serviceMonitor/{ns}/{name}/{i}",
            "honor_labels": bool(ep.get("honorLabels", False)),
            "metrics_path": ep.get("path", "/metrics"),
            "kubernetes_sd_configs": _sd("endpoints", sm, kubeconfig),
            "relabel_configs": [
                *_selector_keep(sm["spec"].get("selector") or {}, "service"),
                {"action": "keep", "source_labels": ["__meta_kubernetes_endpoint_port_name"], "regex": ep["port"]},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "service"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
                {"source_labels": ["__meta_kubernetes_pod_container_name"], "target_label": "container"},
                {"source_labels": ["__meta_kubernetes_service_name"], "target_label": "job"},
                {"target_label": "endpoint", "replacement": ep["port"]},
                *relabel(ep.get("relabelings") or []),
            ],
            "metric_relabel_configs": relabel(ep.get("metricRelabelings") or []),
        }
        if ep.get("interval"):
            job["scrape_interval"] = ep["interval"]
        jobs.append(job)
    return jobs


def scrape_configs(objects: list[dict[str, Any]], kubeconfig: Path) -> list[dict[str, Any]]:
    """Every PodMonitor's and ServiceMonitor's jobs, discovering targets through `kubeconfig`."""
    jobs: list[dict[str, Any]] = []
    for o in objects:
        if o["kind"] == "PodMonitor":
            jobs += pod_monitor_jobs(o, kubeconfig)
        elif o["kind"] == "ServiceMonitor":
            jobs += service_monitor_jobs(o, kubeconfig)
    return jobs


def rule_groups(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rule groups of every PrometheusRule, as a rule file's `groups`."""
    return [g for o in objects if o["kind"] == "PrometheusRule" for g in o["spec"]["groups"]]
