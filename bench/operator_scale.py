"""Operator at fleet scale, against a baseline measured in the same run.

On a generated fleet of GPU nodes with two GPU products (default 3,000 nodes x 8 GPUs,
kwok: prefill on NVIDIA-H800 nodes, decode on NVIDIA-H20 nodes, the roles' nodeSelectors
pick them), create N DisaggDeployments (2 prefill + 2 decode + 1 router each, the whole
set as one gang) and time until every one is Ready. Baseline: the same pods created
directly as plain Deployments (no gang, no operator), timed until all are ready. Then a
churn phase on each: 10% of the deployments scaled (decode 2 -> 3), 10% rolled (a new
image), 10% deleted and created again, timed until everything has converged.

Also reports the operator's peak RSS, its memory per 100 deployments, the write requests
it makes to the API server during an idle window afterwards, and its read requests
(from the API server's audit log: what it lists and watches, with which selectors and
page sizes, so a watch of every pod in the cluster would show).

    .venv/bin/python bench/operator_scale.py [--nodes 3000] [--deployments 300] [--idle 60]
        [--profile SECONDS] [--operator-only]

`--profile S` samples the operator with py-spy (the bench extra) for the first S seconds
of its phase, only while a thread holds the GIL (the operator is one Python process: what
holds the GIL is what paces it), and prints where those samples went;
`--operator-only` skips the baseline phases (for profiling: no ratio is reported).

Goals: time ratio <= 1.1, peak RSS <= 300 MiB, 0 idle writes, churn ratio reported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from datetime import datetime
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import yaml
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from disagg.e2e.localcluster import LocalCluster
from disagg.e2e.localcluster.controlplane import free_port
from disagg.e2e.operator_fixture import ACCOUNT, NAMESPACE, operator_kubeconfig
from disagg.e2e.testing import dd_manifest, wait_for

REPO = Path(__file__).resolve().parent.parent
PRODUCT_LABEL = "nvidia.com/gpu.product"
PRODUCTS = {"prefill": "NVIDIA-H800", "decode": "NVIDIA-H20"}
GROUP, VERSION, PLURAL = "serving.disagg.dev", "v1alpha1", "disaggdeployments"
OPERATOR_USER = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"


def pools(nodes: int) -> dict:
    """Half the GPU nodes of each product, in 2 zones of racks of 5 NVLink domains of 4 nodes."""
    per_rack = 5 * 4
    racks = max(1, nodes // (len(PRODUCTS) * 2 * per_rack))
    gpu_pools = [{"name": product.split("-")[-1].lower(), "zones": 2, "racksPerZone": racks,
                  "nvlinkDomainsPerRack": 5, "nodesPerDomain": 4, "gpus": 8, "gpuProduct": product,
                  "cpu": "192", "memory": "2Ti"} for product in PRODUCTS.values()]
    return {"pools": [*gpu_pools, {"name": "cpu", "nodesPerDomain": 20, "gpus": 0, "cpu": "64",
                                   "memory": "256Gi"}]}


def plain_deployments(i: int, image: str = "disagg/worker:0.1.0", decode: int = 2) -> list[dict]:
    out = []
    for role, replicas, gpus in (("prefill", 2, 1), ("decode", decode, 1), ("router", 1, 0)):
        labels = {"bench": f"d{i}", "role": role}
        container = {"name": "main", "image": image if gpus else "disagg/worker:0.1.0"}
        pod_spec: dict = {"containers": [container]}
        if gpus:
            container["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
            pod_spec["nodeSelector"] = {PRODUCT_LABEL: PRODUCTS[role]}
        out.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": f"d{i}-{role}"},
                    "spec": {"replicas": replicas, "selector": {"matchLabels": labels},
                             "template": {"metadata": {"labels": labels}, "spec": pod_spec}}})
    return out


def disagg_deployment(i: int) -> dict:
    return dd_manifest(f"d{i}", prefill={"replicas": 2, "nodeSelector": {PRODUCT_LABEL: PRODUCTS["prefill"]}},
                       decode={"replicas": 2, "nodeSelector": {PRODUCT_LABEL: PRODUCTS["decode"]}},
                       scheduling={"gang": {"minPrefill": 2, "minDecode": 2}})


def pods_settled(core: client.CoreV1Api, namespace: str, want: int) -> bool:
    """Exactly `want` pods, every one Ready and none on its way out (a rollout's old pods are gone)."""
    # raw JSON: the client's model deserialisation of 1,500 pods costs seconds of CPU per poll, taken
    # from the API server and scheduler being measured on the same cores
    pods = json.loads(core.list_namespaced_pod(namespace, _preload_content=False).data)["items"]
    ready = sum(1 for p in pods if not p["metadata"].get("deletionTimestamp") and any(
        c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions") or []))
    _progress(f"{namespace}: {len(pods)} pods, {ready} ready, want {want}")
    return len(pods) == want and ready == want


_last_progress: dict[str, float] = {}
_firsts: dict[str, float] = {}


def _first(what: str) -> None:
    """When something first held in the phase being timed (its seconds are printed with the phase), so
    a phase's time splits into the pods' and the status that reports them."""
    _firsts.setdefault(what, time.monotonic())


def _split(start: float) -> str:
    pods = _firsts.pop("pods", None)
    _firsts.clear()
    return f" (every pod Ready at {pods - start:.1f}s)" if pods is not None else ""


def _progress(line: str, key: str = "pods") -> None:
    """A line a minute while waiting, so a run that times out shows how far it got."""
    if time.monotonic() - _last_progress.get(key, 0.0) >= 60:
        _last_progress[key] = time.monotonic()
        print(f"  ... {line}", flush=True)


def baseline_settled(core: client.CoreV1Api, apps: client.AppsV1Api, want_pods: int, deployments: int) -> bool:
    """Plain Deployments judged as their users judge them (`kubectl rollout status`): each one's status
    says every replica is updated and ready for its current generation, and the pods agree. The same
    bar a DisaggDeployment's Ready clears, since its status is read from its Deployments' status."""
    if not pods_settled(core, "baseline", want_pods):
        return False
    _first("pods")
    deps = json.loads(apps.list_namespaced_deployment("baseline", _preload_content=False).data)["items"]
    done = sum(1 for d in deps if (d.get("status") or {}).get("observedGeneration") == d["metadata"]["generation"]
               and (d.get("status") or {}).get("readyReplicas", 0) == d["spec"]["replicas"]
               == (d.get("status") or {}).get("updatedReplicas", 0)
               and (d.get("status") or {}).get("replicas", 0) == d["spec"]["replicas"])
    _progress(f"baseline: {done} of {deployments} Deployments report every replica ready", key="deployments")
    return len(deps) == deployments and done == deployments


def churn_sets(n: int) -> tuple[range, range, range]:
    """10% scaled, 10% rolled, 10% deleted and created again (disjoint; at least one each)."""
    k = max(1, n // 10)
    return range(0, k), range(k, 2 * k), range(2 * k, 3 * k)


def churn_plain(apps: client.AppsV1Api, core: client.CoreV1Api, n: int, want: int) -> float:
    scaled, rolled, recreated = churn_sets(n)
    t = time.monotonic()
    for i in scaled:
        apps.patch_namespaced_deployment_scale(f"d{i}-decode", "baseline", {"spec": {"replicas": 3}})
    for i in rolled:
        for dep in plain_deployments(i, image="disagg/worker:0.1.1")[:2]:
            apps.patch_namespaced_deployment(dep["metadata"]["name"], "baseline", dep)
    for i in recreated:
        for dep in plain_deployments(i):
            apps.delete_namespaced_deployment(dep["metadata"]["name"], "baseline")
    for i in recreated:
        for dep in plain_deployments(i):
            _create_when_gone(lambda d=dep: apps.create_namespaced_deployment("baseline", d))
    wait_for(lambda: baseline_settled(core, apps, want + len(scaled), 3 * n), 1800, "baseline churn settled",
             interval=1)
    return time.monotonic() - t


def churn_operator(custom: client.CustomObjectsApi, core: client.CoreV1Api, n: int, want: int) -> float:
    scaled, rolled, recreated = churn_sets(n)
    t = time.monotonic()
    for i in scaled:
        custom.patch_namespaced_custom_object(GROUP, VERSION, "ops", PLURAL, f"d{i}", {"spec": {"decode": {
            "replicas": 3}}})
    for i in rolled:
        custom.patch_namespaced_custom_object(GROUP, VERSION, "ops", PLURAL, f"d{i}", {"spec": {"engine": {
            "image": "disagg/worker:0.1.1"}}})
    for i in recreated:
        custom.delete_namespaced_custom_object(GROUP, VERSION, "ops", PLURAL, f"d{i}")
    for i in recreated:
        _create_when_gone(lambda i=i: custom.create_namespaced_custom_object(GROUP, VERSION, "ops", PLURAL,
                                                                           disagg_deployment(i)))
    wait_for(lambda: all_converged(custom, n) and pods_settled(core, "ops", want + len(scaled)), 1800,
             "operator churn settled", interval=1)
    return time.monotonic() - t


def _create_when_gone(create) -> None:
    """Create, waiting out the previous object of that name (a finalizer or garbage collection may hold it)."""
    def attempt() -> bool:
        try:
            create()
            return True
        except ApiException as e:
            if e.status != 409:
                raise
            return False
    wait_for(attempt, 600, "the deleted object gone so it can be created again", interval=0.5)


def all_converged(custom: client.CustomObjectsApi, n: int) -> bool:
    """Every DisaggDeployment Ready for its current generation, nothing progressing or degraded."""
    items = custom.list_namespaced_custom_object(GROUP, VERSION, "ops", PLURAL)["items"]
    return len(items) == n and all(
        (o.get("status") or {}).get("phase") == "Ready"
        and o["status"].get("observedGeneration") == o["metadata"]["generation"]
        and all(c["status"] == "False" for c in o["status"].get("conditions", [])
                if c["type"] in ("Progressing", "Degraded")) for o in items)


def rss_mib(pid: int, field: str = "VmRSS") -> float:
    return next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith(f"{field}:")) / 1024


def audit_events(path: Path, offset: int = 0) -> list[dict]:
    with open(path) as f:
        f.seek(offset)
        return [e for e in (json.loads(line) for line in f if OPERATOR_USER in line)
                if e.get("user", {}).get("username") == OPERATOR_USER]


_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_by_program() -> Counter[str]:
    """CPU seconds used so far by each program running here (user + system, summed over its processes;
    the operator is `python -m disagg.operator`), to split a phase's CPU between the control plane's
    parts and the operator: on this machine they share the same cores."""
    out: Counter[str] = Counter()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = Path(cmdline[0].decode(errors="replace")).name if cmdline and cmdline[0] else "?"
        if b"disagg.operator" in cmdline:
            name = "operator"
        out[name] += (int(fields[11]) + int(fields[12])) / _TICKS
    return out


def cpu_line(before: Counter[str], seconds: float) -> str:
    used = cpu_by_program()
    used.subtract(before)
    top = [(k, v) for k, v in used.most_common(8) if v >= 1]
    return (f"  CPU seconds in the phase ({seconds:.0f} s, 2 cores = {2 * seconds:.0f}): "
            + ", ".join(f"{k} {v:.0f}" for k, v in top))


def all_audit_events(path: Path, offset: int = 0) -> list[dict]:
    with open(path) as f:
        f.seek(offset)
        return [json.loads(line) for line in f]


def _stamp(e: dict) -> float:
    """An audit event's completion time, in epoch seconds."""
    ts = e.get("stageTimestamp") or e.get("requestReceivedTimestamp")
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


_DEPLOYMENT_OF = re.compile(r"^d(\d+)(?:-|$)")


def timeline(events: list[dict], namespace: str, start: float, created_by: str) -> str:
    """Where a phase's time went, from the API server's audit log: for each deployment (d<i>), when the
    stages of its way to running pods were written, as seconds since the phase started (p10/p50/p90/max over
    the deployments), and who wrote what in the phase. `created_by`: the resource the benchmark creates
    (disaggdeployments or deployments)."""
    stages: dict[str, dict[int, float]] = {}
    writers: Counter[str] = Counter()

    def mark(stage: str, i: int, t: float, last: bool = False) -> None:
        seen = stages.setdefault(stage, {})
        seen[i] = max(seen.get(i, t), t) if last else min(seen.get(i, t), t)

    for e in events:
        ref = e.get("objectRef") or {}
        if ref.get("namespace") != namespace or e.get("verb") not in ("create", "update", "patch", "delete"):
            continue
        t = _stamp(e) - start
        if t < 0:
            continue
        user = (e.get("user") or {}).get("username", "?")
        who = "operator" if user == OPERATOR_USER else user.rsplit(":", 1)[-1]
        resource = ref.get("resource", "?") + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        writers[f"{who} {e['verb']} {resource}"] += 1
        m = _DEPLOYMENT_OF.match(ref.get("name") or "")
        if not m or (e.get("responseStatus") or {}).get("code", 200) >= 300:
            continue
        i = int(m.group(1))
        if ref.get("resource") == created_by and e["verb"] == "create":
            mark("created", i, t)
        elif who == "operator" and ref.get("resource") == "disaggdeployments" and not ref.get("subresource"):
            mark("operator's first patch of it (finalizer)", i, t)
        elif who == "operator" and ref.get("resource") == "deployments":
            mark("its Deployments written (last)", i, t, last=True)
        elif ref.get("resource") == "replicasets" and e["verb"] == "create":
            mark("its ReplicaSets created (last)", i, t, last=True)
        elif resource == "pods/binding":
            mark("first pod bound", i, t)
            mark("last pod bound", i, t, last=True)
        elif resource == "pods/status":
            mark("last pod status write", i, t, last=True)
        elif who == "operator" and resource == "disaggdeployments/status":
            mark("last status write", i, t, last=True)

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))]

    lines = [f"  {'stage (s since the phase began)':44s} {'n':>4s} {'p10':>7s} {'p50':>7s} {'p90':>7s} {'max':>7s}"]
    for stage, seen in sorted(stages.items(), key=lambda kv: pct(list(kv[1].values()), 0.5)):
        v = list(seen.values())
        lines.append(f"  {stage:44s} {len(v):4d} {pct(v, .1):7.1f} {pct(v, .5):7.1f} {pct(v, .9):7.1f} {max(v):7.1f}")
    lines.append("  writes in the namespace, by writer: " + ", ".join(f"{k} {n}" for k, n in writers.most_common(12)))
    return "\n".join(lines)


