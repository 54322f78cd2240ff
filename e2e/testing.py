"""Helpers shared by the test suites: waiting on conditions and building objects."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, TypeVar

from kubernetes import client, watch
from urllib3.exceptions import ProtocolError

from disagg.api.names import LABEL_DEPLOYMENT, LABEL_ROLE

T = TypeVar("T")


def wait_for(check: Callable[[], T], timeout: float = 60, what: str = "condition", interval: float = 0.25) -> T:
    """Poll ``check`` until it returns something truthy; fail naming ``what`` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        last = check()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")
        time.sleep(interval)


class LoopThread:
    """An event loop in a thread: an in-process router runs there, and the test waits with wait_for and
    reads the router's state through the loop (never while the loop writes it)."""

    def __init__(self) -> None:
        import asyncio

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 60):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=timeout)

    def submit(self, coro):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, fn, *args):
        async def run():
            return fn(*args)
        return self.run(run())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


def pod(name: str, gpus: int = 0, labels: dict[str, str] | None = None, node_selector: dict[str, str] | None = None,
        pod_group: str | None = None, annotations: dict[str, str] | None = None) -> dict[str, Any]:
    """A plain pod manifest (the image is never pulled: kwok runs the pod)."""
    container: dict[str, Any] = {"name": "main", "image": "registry.k8s.io/pause:3.10"}
    if gpus:
        container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    spec: dict[str, Any] = {"containers": [container], "terminationGracePeriodSeconds": 0}
    if node_selector:
        spec["nodeSelector"] = node_selector
    if pod_group:
        spec["schedulingGroup"] = {"podGroupName": pod_group}
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "labels": labels or {}, "annotations": annotations or {}}, "spec": spec}


def dd_manifest(name: str = "demo", **spec: Any) -> dict[str, Any]:
    """A DisaggDeployment: a tiny model on one GPU per role unless `spec` says otherwise (merged per top-level key)."""
    base: dict[str, Any] = {
        "model": {"name": "tiny", "source": "hf://example/tiny"},
        "prefill": {"replicas": 1}, "decode": {"replicas": 1},
        "scheduling": {"gang": {"minPrefill": 1, "minDecode": 1}},
    }
    for key, value in spec.items():
        base[key] = {**base.get(key, {}), **value} if isinstance(value, dict) else value
    return {"apiVersion": "serving.disagg.dev/v1alpha1", "kind": "DisaggDeployment",
            "metadata": {"name": name}, "spec": base}


GROUP, VERSION, PLURAL = "serving.disagg.dev", "v1alpha1", "disaggdeployments"


class DD:
    """Small client for one DisaggDeployment in a test namespace."""

    def __init__(self, api_client, namespace, manifest):
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        if isinstance(manifest, str):  # an existing object, by name
            self.ns, self.name = namespace, manifest
            return
        self.ns, self.name = namespace, manifest["metadata"]["name"]
        self.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest)

    def get(self):
        return self.custom.get_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name)

    def status(self):
        return self.get().get("status") or {}

    def condition(self, ctype):
        return next((c for c in self.status().get("conditions", []) if c["type"] == ctype), None)

    def record_statuses(self) -> list[dict]:
        """Every status this object is written with from now on, appended as the API server reports
        it (a watch: polling misses a state that lasts less than its interval)."""
        seen: list[dict] = []
        since = self.get()["metadata"]["resourceVersion"]

        def run() -> None:
            try:
                for event in watch.Watch().stream(self.custom.list_namespaced_custom_object, GROUP, VERSION,
                                                  self.ns, PLURAL, field_selector=f"metadata.name={self.name}",
                                                  resource_version=since, timeout_seconds=300):
                    seen.append(event["object"].get("status") or {})
            except ProtocolError:
                pass    # the test's cluster or namespace went away: the recording ends with it

        threading.Thread(target=run, daemon=True).start()
        return seen

    def patch_spec(self, spec):
        """Patch the spec; returns the object as the patch left it (its resourceVersion marks the change)."""
        return self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.ns, PLURAL, self.name,
                                                          {"spec": spec})

    def history(self, since: str, until: str, timeout: int = 30) -> list[dict]:
        """Every version of the object written after resourceVersion `since`, up to `until`, replayed by a
        watch from `since`: states a poll can miss between two reads (a condition set and cleared)."""
        from kubernetes import watch

        seen: list[dict] = []
        w = watch.Watch()
        for ev in w.stream(self.custom.list_namespaced_custom_object, GROUP, VERSION, self.ns, PLURAL,
                           field_selector=f"metadata.name={self.name}", resource_version=since,
                           timeout_seconds=timeout):
            seen.append(ev["object"])
            if ev["object"].get("metadata", {}).get("resourceVersion") == until:
                w.stop()
        return seen

    def pods(self, role=None):
        sel = f"{LABEL_DEPLOYMENT}={self.name}" + (f",{LABEL_ROLE}={role}" if role else "")
        return [p for p in self.core.list_namespaced_pod(self.ns, label_selector=sel).items
                if not p.metadata.deletion_timestamp]

    def wait_refused_by_scheduler(self, role, count, timeout=90):
        """Wait until the scheduler has tried and refused each of `count` pods of `role` (their PodScheduled
        condition False, reason Unschedulable: the scheduler writes it when a pod, or the gang it belongs to,
        cannot be placed); returns those pods. A pod still unbound before this may just not have been tried."""
        def refused():
            pods = self.pods(role)
            done = [p for p in pods if any(c.type == "PodScheduled" and c.status == "False"
                                           and c.reason == "Unschedulable" for c in p.status.conditions or [])]
            return len(pods) == count and len(done) == count and pods
        return wait_for(refused, timeout, f"the scheduler to refuse {count} {role} pods of {self.name}")

    def wait_phase(self, phase, timeout=90):
        return wait_for(lambda: self.status().get("phase") == phase and self.status(), timeout,
                        f"{self.name} phase {phase} (status: {self.status()})")

    def wait_condition(self, ctype, status, reason=None, timeout=90):
        def check():
            c = self.condition(ctype)
            return c if c and c["status"] == status and (reason is None or c["reason"] == reason) else None
        return wait_for(check, timeout, f"{ctype}={status} {reason or ''} on {self.name} (status: {self.status()})")


# ---------------------------------------------------------------- the chart's InferencePool CRD

INFERENCE_POOL_CRD = "crd/inferencepools.inference.networking.k8s.io"


def chart_inference_pool_crd() -> str:
    """The InferencePool CRD as the chart installs it (helm template, inferencePool.installCRD=true)."""
    import subprocess
    from pathlib import Path

    from disagg.e2e.localcluster import binaries

    chart = Path(__file__).resolve().parent.parent / "charts" / "disagg"
    return subprocess.run([str(binaries() / "helm"), "template", "disagg", str(chart), "--set",
                           "inferencePool.installCRD=true", "--show-only", "templates/inferencepool-crd.yaml"],
                          check=True, capture_output=True, text=True).stdout


def install_inference_pool_crd(cluster) -> None:
    """The chart's InferencePool CRD on the cluster, Established (a no-op when it is there)."""
    cluster.kubectl("apply", "--server-side", "-f", "-", input=chart_inference_pool_crd())
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=120s", INFERENCE_POOL_CRD)


def remove_inference_pool_crd(cluster) -> None:
    """No InferencePool API on the cluster (every pool of it goes with it)."""
    cluster.kubectl("delete", INFERENCE_POOL_CRD, "--ignore-not-found", "--wait=true", "--timeout=120s")
