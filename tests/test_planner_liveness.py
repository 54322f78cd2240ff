"""The planner process stays alive through failures and is restarted when it hangs: its liveness probe reads the
loop's progress, not the metrics thread, and no Kubernetes call can hang the loop for good.

A hung API server is made for real: a TCP listener that accepts connections (in the kernel's backlog) and never
answers, which is what a wedged API server, or a connection whose far end went away, looks like to the
client. The probe is the chart's own (its path and port, rendered by helm), asked of a real
``python -m disagg.planner`` process.
"""

from __future__ import annotations

import ast
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from disagg.api import metrics as m
from disagg.api.v1alpha1 import API_VERSION, KIND, DisaggDeploymentSpec
from disagg.e2e.testing import wait_for
from disagg.planner import decide as dc
from disagg.planner import slo
from disagg.planner.apply import Executor, PlannerMetrics
from disagg.planner.loop import GPU_ANNOTATION, PlannerLoop

REPO = Path(__file__).resolve().parent.parent
STALL_SECONDS = 2


@pytest.fixture
def black_hole():
    """An API server that accepts connections and never answers: its URL."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(128)
    yield f"http://127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.fixture(scope="module")
def probe() -> str:
    """The path the chart's planner liveness probe asks, after checking it asks the port the planner's
    --metrics-port serves."""
    from disagg.e2e.localcluster import binaries

    out = subprocess.run([str(binaries() / "helm"), "template", "disagg", str(REPO / "charts" / "disagg"),
                          "--namespace", "disagg-system"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    [planner] = [d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "Deployment"
                 and d["metadata"]["name"].endswith("planner")]
    [container] = planner["spec"]["template"]["spec"]["containers"]
    get = container["livenessProbe"]["httpGet"]
    port = next(p["containerPort"] for p in container["ports"] if p["name"] == get["port"])
    assert f"--metrics-port={port}" in container["args"]
    return get["path"]


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "clusters": [{"name": "c", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}], "current-context": "c"}))
    return path


def _http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body); status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


class _Planner:
    """``python -m disagg.planner`` with a short stall limit, its output in a log file."""

    def __init__(self, kubeconfig: Path, log: Path, *args: str):
        from disagg.workers.ports import free_port

        self.port = free_port()
        self.log = log
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "disagg.planner", "--kubeconfig", str(kubeconfig), f"--metrics-port={self.port}",
             "--tick=0.2", f"--stall-seconds={STALL_SECONDS}", *args], stdout=self._out, stderr=subprocess.STDOUT)

    def get(self, path: str) -> tuple[int, str]:
        assert self.proc.poll() is None, f"the planner exited ({self.proc.returncode}): {self.log.read_text()[-2000:]}"
        return _http_get(self.port, path)

    def stop(self) -> None:
        self.proc.kill()  # (SIGTERM waits for the call in flight: up to its timeout on a silent API server)
        self.proc.wait(30)
        self._out.close()


def test_liveness_fails_while_the_loop_hangs_and_metrics_still_answer(black_hole, probe, tmp_path):
    planner = _Planner(_kubeconfig(tmp_path / "kubeconfig", black_hole), tmp_path / "planner.log",
                       "--namespace=team-a")
    try:
        wait_for(lambda: planner.get("/metrics")[0] == 200, 60, "the planner's metrics port")
        # its first list waits on an API server that never answers: no progress, the probe fails ...
        status, body = wait_for(lambda: (lambda r: r if r[0] == 503 else None)(planner.get(probe)), 60,
                                f"{probe} failing on a hung loop")
        assert body.startswith("stalled: last progress") and f"limit {STALL_SECONDS}s" in body
        # ... while the metrics thread answers as ever (a probe of /metrics would keep the hung planner alive)
        assert planner.get("/metrics")[0] == 200
    finally:
        planner.stop()


@pytest.mark.cluster
def test_liveness_holds_while_the_loop_makes_progress(cluster, api_client, crd_installed, namespace, probe,
                                                      tmp_path):
    """The same process against the local API server, as the planner's ServiceAccount: passes end every tick
    and the probe passes well beyond the stall limit."""
    import time

    from disagg.e2e.operator_fixture import planner_kubeconfig

    kubeconfig = planner_kubeconfig(cluster, api_client, tmp_path / "kubeconfig")
    started = time.time()
    planner = _Planner(kubeconfig, tmp_path / "planner.log", f"--namespace={namespace}")

    def last_pass() -> float:
        status, text = planner.get("/metrics")
        values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(m.PLANNER_LAST_PASS + " ")]
        return values[0] if status == 200 and values else 0.0

    try:
        wait_for(lambda: last_pass() > started + 2 * STALL_SECONDS, 120, "passes past the stall limit")
        status, body = planner.get(probe)
        assert status == 200 and body.startswith("ok"), body
    finally:
        planner.stop()


def _obj(profile: bool = False) -> dict:
    spec = {"model": {"name": "llama", "source": "hf://meta-llama/Llama-3.1-8B-Instruct"},
            "slo": {"ttftMs": 1000, "itlMs": 50}, "planner": {"enabled": True, "prometheus": "main"}}
    if profile:
        spec["planner"]["profileRef"] = {"name": "profile"}
    return {"apiVersion": API_VERSION, "kind": KIND, "spec": spec,
            "metadata": {"name": "llama", "namespace": "team-a", "uid": "u1", "generation": 1,
                         "annotations": {GPU_ANNOTATION: "H100-SXM"}}}


def _bounded(call, what: str, limit: float = 60):
    """Run ``call`` in a thread; fail unless it ends within ``limit`` seconds (its result, or what it raised)."""
    result: dict = {}

    def run():
        try:
            result["value"] = call()
        except Exception as e:  # what a cut call raises is the point, not a failure of the test
            result["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_for(lambda: not t.is_alive(), limit, f"{what} to give up on a silent API server", interval=0.1)
    return result


def test_every_kubernetes_call_gives_up_at_its_timeout(black_hole):
    """Each Kubernetes call of the loop and the executor, against an API server that never answers, ends at
    the request timeout (a small one here; the planner's is KUBE_REQUEST_TIMEOUT) instead of waiting forever."""
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = black_hole
    api = client.ApiClient(cfg)
    metrics = PlannerMetrics()
    executor = Executor(api, metrics, request_timeout=0.5)
    loop = PlannerLoop(api, executor, lambda endpoint: None, namespace="team-a", request_timeout=0.5)
    obj = _obj()
    spec = DisaggDeploymentSpec.model_validate(obj["spec"])
    target = dc.Target.from_spec(spec)
    unavailable = dc.Observation.unavailable(0.0, "no metrics here")
    decision, _ = dc.decide(unavailable, target, dc.Memory(), None, 0.0)
    verdict = slo.judge(unavailable, spec.slo, 60)

    # the pass: its list is cut, counted, and the pass ends
    assert _bounded(loop.step, "the loop's list") == {"value": []}
    assert [s.value for f in metrics.registry.collect() for s in f.samples
            if s.name == m.PLANNER_ERRORS and s.labels["stage"] == "list"] == [1]
    # the profile's ConfigMap, the replicas' and the status' server-side applies: each raises, cut
    profiled = _obj(profile=True)
    for call, what in ((lambda: loop._models(profiled, DisaggDeploymentSpec.model_validate(profiled["spec"])),
                        "the profile read"),
                       (lambda: executor.apply(obj, decision, target, verdict), "the decision's apply"),
                       (lambda: executor.report(obj, verdict), "the latency report")):
        assert "error" in _bounded(call, what), what
    # the event: cut, logged, not raised (an event is never worth a failed decision)
    assert _bounded(lambda: executor._event(obj, "Normal", "Test", "x"), "the event") == {"value": None}
    api.close()


def test_every_kubernetes_call_in_the_planner_has_a_timeout():
    """The static side of the same rule: every call the planner makes through its API objects passes
    ``_request_timeout`` (a new call without one fails here before it hangs a cluster's planner)."""
    calls = []
    for path in sorted((REPO / "planner").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in ("custom", "core")
                    and isinstance(node.func.value.value, ast.Name) and node.func.value.value.id == "self"):
                calls.append((path.name, node.func.attr, {k.arg for k in node.keywords}))
    assert len(calls) >= 7, calls  # list x2, ConfigMap, apply x2, status, event
    assert [(f, c) for f, c, kw in calls if "_request_timeout" not in kw] == []