def reads_summary(events: list[dict]) -> dict[str, int]:
    """The operator's list/watch requests by resource, scope and what the API server filtered for it."""
    out: Counter[str] = Counter()
    for e in events:
        if e.get("verb") not in ("list", "watch"):
            continue
        ref, query = e.get("objectRef", {}), parse_qs(urlparse(e.get("requestURI", "")).query)
        scope = f"namespace {ref['namespace']}" if ref.get("namespace") else "cluster-wide"
        filters = [f"{k}={query[k][0]}" for k in ("labelSelector", "fieldSelector", "limit") if k in query]
        # one line per kind of request, not per deployment: names in selectors become placeholders
        filters = [re.sub(r"(deployment|gang)(!?=)[^,]+", r"\1\2<name>", f) for f in filters]
        out[f"{e['verb']} {ref.get('resource')} {scope} [{', '.join(filters) or 'unfiltered'}]"] += 1
    return dict(sorted(out.items()))


def baseline(cluster: LocalCluster, core: client.CoreV1Api, apps: client.AppsV1Api, n: int,
             want: int) -> tuple[float, float]:
    """The same pods as plain Deployments, timed to ready, then the same churn; returns both times."""
    core.create_namespace({"metadata": {"name": "baseline"}})
    wait_for(lambda: core.list_namespaced_service_account("baseline").items, 60, "baseline SA")
    base_audit, base_wall, base_cpu = cluster.audit_log.stat().st_size, time.time(), cpu_by_program()
    t = time.monotonic()
    for i in range(n):
        for dep in plain_deployments(i):
            apps.create_namespaced_deployment("baseline", dep)
    wait_for(lambda: baseline_settled(core, apps, want, 3 * n), 1800, "baseline ready",
             interval=1)
    t_base = time.monotonic() - t
    print(f"baseline: {3 * n} plain Deployments ({want} pods) ready in {t_base:.1f}s"
          f"{_split(t)}", flush=True)
    print(cpu_line(base_cpu, t_base), flush=True)
    print(timeline(all_audit_events(cluster.audit_log, base_audit), "baseline", base_wall, "deployments"),
          flush=True)
    t_base_churn = churn_plain(apps, core, n, want)
    print(f"baseline churn settled in {t_base_churn:.1f}s", flush=True)
    core.delete_namespace("baseline")
    wait_for(lambda: not core.list_namespaced_pod("baseline").items, 600, "baseline deleted", interval=1)
    return t_base, t_base_churn


