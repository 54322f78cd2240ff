"""The operator's desired state, without a cluster: gang objects per backend, topology,
rollout strategy, names, and the contract with the worker and router entrypoints."""

import json

import pytest

from disagg.api import contract
from disagg.api.names import (
    DISK_OFFLOAD_PATH,
    MODEL_MOUNT_ROOT,
    ROUTER_API_KEYS_FILE,
    ROUTER_AUTH_DIR,
    local_model_path,
)

from disagg.api.v1alpha1 import DisaggDeployment
from disagg.e2e.testing import dd_manifest
from disagg.operator import gang as gangs
from disagg.operator import render


def _dd(name="demo", **spec):
    manifest = dd_manifest(name, **spec)
    manifest["metadata"]["namespace"] = "ns"
    return DisaggDeployment.model_validate(manifest)


def _by_kind(objs):
    out = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


def test_workload_api_gang_is_per_role_through_a_composite():
    dd = _dd(prefill={"replicas": 3}, decode={"replicas": 4},
             scheduling={"gang": {"minPrefill": 2, "minDecode": 3},
                         "topology": {"key": "nvidia.com/gpu.clique", "mode": "required"}})
    g = gangs.render("demo", dd.spec)
    kinds = _by_kind(g.objects)
    (composite,) = kinds["CompositePodGroup"]
    assert composite["spec"]["schedulingPolicy"]["gang"]["minGroupCount"] == 2
    assert composite["spec"]["schedulingConstraints"] == {"topology": [{"key": "nvidia.com/gpu.clique"}]}
    mins = {pg["spec"]["workloadRef"]["templateName"]: pg["spec"]["schedulingPolicy"]["gang"]["minCount"]
            for pg in kinds["PodGroup"]}
    assert mins == {"prefill": 2, "decode": 3}
    assert all(pg["spec"]["parentCompositePodGroupName"] == composite["metadata"]["name"] for pg in kinds["PodGroup"])
    assert g.pod_fields["decode"]["spec"]["schedulingGroup"]["podGroupName"] == g.group_names["decode"]


def test_a_role_with_no_minimum_stays_out_of_the_gang():
    g = gangs.render("demo", _dd(scheduling={"gang": {"minPrefill": 0, "minDecode": 1}}).spec)
    kinds = _by_kind(g.objects)
    assert "CompositePodGroup" not in kinds and [pg["spec"]["workloadRef"]["templateName"]
                                                 for pg in kinds["PodGroup"]] == ["decode"]
    assert "schedulingGroup" not in g.pod_fields["prefill"]["spec"]


def test_gang_names_change_with_what_they_encode():
    a = gangs.render("demo", _dd(scheduling={"topology": {"key": "nvidia.com/gpu.clique"}}).spec)
    b = gangs.render("demo", _dd(scheduling={"topology": {"key": "topology.kubernetes.io/zone"}}).spec)
    assert a.name != b.name and a.name == gangs.render(
        "demo", _dd(scheduling={"topology": {"key": "nvidia.com/gpu.clique"}}).spec).name


@pytest.mark.parametrize("backend,mode,expect", [
    ("workload-api", "required", None),
    ("workload-api", "preferred", "preferredDuringSchedulingIgnoredDuringExecution"),
    ("volcano", "required", "requiredDuringSchedulingIgnoredDuringExecution"),
])
def test_topology_uses_the_scheduler_constraint_or_pod_affinity(backend, mode, expect):
    dd = _dd(scheduling={"gang": {"backend": backend, "minPrefill": 1, "minDecode": 1},
                         "topology": {"key": "topology.disagg.dev/rack", "mode": mode}})
    objs, _ = render.children(dd, "uid")
    dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-decode")
    affinity = dep["spec"]["template"]["spec"].get("affinity")
    if expect is None:
        assert affinity is None
    else:
        (term,) = [t.get("podAffinityTerm", t) for t in affinity["podAffinity"][expect]]
        assert term["topologyKey"] == "topology.disagg.dev/rack"


