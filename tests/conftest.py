"""Fixtures: one real local control plane per test run, one namespace per test; routers in front of
test upstreams (`routers`); the worker environment and the tiny model for tests that run real engines
(`worker_python`, `tiny_model`: here, not in the product's packages)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"


@pytest.fixture(scope="session")
def worker_python() -> str:
    """The worker environment's interpreter (vLLM CPU build + NIXL), built once into the cache outside the
    repository and reused by every later run."""
    from disagg.workers.envpath import worker_python as python

    return python()


@pytest.fixture(scope="session")
def tiny_model(worker_python) -> str:
    """The tiny model the real-engine tests serve, generated once into the cache by the worker environment."""
    from disagg.workers.tinymodel import ensure

    return str(ensure(worker_python))


@pytest.fixture(scope="session")
def tiny_adapter(tiny_model, tmp_path_factory) -> str:
    """A LoRA adapter (rank 8, random non-zero weights, peft's file layout) of the tiny model."""
    from disagg.workers.tinyadapter import make_adapter

    return str(make_adapter(Path(tiny_model), tmp_path_factory.mktemp("tiny-adapter")))


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """The local control plane (etcd, kube-apiserver, scheduler, controller-manager, kwok GPU pools),
    started once for the test run and torn down after it."""
    from disagg.e2e.localcluster import LocalCluster
    from disagg.e2e.operator_fixture import AUDITED_NAMESPACE

    c = LocalCluster(f"test-{os.getpid()}", state_dir=tmp_path_factory.mktemp("cluster"),
                     audit_groups=(f"system:serviceaccounts:{AUDITED_NAMESPACE}",))
    c.up()
    yield c
    c.down()


@pytest.fixture(scope="session")
def api_client(cluster):
    from kubernetes import config

    client = config.new_client_from_config(str(cluster.kubeconfig))
    yield client
    client.close()


@pytest.fixture(scope="session")
def crd_installed(cluster, api_client):
    """The DisaggDeployment CRD, applied from crds/ and Established. Waited for by reading it, not with
    `kubectl wait`, which now and then exited 1 right after the apply (seen in about one run in ten)."""
    from disagg.e2e.suite import wait_crd_established

    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
    wait_crd_established(api_client)
    return True


@pytest.fixture(scope="session")
def other_gang_crds(cluster):
    """CRDs of the coscheduling and Volcano PodGroups (their schedulers do not run here, so pods
    of those backends stay unbound)."""
    cluster.kubectl("apply", "--server-side", "-f", str(REPO / "e2e" / "crds"))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=300s",
                    "crd/podgroups.scheduling.x-k8s.io", "crd/podgroups.scheduling.volcano.sh")
    return True


@pytest.fixture
def namespace(request, api_client):
    """A fresh namespace for one test, deleted afterwards."""
    from kubernetes import client

    from disagg.e2e.testing import wait_for

    digest = hashlib.sha1(request.node.nodeid.encode()).hexdigest()[:6]
    name = f"t-{request.node.name.lower().replace('_', '-')[:40].strip('-')}-{digest}"
    name = "".join(ch if ch.isalnum() or ch == "-" else "-" for ch in name)
    core = client.CoreV1Api(api_client)
    core.create_namespace({"metadata": {"name": name}})
    # Pods need the namespace's default ServiceAccount, made by the controller-manager.
    wait_for(lambda: any(sa.metadata.name == "default"
                         for sa in core.list_namespaced_service_account(name).items),
             30, f"default ServiceAccount in {name}")
    yield name
    core.delete_namespace(name)
    # Wait until its pods are gone, so they no longer hold GPUs the next test counts on.
    wait_for(lambda: not core.list_namespaced_pod(name).items, 120, f"pods of namespace {name} to be deleted")


@pytest.fixture(scope="session")
def operator_kubeconfig(cluster, api_client, crd_installed, tmp_path_factory):
    """Credentials of the operator's own ServiceAccount, bound to operator/rbac.yaml and nothing else."""
    from disagg.e2e.operator_fixture import operator_kubeconfig as make

    return make(cluster, api_client, tmp_path_factory.mktemp("operator") / "kubeconfig")


@pytest.fixture(scope="module")
def planner_api(cluster, api_client, crd_installed, tmp_path_factory):
    """An API client holding a token of the planner's ServiceAccount (operator/rbac.yaml's disagg-planner
    role only)."""
    from kubernetes import config

    from disagg.e2e.operator_fixture import planner_kubeconfig

    path = planner_kubeconfig(cluster, api_client, tmp_path_factory.mktemp("planner") / "kubeconfig")
    api = config.new_client_from_config(str(path))
    yield api
    api.close()


@pytest.fixture(scope="module")
def operator(operator_kubeconfig):
    """The operator running in this process under least privilege, for one test module."""
    from disagg.e2e.operator_fixture import running_operator

    with running_operator(operator_kubeconfig) as runner:
        yield runner