def profile_summary(path: Path, top: int = 25) -> str:
    """py-spy's raw output (one collapsed stack and its sample count per line) as the functions with
    the largest share of samples: inclusive (anywhere on the stack) and self (the innermost frame)."""
    inclusive: Counter[str] = Counter()
    own: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        # a function per frame (no line numbers), its file from the package down
        frames = [re.sub(r"\((?:[^)]*/(?:site-packages|python3\.\d+)/)?([^):]*)(?::\d+)?\)", r"(\1)", f)
                  for f in stack.replace(f"{REPO}/", "").split(";")]
        for frame in set(frames):
            inclusive[frame] += n
        own[frames[-1]] += n
    if not total:
        return "  profile: no samples"
    lines = [f"  profile: {total} samples holding the GIL; inclusive share:"]
    lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(top)]
    lines.append("  self share:")
    lines += [f"    {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes", type=int, default=3000)
    ap.add_argument("--deployments", type=int, default=300)
    ap.add_argument("--idle", type=int, default=60)
    ap.add_argument("--tracemalloc", type=int, default=0, metavar="FRAMES",
                    help="trace the operator's Python allocations (adds to its RSS); reports in operator-memory.txt")
    ap.add_argument("--profile", type=int, default=0, metavar="SECONDS",
                    help="py-spy the operator (GIL holders) for the first SECONDS of its phase")
    ap.add_argument("--operator-only", action="store_true", help="skip the baseline phases (no ratio)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="disagg-bench-"))
    (work / "pools.yaml").write_text(yaml.safe_dump(pools(args.nodes)))
    # node leases of 200 s (renewed every 50 s): at the kubelet's 40 s, 3,000 simulated nodes send ~300 lease
    # writes a second, which kept this machine's API server so busy that the controller manager's watch
    # cache fell minutes behind and Deployments' status lagged their pods in both phases
    cluster = LocalCluster("bench", state_dir=work / "state", audit_writes=True, audit_reads_of=OPERATOR_USER,
                           node_lease_seconds=200)
    t = time.monotonic()
    cluster.up(nodes_file=work / "pools.yaml", timeout=1800)
    gpu_nodes = sum(p["zones"] * p["racksPerZone"] * p["nvlinkDomainsPerRack"] * p["nodesPerDomain"]
                    for p in pools(args.nodes)["pools"] if p["gpus"])
    print(f"cluster with {gpu_nodes} GPU nodes ({len(PRODUCTS)} products) up in {time.monotonic() - t:.0f}s",
          flush=True)
    operator = None
    try:
        cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds"))
        api = config.new_client_from_config(str(cluster.kubeconfig))
        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        custom = client.CustomObjectsApi(api)
        want = args.deployments * 5

        # ---- baseline: the same pods as plain Deployments, then the same churn
        t_base = t_base_churn = float("nan")
        if not args.operator_only:
            t_base, t_base_churn = baseline(cluster, core, apps, args.deployments, want)

        # ---- the operator, as its own process under its own ServiceAccount
        kubeconfig = operator_kubeconfig(cluster, api, work / "operator.kubeconfig")
        log = open(work / "operator.log", "w")
        audit_start = cluster.audit_log.stat().st_size
        # where its memory goes (operator/memory.py): a report when empty, when full and at exit
        memory_report = work / "operator-memory.txt"
        # the allocator settings of the chart's operator Deployment (tests/test_chart.py checks them there)
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "DISAGG_OPERATOR_MEMORY": str(memory_report),
               "MALLOC_ARENA_MAX": "2", "PYTHONMALLOC": "malloc"}
        if args.tracemalloc:
            env["DISAGG_OPERATOR_TRACEMALLOC"] = str(args.tracemalloc)
        operator = subprocess.Popen([sys.executable, "-m", "disagg.operator", "--liveness",
                                     f"http://127.0.0.1:{free_port()}/healthz"], env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
        core.create_namespace({"metadata": {"name": "ops"}})
        wait_for(lambda: core.list_namespaced_service_account("ops").items, 60, "ops SA")
        # started: its watches are open (the audit log shows them)
        wait_for(lambda: any(e.get("verb") == "watch" for e in audit_events(cluster.audit_log, audit_start)), 180,
                 "the operator's watches")
        rss_empty = rss_mib(operator.pid)
        operator.send_signal(signal.SIGUSR1)
        _firsts.clear()   # what the baseline's churn recorded
        op_audit, op_wall, op_cpu = cluster.audit_log.stat().st_size, time.time(), cpu_by_program()
        profile = work / "operator-profile.txt"
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(operator.pid),
                                "--duration", str(args.profile), "--gil", "--nonblocking", "--rate", "50",
                                "--format", "raw", "--output", str(profile)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) if args.profile else None
        t = time.monotonic()
        for i in range(args.deployments):
            custom.create_namespaced_custom_object(GROUP, VERSION, "ops", PLURAL, disagg_deployment(i))

        def all_ready() -> bool:
            if "pods" not in _firsts and pods_settled(core, "ops", want):
                _first("pods")
            items = custom.list_namespaced_custom_object(GROUP, VERSION, "ops", PLURAL)["items"]
            ready = sum(1 for o in items if (o.get("status") or {}).get("phase") == "Ready")
            _progress(f"ops: {ready} of {args.deployments} DisaggDeployments Ready", key="deployments")
            return len(items) == args.deployments and ready == args.deployments
        wait_for(all_ready, 1800, "every DisaggDeployment Ready", interval=1)
        t_op = time.monotonic() - t
        print(f"operator: {args.deployments} DisaggDeployments ({want} pods, gangs) Ready in {t_op:.1f}s"
              f"{_split(t)}", flush=True)
        print(cpu_line(op_cpu, t_op), flush=True)
        phase = all_audit_events(cluster.audit_log, op_audit)
        print(timeline(phase, "ops", op_wall, "disaggdeployments"), flush=True)
        mine = Counter(f"{e.get('verb')} {(e.get('objectRef') or {}).get('resource')}"
                       + (f"/{e['objectRef']['subresource']}" if (e.get('objectRef') or {}).get('subresource') else "")
                       for e in phase if (e.get("user") or {}).get("username") == OPERATOR_USER)
        print(f"  the operator's requests in the phase, per deployment: "
              + ", ".join(f"{k} {n / args.deployments:.1f}" for k, n in mine.most_common(14)), flush=True)
        if spy is not None:
            spy.wait(args.profile + 60)
            print(profile_summary(profile) if profile.exists() else "  profile: py-spy wrote nothing", flush=True)
        # ---- idle: no write may come from the operator, once every status has settled (Ready can
        # come a refresh before Progressing turns False, and old gang objects are pruned after that)
        wait_for(lambda: all_converged(custom, args.deployments), 600, "every status settled", interval=1)
        rss_full = rss_mib(operator.pid)
        operator.send_signal(signal.SIGUSR1)
        time.sleep(5)
        offset = cluster.audit_log.stat().st_size
        time.sleep(args.idle)
        idle = audit_events(cluster.audit_log, offset)
        writes = [e for e in idle if e.get("verb") in ("create", "update", "patch", "delete", "deletecollection")]
        # every request while settled (reads are audited for the operator's user), per second, by verb
        idle_rates = {verb: round(n / args.idle, 2) for verb, n in sorted(Counter(e.get("verb") for e in idle
                                                                                   ).items())}

        # ---- churn on the operator's deployments
        t_op_churn = float("nan") if args.operator_only else churn_operator(custom, core, args.deployments, want)
        print(f"operator churn settled in {t_op_churn:.1f}s", flush=True)
        reads = reads_summary(audit_events(cluster.audit_log, audit_start))
        print(json.dumps({
            "gpu_nodes": gpu_nodes, "gpu_products": list(PRODUCTS.values()), "deployments": args.deployments,
            "pods": want,
            "baseline_seconds": round(t_base, 1), "operator_seconds": round(t_op, 1),
            "ratio_operator_over_baseline": round(t_op / t_base, 2),
            "churn": "10% scaled, 10% rolled, 10% deleted and created again",
            "baseline_churn_seconds": round(t_base_churn, 1), "operator_churn_seconds": round(t_op_churn, 1),
            "churn_ratio_operator_over_baseline": round(t_op_churn / t_base_churn, 2),
            "operator_peak_rss_mib": round(rss_mib(operator.pid, "VmHWM"), 1),
            "operator_rss_mib_no_deployments": round(rss_empty, 1),
            "operator_rss_mib_per_100_deployments": round((rss_full - rss_empty) / (args.deployments / 100), 1),
            f"operator_writes_in_{args.idle}s_idle": len(writes),
            f"operator_requests_per_second_in_{args.idle}s_idle": idle_rates,
            "operator_memory_report": str(memory_report),
            "idle_write_examples": [f"{w['verb']} {w['objectRef'].get('resource')}/{w['objectRef'].get('name')}"
                                    for w in writes[:5]],
            "operator_list_and_watch_requests": reads,
        }, indent=2))
        return 0
    finally:
        try:
            if operator:
                operator.terminate()
                operator.wait(60)
        except subprocess.TimeoutExpired:
            operator.kill()
        finally:
            cluster.down()


if __name__ == "__main__":
    sys.exit(main())