def test_rollout_surges_at_least_the_gang_minimum_and_never_goes_unavailable():
    dd = _dd(decode={"replicas": 4}, scheduling={"gang": {"minPrefill": 1, "minDecode": 3}})
    objs, _ = render.children(dd, "uid")
    strategy = {o["metadata"]["name"]: o["spec"]["strategy"]["rollingUpdate"] for o in objs if o["kind"] == "Deployment"}
    assert strategy["demo-decode"] == {"maxSurge": 3, "maxUnavailable": 0}
    assert strategy["demo-prefill"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_every_child_is_owned_labelled_and_hashed():
    objs, _ = render.children(_dd(), "the-uid")
    for o in objs:
        assert o["metadata"]["ownerReferences"][0]["uid"] == "the-uid"
        assert o["metadata"]["labels"]["serving.disagg.dev/deployment"] == "demo"
        assert render.HASH_ANNOTATION in o["metadata"]["annotations"]
        assert len(o["metadata"]["name"]) <= 63


def test_worker_args_are_what_the_worker_entrypoint_accepts():
    from disagg.workers.__main__ import _parser, settings_from

    dd = _dd(engine={"args": ["--max-model-len", "4096"]}, decode={"replicas": 1, "tensorParallelSize": 2})
    for role in ("prefill", "decode"):
        args = render.worker_args(dd, role)
        split = args.index("--")
        parsed = _parser().parse_args(args[:split])
        settings = settings_from(parsed, args[split + 1:])
        assert settings.role == role and settings.port == render.HTTP_PORT
        assert "--max-model-len" in settings.engine_args


def test_router_args_are_what_the_router_entrypoint_accepts():
    from disagg.router.__main__ import _parser, config_from

    dd = _dd(router={"policy": "least-loaded", "overlapWeight": 2.5})
    dep = render.router_deployment(dd, "uid")
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    config = config_from(_parser().parse_args(args))
    assert config.model == "tiny" and str(config.spec.policy) == "least-loaded"


@pytest.mark.parametrize("processes", [1, 3])
def test_router_processes_each_get_a_named_metrics_port(processes):
    """spec.router.processes: the router runs that many processes on the http port; process i serves
    /metrics on the container port named metrics-i (what the chart's router PodMonitor keeps), and
    admits its share of maxInFlight."""
    import re

    from disagg.api import contract
    from disagg.router.__main__ import _parser, config_from
    from disagg.router.processes import child_argv

    dd = _dd(router={"processes": processes, "maxInFlight": 100, "maxQueued": 10})
    (container,) = render.router_deployment(dd, "uid")["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    metrics = {n: p for n, p in ports.items() if re.fullmatch(contract.ROUTER_METRICS_PORT_NAMES, n)}
    assert list(metrics) == [f"metrics-{i}" for i in range(processes)] and "http" in ports
    config = config_from(_parser().parse_args(container["args"]))
    assert config.spec.processes == processes and config.port == ports["http"]
    for i in range(processes):        # what the parent starts process i with (argv after `python -P -m ...`)
        child = config_from(_parser().parse_args(
            child_argv(container["args"], i, processes, 100, 10, config.metrics_port)[4:]))
        assert child.spec.processes == 1 and child.metrics_port == metrics[f"metrics-{i}"]
        assert child.spec.max_in_flight == -(-100 // processes) and child.port == ports["http"]
    assert len(set(ports.values())) == len(ports)


def test_router_auth_mounts_the_secret_where_the_router_reads_its_keys():
    """spec.router.auth: the Secret's key as a read-only volume (never a subPath, which the kubelet would not
    update on rotation), the router told to read that file; limits on request bodies rendered too."""
    from disagg.router.__main__ import _parser, config_from

    dd = _dd(router={"auth": {"secretName": "my-keys", "key": "api.keys"}, "maxBodyBytes": 65536,
                     "bodyTimeoutSeconds": 5})
    pod = render.router_deployment(dd, "uid")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "my-keys"
    (item,) = volume["secret"]["items"]
    assert item["key"] == "api.keys" and f"{ROUTER_AUTH_DIR}/{item['path']}" == ROUTER_API_KEYS_FILE
    assert volume["secret"]["defaultMode"] == 0o440 and pod["securityContext"]["fsGroup"]
    (router,) = pod["containers"]
    (mount,) = [mt for mt in router["volumeMounts"] if mt["name"] == volume["name"]]
    assert mount == {"name": volume["name"], "mountPath": ROUTER_AUTH_DIR, "readOnly": True}
    config = config_from(_parser().parse_args(router["args"]))
    assert config.api_keys_file == ROUTER_API_KEYS_FILE
    assert config.spec.max_body_bytes == 65536 and config.spec.body_timeout_seconds == 5
    assert "my-keys" not in json.dumps(router.get("env", []))         # a file, never an env variable

    plain = render.router_deployment(_dd(), "uid")["spec"]["template"]["spec"]
    assert not [v for v in plain["volumes"] if "secret" in v]
    assert "--api-keys-file" not in plain["containers"][0]["args"]
    assert config_from(_parser().parse_args(plain["containers"][0]["args"])).api_keys_file is None


def test_a_disk_kv_tier_gets_a_sized_volume_where_the_worker_looks():
    dd = _dd(kvCache={"offload": {"cpuGiB": 4, "diskGiB": 200}})
    manifests, _ = render.children(dd, "uid")
    dep = next(m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == "demo-decode")
    pod = dep["spec"]["template"]["spec"]
    assert {"name": "kv-offload", "emptyDir": {"sizeLimit": "200Gi"}} in pod["volumes"]
    worker = pod["containers"][0]
    assert {"name": "kv-offload", "mountPath": DISK_OFFLOAD_PATH} in worker["volumeMounts"]
    assert worker["resources"]["requests"]["ephemeral-storage"] == "200Gi"
    args = worker["args"]
    assert args[args.index("--kv-offload-disk-gib") + 1] == "200"


def test_pvc_sources_are_mounted_where_worker_and_router_look():
    dd = _dd(model={"name": "m", "source": "pvc://weights/llama-70b", "tokenizer": "pvc://toks/llama"})
    manifests, _ = render.children(dd, "uid")
    deps = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Deployment"}
    for name, container in (("demo-decode", "worker"), ("demo-router", "router")):
        pod = deps[name]["spec"]["template"]["spec"]
        claims = {v["persistentVolumeClaim"]["claimName"]: v["name"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        assert set(claims) == {"weights", "toks"}
        c = next(c for c in pod["containers"] if c["name"] == container)
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        assert mounts[f"{MODEL_MOUNT_ROOT}/weights"]["readOnly"] is True
        assert mounts[f"{MODEL_MOUNT_ROOT}/toks"]["name"] == claims["toks"]
    assert local_model_path("pvc://weights/llama-70b") == f"{MODEL_MOUNT_ROOT}/weights/llama-70b"
    assert local_model_path("hf://org/m") == "org/m" and local_model_path("s3://b/m") == "s3://b/m"


def test_router_placement_follows_spec_router():
    """spec.router.nodeSelector and tolerations land in the router pod; the preference for nodes
    without GPUs stays as a ranking among the nodes they allow."""
    tolerations = [{"key": "disagg.dev/real-node", "operator": "Exists", "effect": "NoSchedule"}]
    dd = _dd(router={"nodeSelector": {"kubernetes.io/hostname": "node-a"}, "tolerations": tolerations})
    pod = render.router_deployment(dd, "uid")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"kubernetes.io/hostname": "node-a"}
    assert pod["tolerations"] == tolerations
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["nodeAffinity"]
    assert pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    plain = render.router_deployment(_dd(), "uid")["spec"]["template"]["spec"]
    assert "nodeSelector" not in plain and "tolerations" not in plain


def test_worker_pods_get_the_drain_vllm_runs_plus_the_supervisors_margin():
    from disagg.api import contract

    dd = _dd()
    for role in ("prefill", "decode"):
        dep = render.worker_deployment(dd, "uid", role, gangs.render("demo", dd.spec))
        args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
        drain = int(args[args.index("--drain-seconds") + 1])
        assert drain == contract.DRAIN_SECONDS == 120
        pod = dep["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == (contract.ENDPOINT_GRACE_SECONDS + drain
                                                        + contract.DRAIN_MARGIN_SECONDS)
        # routers poll EndpointSlices: a terminating worker serves on for two of their polls before it drains
        sleep = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert sleep == contract.ENDPOINT_GRACE_SECONDS >= 2 * contract.DISCOVERY_INTERVAL_SECONDS


def test_pods_run_restricted_with_one_writable_scratch_directory():
    """Every router and worker pod: the images' non-root user, seccomp RuntimeDefault, no privilege
    escalation, no capabilities, a read-only root filesystem; the caches all point into the one
    emptyDir; workers carry no ServiceAccount token, the router (which watches EndpointSlices) does."""
    from disagg.api import contract

    dd = _dd(engine={"env": [{"name": "HF_HOME", "value": "/models/cache"}]},
             kvCache={"offload": {"diskGiB": 10}})
    deps = {m["metadata"]["name"]: m for m in render.children(dd, "uid")[0] if m["kind"] == "Deployment"}
    assert set(deps) == {"demo-prefill", "demo-decode", "demo-router"}
    for name, dep in deps.items():
        pod = dep["spec"]["template"]["spec"]
        psc = pod["securityContext"]
        assert psc["runAsNonRoot"] is True and psc["runAsUser"] == psc["runAsGroup"] == contract.RUN_AS_USER != 0
        assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
        # each pod its own PID and IPC namespaces: so UCX's cross-memory attach and shared memory
        # cannot reach a peer pod, and KV between pods goes over TCP (README, workers)
        assert not any(pod.get(k) for k in ("hostPID", "hostIPC", "shareProcessNamespace"))
        (c,) = pod["containers"]
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]} and "add" not in sc["capabilities"]
        scratch = next(v for v in pod["volumes"] if v["name"] == render.SCRATCH_VOLUME)
        assert scratch == {"name": render.SCRATCH_VOLUME, "emptyDir": {}}
        assert {"name": render.SCRATCH_VOLUME, "mountPath": contract.SCRATCH_DIR} in c["volumeMounts"]
        # every place a process writes is a volume: no mount is read-write but an emptyDir
        volumes = {v["name"]: v for v in pod["volumes"]}
        for m in c["volumeMounts"]:
            assert "emptyDir" in volumes[m["name"]] or m.get("readOnly") is True, (name, m)
        env = {e["name"]: e.get("value") for e in c["env"]}
        for key, value in contract.SCRATCH_ENV.items():
            if value.startswith("/"):
                assert value.startswith(contract.SCRATCH_DIR)
        worker = name != "demo-router"
        assert env["HF_HOME"] == ("/models/cache" if worker else contract.SCRATCH_ENV["HF_HOME"]), "the spec wins"
        assert [e["name"] for e in c["env"]].count("HF_HOME") == 1
        assert env["HOME"] == env["TMPDIR"] == contract.SCRATCH_DIR
        assert env["VLLM_CACHE_ROOT"].startswith(contract.SCRATCH_DIR)
        assert pod.get("automountServiceAccountToken") is (False if worker else None)
        assert ("serviceAccountName" in pod) is not worker


def test_network_policy_follows_the_operators_options(monkeypatch):
    """On by default with Prometheus pods as the scrapers; the chart's peers replace them; off, no policy."""
    kinds = lambda: [o["kind"] for o in render.children(_dd(), "uid")[0]]  # noqa: E731
    monkeypatch.delenv(render.NETWORK_POLICY_ENV, raising=False)
    monkeypatch.delenv(render.NETWORK_POLICY_PROMETHEUS_ENV, raising=False)
    assert kinds().count("NetworkPolicy") == 1
    assert render.network_policy(_dd(), "uid")["spec"]["ingress"][-1]["from"] == render.DEFAULT_PROMETHEUS_PEERS
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
             {"ipBlock": {"cidr": "10.0.0.0/8"}}]
    monkeypatch.setenv(render.NETWORK_POLICY_PROMETHEUS_ENV, json.dumps(peers))
    rule = render.network_policy(_dd(), "uid")["spec"]["ingress"][-1]
    assert rule == {"from": peers, "ports": [{"protocol": "TCP", "port": contract.WORKER_METRICS_PORT}]}
    monkeypatch.setenv(render.NETWORK_POLICY_PROMETHEUS_ENV, "[]")
    assert all(rule["from"] for rule in render.network_policy(_dd(), "uid")["spec"]["ingress"]), \
        "no peers: no rule (an empty `from` admits everyone)"
    monkeypatch.setenv(render.NETWORK_POLICY_PROMETHEUS_ENV, '{"not": "a list"}')
    with pytest.raises(ValueError, match=render.NETWORK_POLICY_PROMETHEUS_ENV):
        render.network_policy(_dd(), "uid")
    monkeypatch.setenv(render.NETWORK_POLICY_ENV, "false")
    assert "NetworkPolicy" not in kinds()


def test_ipc_lock_is_the_one_capability_rdma_workers_may_get():
    """spec.kvTransfer.ipcLock adds IPC_LOCK to prefill and decode containers only, all else still dropped."""
    on = {m["metadata"]["name"]: m for m in render.children(_dd(kvTransfer={"ipcLock": True}), "uid")[0]
          if m["kind"] == "Deployment"}
    off = {m["metadata"]["name"]: m for m in render.children(_dd(), "uid")[0] if m["kind"] == "Deployment"}
    for name in on:
        caps = on[name]["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"]
        assert caps == ({"drop": ["ALL"], "add": ["IPC_LOCK"]} if name != "demo-router" else {"drop": ["ALL"]})
        assert off[name]["spec"]["template"]["spec"]["containers"][0]["securityContext"]["capabilities"] == \
            {"drop": ["ALL"]}


# ---------------------------------------------------------------- spec.router.mode picker (issue 30)


def _picker_children(**router):
    objs, _ = render.children(_dd(router={"mode": "picker", **router}), "uid")
    return _by_kind(objs)


def test_picker_mode_runs_the_router_as_endpoint_picker_on_a_named_port_of_its_service():
    """The router's arguments gain --mode picker --grpc-port, which its own entrypoint accepts; the port is
    named grpc on the container and on the deployment's Service (h2c: gRPC in cleartext), where the
    InferencePool's endpointPickerRef points."""
    from disagg.router.__main__ import _parser

    by = _picker_children(picker={"port": 9100})
    (router,) = [d for d in by["Deployment"] if d["metadata"]["name"] == "demo-router"]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    args = _parser().parse_args(container["args"])
    assert (args.mode, args.grpc_port) == ("picker", 9100)
    assert {"name": "grpc", "containerPort": 9100} in container["ports"]
    (svc,) = [s for s in by["Service"] if s["metadata"]["name"] == "demo"]
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http"},
                                    {"name": "grpc", "port": 9100, "targetPort": "grpc",
                                     "appProtocol": "kubernetes.io/h2c"}]
    # the picker mode's defaults where spec.router.picker is left out
    by = _picker_children()
    (router,) = [d for d in by["Deployment"] if d["metadata"]["name"] == "demo-router"]
    assert router["spec"]["template"]["spec"]["containers"][0]["args"][-4:] == \
        ["--mode", "picker", "--grpc-port", "9002"]