class Routers:
    """A router (its own process, ``python -m disagg.router``) in front of upstream processes that speak
    vLLM's wire format (tests/sse_upstream.py, tests/stall_upstream.py): one home for the router tests'
    configuration, start, readiness waits and stop. Test modules cannot import from tests/ (pytest's
    importlib mode), hence a fixture."""

    @staticmethod
    def upstream(logs: Path, name: str, *args: Any, script: str = "sse_upstream.py",
                 env: dict[str, str] | None = None):
        """``python tests/<script> PORT *args`` on a free port, started; :meth:`serving` waits for it."""
        from disagg.workers.local import LocalProcess, free_port

        port = free_port()
        return LocalProcess(name, [sys.executable, str(TESTS / script), str(port), *map(str, args)], env or {},
                            f"http://127.0.0.1:{port}", logs).start()

    @staticmethod
    @contextmanager
    def running(*upstreams, grace: float = 2) -> Iterator[tuple]:
        """Started upstreams (:meth:`upstream`), yielded once each answers /health; stopped afterwards (all at
        once, ``grace`` seconds each), whatever happened."""
        from disagg.workers.local import stop_all

        try:
            for u in upstreams:
                u.wait_ready(timeout=30)
            yield upstreams
        finally:
            stop_all(list(upstreams), grace=grace)

    @staticmethod
    def config(tokenizer: str, port: int, decode: Sequence[str], prefill: Sequence[str] = (),
               spec: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
        """A router configuration for the tiny model: decode-only (spec.disaggregation never) unless
        ``spec`` says otherwise; ``extra`` adds or replaces top-level fields."""
        cfg: dict[str, Any] = {"model": "tiny", "tokenizer": tokenizer, "block_size": 16, "max_model_len": 1024,
                               "port": port, "host": "127.0.0.1", "spec": {"disaggregation": "never", **(spec or {})},
                               "decode": [{"url": u} for u in decode]}
        if prefill:
            cfg["prefill"] = [{"url": u} for u in prefill]
        return {**cfg, **extra}

    @contextmanager
    def serving(self, tokenizer: str, logs: Path, decode: Sequence, prefill: Sequence = (), name: str = "router",
                spec: dict[str, Any] | None = None, args: Sequence[str] = (), **extra: Any) -> Iterator:
        """A router in front of started upstreams (:meth:`upstream`), yielded once it and they answer
        /health; it and they are stopped afterwards (all at once), whatever happened. Its configuration
        is ``logs/<name>.json``, its log ``logs/<name>.log``; ``args``: more command-line arguments
        (``--mode picker --grpc-port N``)."""
        from disagg.workers.local import free_port, router, stop_all

        port = free_port()
        path = logs / f"{name}.json"
        path.write_text(json.dumps(self.config(tokenizer, port, [u.url for u in decode], [u.url for u in prefill],
                                               spec, **extra)))
        r = router(path, port, logs, *args)
        r.name, r.log_path = name, logs / f"{name}.log"
        try:
            r.start()
            for u in (*prefill, *decode):
                u.wait_ready(timeout=30)
            r.wait_ready(timeout=60)
            yield r
        finally:
            stop_all([r, *prefill, *decode])


@pytest.fixture(scope="session")
def jaeger(tmp_path_factory):
    """A real Jaeger on loopback (disagg.e2e.jaeger: built from its Go module into the cache when absent),
    receiving OTLP and answering its query API; one for the session (traces are told apart by their ids)."""
    from disagg.e2e.jaeger import LocalJaeger

    j = LocalJaeger(tmp_path_factory.mktemp("jaeger")).start()
    try:
        yield j
    finally:
        j.stop()


@pytest.fixture(scope="session")
def routers() -> Routers:
    """:class:`Routers`: start a router in front of test upstreams."""
    return Routers()


@pytest.fixture
def open_files():
    """Sockets for 2,000 concurrent streams: the client's, and in whatever this process starts (a router,
    Envoy, an upstream: they inherit the limit) one towards the client and one towards the upstream each. A
    shell's default soft limit (1,024) is too low; the hard limit allows it."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * 2000 + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        assert hard == resource.RLIM_INFINITY or hard >= want, f"open files: hard limit {hard} < {want}"
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.fixture
def stream_burst(open_files):
    """``stream_burst(base_url, clients, max_tokens, deadline_s)``: that many streamed chat completions
    started at once with the official async client, one connection each; each one's text, or its
    exception."""
    import asyncio

    import httpx2
    from openai import AsyncOpenAI, DefaultAsyncHttpx2Client

    def burst(base_url: str, clients: int, max_tokens: int, deadline_s: float) -> list:
        async def main():
            http = DefaultAsyncHttpx2Client(limits=httpx2.Limits(max_connections=clients + 10), timeout=deadline_s)
            client = AsyncOpenAI(base_url=base_url, api_key="unused", http_client=http, max_retries=0)
            started = asyncio.Event()

            async def one(i: int) -> str:
                await started.wait()
                stream = await client.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": f"client {i}"}], stream=True,
                    max_tokens=max_tokens)
                return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

            tasks = [asyncio.create_task(one(i)) for i in range(clients)]
            started.set()
            try:
                return await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                await http.aclose()

        return asyncio.run(main())

    return burst
