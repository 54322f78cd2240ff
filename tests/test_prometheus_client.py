"""The tests' local Prometheus answers through prometheus-api-client: instant and range queries, label
values, targets, rules and alerts, and a refused query as an error (never an empty answer)."""

from __future__ import annotations

import time

import pytest

from disagg.api import metrics as m
from disagg.e2e.prometheus import LocalPrometheus, MetricsExporter
from disagg.e2e.testing import wait_for

NS, NAME = "team-p", "client"
RULES = [{"name": "test", "rules": [
    {"record": "test:requests:sum", "expr": f"sum({m.ROUTER_REQUESTS})"},
    {"alert": "TestAlwaysFiring", "expr": "vector(1)", "labels": {"severity": "none"}},
]}]


@pytest.fixture(scope="module")
def prom(tmp_path_factory):
    exporter = MetricsExporter(NS, NAME)
    p = LocalPrometheus(tmp_path_factory.mktemp("prometheus"), [f"127.0.0.1:{exporter.port}"],
                        rule_groups=RULES).start()
    yield p
    p.stop()
    exporter.close()


def test_queries_labels_and_targets(prom):
    sel = f'{m.ROUTER_REQUESTS}{{namespace="{NS}"}}'
    [series] = wait_for(lambda: prom.query(f"sum({sel})"), 30, "the exporter scraped", interval=0.5)
    assert float(series["value"][1]) > 0
    start = time.time() - 30
    wait_for(lambda: len((prom.query_range(f"sum({sel})", start, time.time(), "1s") or [{}])[0].get("values", [])) >= 2,
             30, "two scrapes in range", interval=0.5)
    assert NAME in prom.label_values("deployment", sel)
    assert [t["health"] for t in prom.scrape_targets()["activeTargets"]] == ["up"]
    # the answer shape existing callers read (status, data.result), through the same client
    assert prom.api("query", query=f"sum({sel})", time=time.time())["data"]["result"][0]["value"]
    r = prom.api("query_range", query=f"sum({sel})", start=start, end=time.time(), step="1s")
    assert r["status"] == "success" and len(r["data"]["result"][0]["values"]) >= 2
    assert NAME in prom.api("label/deployment/values", **{"match[]": sel})["data"]
    assert prom.api("targets")["data"]["activeTargets"][0]["health"] == "up"


def test_rules_and_alerts(prom):
    firing = wait_for(lambda: [a for a in prom.alerts() if a["labels"]["alertname"] == "TestAlwaysFiring"], 30,
                      "the alert evaluated", interval=0.5)
    assert firing[0]["state"] == "firing"
    rules = [r for g in prom.rules() for r in g["rules"]]
    assert {r["name"] for r in rules} == {"test:requests:sum", "TestAlwaysFiring"}
    wait_for(lambda: all(r["health"] == "ok" for g in prom.rules() for r in g["rules"]), 30, "rules evaluated",
             interval=0.5)
    assert prom.api("rules")["data"]["groups"][0]["name"] == "test"


def test_a_refused_query_is_an_error(prom):
    r = prom.api("query", query="sum(")
    assert r["status"] == "error" and "parse error" in r["error"]