@pytest.mark.parametrize("decode,leaders_only", [({"replicas": 2}, False),
                                                  ({"replicas": 1, "podsPerReplica": 2, "tensorParallelSize": 2},
                                                   True)])
def test_the_inference_pool_selects_the_decode_pods_that_serve_and_picks_through_the_router(decode, leaders_only):
    """One InferencePool (v1), named and owned like every child; its members are the decode pods that serve
    vLLM's API (a multi-pod replica's leader only, as the router's discovery has it), on vLLM's port; its
    endpoint picker is the router Service's picker port, with the spec's failure mode."""
    from disagg.api import inferencepool as pools
    from disagg.api.names import LABEL_DEPLOYMENT, LABEL_GROUP_POD, LABEL_HEADLESS, LABEL_ROLE

    dd = _dd(decode=decode, router={"mode": "picker", "picker": {"port": 9003, "failureMode": "FailOpen"}})
    objs, gang = render.children(dd, "uid")
    (pool,) = _by_kind(objs)["InferencePool"]
    assert objs[-1] is pool, "applied last: a missing CRD fails nothing before it"
    pools.InferencePool.model_validate(pool)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == "demo"
    assert pool["metadata"]["ownerReferences"][0]["uid"] == "uid" and render.HASH_ANNOTATION in \
        pool["metadata"]["annotations"]
    assert pool["spec"]["targetPorts"] == [{"number": render.HTTP_PORT}]
    assert pool["spec"]["endpointPickerRef"] == {"group": "", "kind": "Service", "name": "demo",
                                                 "port": {"number": 9003}, "failureMode": "FailOpen"}
    match = pool["spec"]["selector"]["matchLabels"]
    # the pods this selects: decode pods as rendered (a Deployment's template, or each pod of a group)
    pods = [d["spec"]["template"] for d in _by_kind(objs)["Deployment"]]   # the one-pod roles and the router
    if leaders_only:
        pods += [render.worker_pod_template(dd, "decode", gang, rank=(0, i)) for i in range(2)]
    selected = [p for p in pods if match.items() <= p["metadata"]["labels"].items()]
    assert selected and all(p["metadata"]["labels"][LABEL_ROLE] == "decode" for p in selected)
    assert not any(LABEL_HEADLESS in p["metadata"]["labels"] for p in selected)
    assert len(selected) == 1 and (LABEL_GROUP_POD in match) is leaders_only
    assert match[LABEL_DEPLOYMENT] == "demo"


