"""The chart's Grafana dashboards checked against a real Prometheus: every panel's every query is run
with the dashboard's template variables filled in, and a panel with a query error or no finite value
is a failure (tests/test_dashboards.py, tests/test_e2e_realnode.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from .providers import CHART

DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))


def panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    """Panels with queries, those inside collapsed rows included."""
    out = []
    for p in dashboard["panels"]:
        out += [p] if p.get("targets") else []
        out += [q for q in p.get("panels", []) if q.get("targets")]
    return out


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value)
    if "$" in expr:
        raise AssertionError(f"an unfilled template variable in {expr}")
    return expr


def finite(result: list[dict[str, Any]]) -> bool:
    values = [v for s in result for _, v in (s.get("values") or [s["value"]])]
    return any(math.isfinite(float(v)) for v in values)


def empty_panels(path: Path, api: Callable[..., dict], variables: dict[str, str], start: float, end: float,
                 skip: set[str] = frozenset()) -> tuple[int, list[str]]:
    """(queries checked, failures) for one dashboard file; `api(path, **params)` answers Prometheus'
    HTTP API (query and query_range)."""
    dashboard = json.loads(path.read_text())
    failures, checked = [], 0
    for panel in panels(dashboard):
        if panel["title"] in skip:
            continue
        for t in panel["targets"]:
            expr = substitute(t["expr"], variables)
            if t.get("instant"):
                r = api("query", query=expr, time=end)
            else:
                r = api("query_range", query=expr, start=start, end=end, step="2s")
            checked += 1
            if r.get("status") != "success":
                failures.append(f"{dashboard['title']} / {panel['title']} [{t['refId']}]: query error "
                                f"{r.get('error')}: {expr}")
            elif not finite(r["data"]["result"]):
                failures.append(f"{dashboard['title']} / {panel['title']} [{t['refId']}]: no data: {expr}")
    return checked, failures