def test_picker_mode_opens_the_decode_port_and_the_picker_port_to_the_gateways_namespaces_only(monkeypatch):
    """Two policies beside the workers' own: the decode pods that serve admit the gateway's pods (every pod of
    the namespaces gatewayNamespaceSelector matches) on vLLM's port only; the routers, selected now, admit
    those on the picker port and still anyone on their API and metrics ports. Nothing else changes."""
    from disagg.api.names import LABEL_ROLE

    monkeypatch.delenv(render.NETWORK_POLICY_ENV, raising=False)
    monkeypatch.delenv(render.NETWORK_POLICY_PROMETHEUS_ENV, raising=False)
    gateways = {"matchLabels": {"kubernetes.io/metadata.name": "gateway-system"}}
    objs, _ = render.children(_dd(router={"mode": "picker", "processes": 2, "maxInFlight": 8, "picker": {
        "gatewayNamespaceSelector": gateways}}), "uid")
    policies = {p["metadata"]["name"]: p["spec"] for p in _by_kind(objs)["NetworkPolicy"]}
    proxy = {p["metadata"]["name"]: p["spec"] for p in _by_kind(render.children(_dd(), "uid")[0])["NetworkPolicy"]}
    assert policies["demo-workers"] == proxy["demo-workers"], "the workers' own policy is as in proxy mode"
    assert set(policies) == {"demo-workers", "demo-gateway", "demo-router"}
    gateway, router = policies["demo-gateway"], policies["demo-router"]
    assert gateway["podSelector"]["matchLabels"] == render.serving_selector(_dd(), "decode")
    assert gateway["ingress"] == [{"from": [{"namespaceSelector": gateways}],
                                   "ports": [{"protocol": "TCP", "port": render.HTTP_PORT}]}]
    assert router["podSelector"]["matchLabels"][LABEL_ROLE] == "router"
    assert router["ingress"] == [
        {"ports": [{"protocol": "TCP", "port": p} for p in (render.HTTP_PORT, contract.ROUTER_METRICS_PORT,
                                                            contract.ROUTER_METRICS_PORT + 1)]},
        {"from": [{"namespaceSelector": gateways}], "ports": [{"protocol": "TCP", "port": 9002}]}]
    # the default: every namespace's pods (a gateway's pods live wherever the platform put them)
    objs, _ = render.children(_dd(router={"mode": "picker"}), "uid")
    (gateway,) = [p for p in _by_kind(objs)["NetworkPolicy"] if p["metadata"]["name"] == "demo-gateway"]
    assert gateway["spec"]["ingress"][0]["from"] == [{"namespaceSelector": {}}]
    monkeypatch.setenv(render.NETWORK_POLICY_ENV, "false")
    assert "NetworkPolicy" not in _by_kind(render.children(_dd(router={"mode": "picker"}), "uid")[0])


def test_proxy_mode_renders_nothing_of_the_picker():
    objs, _ = render.children(_dd(), "uid")
    by = _by_kind(objs)
    assert "InferencePool" not in by
    assert {p["metadata"]["name"] for p in by["NetworkPolicy"]} == {"demo-workers"}
    (router,) = [d for d in by["Deployment"] if d["metadata"]["name"] == "demo-router"]
    (container,) = router["spec"]["template"]["spec"]["containers"]
    assert "--mode" not in container["args"] and "grpc" not in {p["name"] for p in container["ports"]}
    (svc,) = [s for s in by["Service"] if s["metadata"]["name"] == "demo"]
    assert [p["name"] for p in svc["spec"]["ports"]] == ["http"]
    # and what the reconcile deletes when a deployment leaves picker mode is what picker mode rendered
    picker = {(o["kind"], o["metadata"]["name"]) for o in render.children(_dd(router={"mode": "picker"}), "uid")[0]}
    prunable = {(kind, render.names("demo")[which]) for _, kind, which in render.PRUNABLE if which in render.PICKER_ONLY}
    assert prunable == picker - {(o["kind"], o["metadata"]["name"]) for o in objs}


def _templates(dd):
    manifests, _ = render.children(dd, "uid")
    return {m["metadata"]["name"]: m["spec"]["template"] for m in manifests if m["kind"] == "Deployment"}


def test_lora_is_on_in_every_worker_and_adding_or_removing_an_adapter_rolls_no_pod():
    """spec.model.maxLoras turns LoRA on in both roles alike (flags and the runtime-loading switch), and the
    router is told the slots; the adapters themselves never reach a pod template, so adding or removing one
    (from the hub, the image, or a claim the workers already mount) leaves every template, and so every
    pod, as it is: the routers load them (router/adapters.py)."""
    from disagg.router.__main__ import _parser, config_from

    model = {"name": "m", "source": "pvc://weights/base", "maxLoras": 4, "maxLoraRank": 8}
    bare = _dd(model=model)
    for role in ("prefill", "decode"):
        args = render.worker_args(bare, role)
        engine = args[args.index("--") + 1:]
        assert engine[engine.index("--enable-lora"):][:5] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank",
                                                              "8"]
    templates = _templates(bare)
    for name in ("demo-prefill", "demo-decode"):
        env = {e["name"]: e.get("value") for e in templates[name]["spec"]["containers"][0]["env"]}
        assert env[render.LORA_RUNTIME_ENV] == "True"
    router_args = templates["demo-router"]["spec"]["containers"][0]["args"]
    assert config_from(_parser().parse_args(router_args)).max_loras == 4
    adapters = [{"name": "sql", "source": "hf://org/sql-lora"}, {"name": "chat", "source": "/adapters/chat"},
                {"name": "legal", "source": "pvc://weights/adapters/legal"}]
    for some in (adapters[:1], adapters, adapters[1:]):
        assert _templates(_dd(model={**model, "adapters": some})) == templates
    # a claim the workers do not mount yet is the one adapter change that adds a volume (so a rollout)
    other = _templates(_dd(model={**model, "adapters": [{"name": "x", "source": "pvc://loras/x"}]}))
    assert other["demo-router"] == templates["demo-router"]
    assert "loras" in {v["persistentVolumeClaim"]["claimName"] for v in other["demo-decode"]["spec"]["volumes"]
                       if "persistentVolumeClaim" in v}
    # LoRA off (no maxLoras): nothing of it rendered
    plain = _dd(model={"name": "m", "source": "pvc://weights/base"})
    assert "--enable-lora" not in render.worker_args(plain, "decode")
    assert render.LORA_RUNTIME_ENV not in {e["name"] for e in _templates(plain)["demo-decode"]["spec"]["containers"][0]["env"]}
