"""Our endpoint picker (the router in picker mode, kv-aware) against the Gateway API Inference Extension's
reference EPP v1.0.0, on the same two real vLLM workers behind the same Envoy configuration.

Two aggregated vLLM workers (CPU build, the tiny model, prefix caching on, one core each, as
tests/test_router_kv.py starts them). Each picker runs behind its own Envoy (disagg.e2e.gateway, one
configuration: FULL_DUPLEX_STREAMED bodies, as Gateway implementations configure an InferencePool's picker
and as the reference EPP requires, FailClose). Both pickers and both Envoys run for the whole benchmark.

The reference EPP is the upstream binary, built from its Go module into the cache outside the repository
(``${DISAGG_CACHE:-~/.cache/disagg}/bin/epp-v1.0.0/epp``, ``go install`` when absent), with the scheduler
configuration its Helm chart ships (queue, KV-cache-utilization and prefix-cache scorers, max-score
picker) and vLLM's current metric names. It discovers the workers the way it does in a cluster: from an
InferencePool (inference.networking.k8s.io/v1) on a real local control plane (disagg.e2e.localcluster),
whose selector matches two hostNetwork pods on two kwok nodes whose InternalIPs are 127.0.0.2 and
127.0.0.3 (so the pods' status.podIP are those addresses); each vLLM worker listens on its node's
address at the pool's target port (Linux answers on all of 127/8). The GIE CRDs are applied at run time
from the Go module cache (never copied into this repository). Our picker gets the same two addresses and
the workers' KV event sockets in its configuration.

Workload: a session-sampled, scaled-down replay of the Mooncake conversation trace
(../shared/traces/mooncake_conversation.jsonl): requests grouped into sessions by their second block id
(the first is a prompt every request shares), sessions drawn at random until ``--requests``, replayed in
trace order as a closed loop of ``--concurrency`` clients (the CPU workers take only a few at a time; the
trace's own timestamps would swamp them). Each 512-token block of the trace becomes ``--block-tokens``
(32: the input scaled by 1/16, truncated to fit the tiny model's 2,048 positions) words chosen from its
block id among words the tiny model's tokenizer makes one token each, so a block is exactly that many
tokens whatever the text; outputs are scaled the same way and capped. Text, not token ids: the
reference EPP's prefix scorer hashes the prompt's characters.

Rounds alternate the pickers ABBA... so that drift on this shared machine (other jobs' load) hits both
alike; each round replays the same sampled trace with its own text (every block salted with the round),
so no round finds another's prefixes in the caches, and the same token structure, so rounds differ only
in routing (and in the machine's load). Reported per picker, summed over its rounds: the
workers' prefix-cache hit ratio (vLLM's own vllm:prefix_cache_hits / queries), prefill tokens computed
(queries - hits), client-side TTFT p50/p99 (time to the first streamed chunk through Envoy), errors and
each worker's share of prompt tokens.

    make bench-deps
    .venv/bin/python bench/picker_vs_reference_epp.py [--rounds 4] [--requests 96] [--concurrency 4]

Needs Go (for the first build of the EPP; the module is fetched through the Go module proxy) and the
cluster binaries (make cluster-build) and Envoy (make envoy-build), which it builds when absent.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from disagg.api import metrics as m
from disagg.e2e.gateway import FAIL_CLOSE, STREAMED, Envoy
from disagg.workers.envpath import worker_python
from disagg.workers.local import cpu_settings, free_port, metric_sum, router, scrape, stop_all, worker
from disagg.workers.tinymodel import ensure

REPO = Path(__file__).resolve().parent.parent
TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
EPP_MODULE = "sigs.k8s.io/gateway-api-inference-extension"
EPP_VERSION = "v1.0.0"
MAX_MODEL_LEN = 2048
ROUTING_TOP = 5e-3      # the largest finite bucket of our picker's decision-time histogram (router/metrics.py)
NODE_IPS = ("127.0.0.2", "127.0.0.3")
NAMESPACE = "bench"
POOL = "tiny-pool"
POD_LABELS = {"app": "tiny-vllm"}
# The scheduler configuration the reference EPP's Helm chart ships (config/charts/inferencepool,
# templates/epp-config.yaml: default-plugins.yaml); the loader adds the max-score picker.
EPP_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: prefix-cache-scorer
"""


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------- the EPP
def cache_root() -> Path:
    return Path(os.environ.get("DISAGG_CACHE") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
                / "disagg")


def _go() -> str:
    go = shutil.which("go") or next((p for p in ("/usr/local/go/bin/go",) if Path(p).exists()), None)
    if go is None:
        raise SystemExit(f"Go is needed to build the reference EPP ({EPP_MODULE}/cmd/epp@{EPP_VERSION}) into "
                         f"{cache_root() / 'bin'}: install Go 1.24 or later (https://go.dev/dl/) and put it on PATH")
    return go


def _go_env() -> dict[str, str]:
    return {**os.environ, "GOFLAGS": "-mod=mod", "CGO_ENABLED": "0"}


def ensure_epp() -> Path:
    """The reference EPP binary, built from its Go module into the cache when absent."""
    out = cache_root() / "bin" / f"epp-{EPP_VERSION}"
    binary = out / "epp"
    if binary.exists():
        return binary
    go = _go()
    log(f"building the reference EPP {EPP_VERSION} into {out} (go install; a few minutes the first time)")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # outside any module (GOFLAGS=-mod=mod: the module's own go.mod decides its dependencies)
    subprocess.run([go, "install", f"{EPP_MODULE}/cmd/epp@{EPP_VERSION}"], check=True, cwd=tempfile.gettempdir(),
                   env={**_go_env(), "GOBIN": str(tmp)})
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return binary


def epp_crds() -> list[Path]:
    """The CRDs the EPP reads (InferencePool v1, InferenceObjective), from the Go module cache."""
    proc = subprocess.run([_go(), "mod", "download", "-json", f"{EPP_MODULE}@{EPP_VERSION}"], check=True,
                          capture_output=True, text=True, cwd=tempfile.gettempdir(), env=_go_env())
    bases = Path(json.loads(proc.stdout)["Dir"]) / "config" / "crd" / "bases"
    return [bases / "inference.networking.k8s.io_inferencepools.yaml",
            bases / "inference.networking.x-k8s.io_inferenceobjectives.yaml"]


# ----------------------------------------------------------------------------------------------- cluster
def _node(name: str, ip: str) -> dict:
    from disagg.e2e.localcluster.nodepools import KWOK_ANNOTATION

    resources = {"cpu": "16", "memory": "64Gi", "pods": "110", "ephemeral-storage": "1Ti"}
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "type": "kwok",
                                                  "bench": "epp"},
                         "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"}},
            "status": {"capacity": resources, "allocatable": resources,
                       "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}]}}


def _pod(name: str, node: str, port: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": POD_LABELS},
            "spec": {"nodeName": node, "hostNetwork": True,
                     "containers": [{"name": "vllm", "image": "local/vllm-cpu:tiny",
                                     "ports": [{"containerPort": port, "name": "http"}]}]}}


def _pool(port: int) -> dict:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": POOL, "namespace": NAMESPACE},
            "spec": {"selector": {"matchLabels": POD_LABELS}, "targetPorts": [{"number": port}],
                     # a gateway's reference to the picker; the EPP itself does not read it
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}, "failureMode": FAIL_CLOSE}}}


def pool_in_cluster(cluster, port: int) -> list[str]:
    """Two kwok nodes at NODE_IPS, a hostNetwork pod on each, the InferencePool selecting them; returns the
    pods' ip:port once both are Running and Ready with those addresses."""
    from kubernetes import client, config

    api = config.new_client_from_config(str(cluster.kubeconfig))
    core = client.CoreV1Api(api)
    for crd in epp_crds():
        cluster.kubectl("apply", "--server-side", "-f", str(crd))
    cluster.kubectl("wait", "--for=condition=Established", "--timeout=120s",
                    "crd/inferencepools.inference.networking.k8s.io",
                    "crd/inferenceobjectives.inference.networking.x-k8s.io")
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    nodes = [f"bench-epp-{i}" for i in range(len(NODE_IPS))]
    for name, ip in zip(nodes, NODE_IPS):
        core.create_node(_node(name, ip))
    deadline = time.monotonic() + 120
    while True:   # Ready without the node lifecycle controller's start-up taints, as nodepools.wait_ready
        ready = [n for n in nodes if (lambda o: any(c.type == "Ready" and c.status == "True"
                                                    for c in o.status.conditions or [])
                                      and not any(t.key.startswith("node.kubernetes.io/") for t in o.spec.taints or []))
                 (core.read_node(n))]
        if len(ready) == len(nodes):
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"kwok nodes not Ready: {set(nodes) - set(ready)}\n{cluster.tail('kwok')}")
        time.sleep(0.5)
    for i, node in enumerate(nodes):
        core.create_namespaced_pod(NAMESPACE, _pod(f"tiny-vllm-{i}", node, port))
    client.CustomObjectsApi(api).create_namespaced_custom_object(
        "inference.networking.k8s.io", "v1", NAMESPACE, "inferencepools", _pool(port))
    deadline = time.monotonic() + 120
    while True:
        pods = core.list_namespaced_pod(NAMESPACE, label_selector=",".join(f"{k}={v}" for k, v in POD_LABELS.items()))
        ips = sorted(p.status.pod_ip for p in pods.items if p.status.pod_ip and any(
            c.type == "Ready" and c.status == "True" for c in p.status.conditions or []))
        if ips == sorted(NODE_IPS):
            return [f"{ip}:{port}" for ip in ips]
        if time.monotonic() > deadline:
            raise TimeoutError(f"pods not Ready at {NODE_IPS}: {ips}\n{cluster.tail('kwok')}")
        time.sleep(0.5)


class Epp:
    """The reference EPP as a local process against the local cluster's API server."""

    def __init__(self, binary: Path, kubeconfig: Path, logs: Path, metrics_port: int):
        self.binary, self.kubeconfig, self.logs = binary, kubeconfig, logs
        self.grpc_port, self.health_port, self.metrics_port = free_port(), free_port(), free_port()
        self.model_metrics_port = metrics_port
        self.proc: subprocess.Popen | None = None

    def start(self) -> Epp:
        config = self.logs / "epp-config.yaml"
        config.write_text(EPP_CONFIG)
        argv = [str(self.binary), "--pool-name", POOL, "--pool-namespace", NAMESPACE,
                "--grpc-port", str(self.grpc_port), "--grpc-health-port", str(self.health_port),
                "--metrics-port", str(self.metrics_port), "--secure-serving=false", "--enable-pprof=false",
                "--config-file", str(config), "--model-server-metrics-port", str(self.model_metrics_port),
                # vLLM renamed gpu_cache_usage_perc (the EPP's default) to kv_cache_usage_perc; no LoRA here
                "--kv-cache-usage-percentage-metric", m.VLLM_KV_CACHE_USAGE,
                "--total-queued-requests-metric", m.VLLM_NUM_REQUESTS_WAITING,
                "--lora-info-metric", "", "--zap-encoder", "json", "--v", "1"]
        self.log_path = self.logs / "epp.log"
        self.proc = subprocess.Popen(argv, env={**os.environ, "KUBECONFIG": str(self.kubeconfig)},
                                     stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        return self

    def wait_ready(self, timeout: float = 120) -> Epp:
        """Its gRPC health SERVING: the InferencePool synced into its datastore."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(f"127.0.0.1:{self.health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the EPP exited with {self.proc.returncode}:\n{self.tail()}")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(service="readiness"),
                                  timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                        return self
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"the EPP not ready after {timeout:.0f}s:\n{self.tail()}")

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()


# ---------------------------------------------------------------------------------------------- workload
def sample_trace(n: int, seed: int, max_blocks: int, out_scale: float, max_out: int) -> list[tuple[list[int], int]]:
    """(block ids, output tokens) of ~n requests: whole sessions drawn at random, in trace order."""
    rows = [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]
    sessions = collections.defaultdict(list)
    for i, r in enumerate(rows):
        sessions[tuple(r["hash_ids"][:2])].append(i)
    keys = sorted(sessions)
    random.Random(seed).shuffle(keys)
    picked: list[int] = []
    for k in keys:
        if len(picked) >= n:
            break
        picked.extend(sessions[k])
    return [(rows[i]["hash_ids"][:max_blocks], max(1, min(max_out, round(rows[i]["output_length"] * out_scale))))
            for i in sorted(picked)]


def single_token_words(model: str) -> list[str]:
    """Lower-case words that the tiny model's tokenizer makes one token each after a space: a block of n
    of them is exactly n tokens, whatever the text, so every round's text has the same token structure
    (the trace's blocks aligned alike in vLLM's blocks) and only the routing differs between rounds."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    words = sorted(k[1:] for k in tok.get_vocab() if k.startswith("\u0120") and k[1:].isalpha()
                   and k[1:].islower() and len(k) >= 3)
    words = [w for w in words if len(tok.encode(" " + w, add_special_tokens=False).ids) == 1]
    if len(words) < 8:
        raise SystemExit(f"the tokenizer of {model} has too few one-token words ({words}) for this workload")
    return words


def block_text(salt: str, block: int, n: int, words: list[str]) -> str:
    rng = random.Random(f"{salt}/{block}")
    return "".join(" " + rng.choice(words) for _ in range(n))


def prompts_for(trace, salt: str, n: int, words: list[str]) -> list[tuple[str, int]]:
    """The requests' prompts: each block n one-token words chosen by the round's salt and the block id, so
    equal block ids (equal prefixes) are equal text and no other round shares a prefix."""
    return [("".join(block_text(salt, b, n, words) for b in blocks), out) for blocks, out in trace]


def one_request(url: str, prompt: str, max_tokens: int) -> tuple[float | None, str | None]:
    """(TTFT, error) of one streamed completion through the gateway."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            done = False
            for line in r:
                if first is None and line.startswith(b"data: {"):
                    first = time.perf_counter() - start
                if line.startswith(b"data: [DONE]"):
                    done = True
            if first is None or not done:
                return None, "stream ended early"
            return first, None
    except urllib.error.HTTPError as e:
        return None, f"HTTP {e.code}: {e.read()[:200]!r}"
    except Exception as e:  # noqa: BLE001 (a benchmark counts every failure)
        return None, f"{type(e).__name__}: {e}"


def worker_counters(workers) -> dict[str, dict[str, float]]:
    out = {}
    for w in workers:
        s = scrape(w.url)
        out[w.url] = {k: metric_sum(s, f"{name}_total") for k, name in (
            ("queries", m.VLLM_PREFIX_CACHE_QUERIES), ("hits", m.VLLM_PREFIX_CACHE_HITS),
            ("prompt", m.VLLM_PROMPT_TOKENS))}
    return out


def decision_histogram(router_url: str) -> dict[float, float]:
    """Our picker's cumulative decision-time buckets (le -> count) for planned OpenAI requests."""
    s = scrape(router_url)
    prefix = f"{m.ROUTER_PICKER_DECISION_SECONDS}_bucket{{"
    out: dict[float, float] = {}
    for key, value in s.items():
        if key.startswith(prefix) and 'kind="plan"' in key:
            le = key.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = out.get(float(le), 0) + value
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding the q-th percentile of the decisions between two scrapes."""
    delta = sorted((le, after[le] - before.get(le, 0)) for le in after)
    total = delta[-1][1] if delta else 0
    for le, count in delta:
        if total and count >= q / 100 * total:
            return le
    return float("nan")


def run_round(url: str, prompts: list[tuple[str, int]], concurrency: int, workers) -> dict:
    before = worker_counters(workers)
    t0 = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one_request(url, *p), prompts))
    wall = time.monotonic() - t0
    time.sleep(1.0)   # the last requests' counters published
    after = worker_counters(workers)
    delta = {u: {k: after[u][k] - before[u][k] for k in after[u]} for u in after}
    return {"ttft": [t for t, e in results if e is None], "errors": [e for _, e in results if e is not None],
            "queries": sum(d["queries"] for d in delta.values()), "hits": sum(d["hits"] for d in delta.values()),
            "prompt_by_worker": {u: d["prompt"] for u, d in delta.items()}, "wall": wall}


def ms(seconds: float) -> str:
    return f"> {ROUTING_TOP * 1000:g} ms" if seconds == float("inf") else f"<= {seconds * 1000:g} ms"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    v = sorted(values)
    return v[min(len(v) - 1, max(0, round(q / 100 * len(v) + 0.5) - 1))]


# ------------------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=4, help="rounds in all, the pickers alternating ABBA...")
    ap.add_argument("--requests", type=int, default=96, help="requests per round (whole sessions)")
    ap.add_argument("--concurrency", type=int, default=4, help="clients in flight (closed loop)")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="vLLM's --max-num-seqs per worker")
    ap.add_argument("--kv-cache-mib", type=int, default=64,
                    help="each worker's KV cache (64 MiB: 65,536 tokens of the tiny model; smaller evicts)")
    ap.add_argument("--block-tokens", type=int, default=32, help="tokens per 512-token block of the trace")
    ap.add_argument("--max-out", type=int, default=16, help="cap on output tokens (scaled like the input)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-load-skew", type=float,
                    help="our picker's spec.router.maxLoadSkew (default the API's, 2): at a handful of requests "
                         "in flight the bound sends a session's turn away from its cached worker as soon as that "
                         "worker holds 3 and the other none")
    ap.add_argument("--keep", action="store_true", help="keep the logs directory")
    ap.add_argument("--markdown", type=Path, help="also write the results table here")
    args = ap.parse_args()

    epp_binary = ensure_epp()
    python = worker_python()
    model = str(ensure(python))
    from disagg.e2e.localcluster import LocalCluster

    logs = Path(tempfile.mkdtemp(prefix="picker-vs-epp-"))
    log(f"logs in {logs}")
    max_blocks = (MAX_MODEL_LEN - args.max_out - 1) // args.block_tokens     # (1: the BOS token)
    trace = sample_trace(args.requests, args.seed, max_blocks, args.block_tokens / 512, args.max_out)
    words = single_token_words(model)
    log(f"{len(trace)} requests a round, {statistics.mean(len(b) for b, _ in trace):.1f} blocks of "
        f"{args.block_tokens} tokens each on average, outputs <= {args.max_out}")

    # one port for both (free_port: bindable on every address): each worker listens on its own node's
    # address at the pool's target port
    port = free_port()

    with contextlib.ExitStack() as stack:
        procs = []
        for i, ip in enumerate(NODE_IPS):
            s = cpu_settings("decode", model, str(i % (os.cpu_count() or 1)), kv_transfer=False, drain_seconds=5,
                             host=ip, advertise_host=ip, port=port, max_model_len=MAX_MODEL_LEN,
                             kv_cache_bytes=args.kv_cache_mib * 2**20,
                             engine_args=["--max-num-seqs", str(args.max_num_seqs)])
            p = worker(f"vllm-{i}", s, python, logs)
            p.url, p.kv_events = f"http://{ip}:{port}", f"tcp://{ip}:{s.kv_events_port}"
            procs.append(p)
        stack.callback(stop_all, procs)
        for p in procs:
            p.start()
        log("starting the local control plane and the two vLLM workers")
        cluster = LocalCluster(f"bench-epp-{os.getpid()}", state_dir=logs / "cluster")
        stack.callback(cluster.down)
        cluster.up()
        endpoints = pool_in_cluster(cluster, port)
        log(f"InferencePool {NAMESPACE}/{POOL}: pods at {endpoints}")
        for p in procs:
            p.wait_ready(timeout=900)
        log("workers ready")

        epp = Epp(epp_binary, cluster.kubeconfig, logs, port).start()
        stack.callback(epp.stop)
        epp.wait_ready()

        grpc_port, rport = free_port(), free_port()
        cfg = {"model": "tiny", "tokenizer": model, "block_size": 32, "max_model_len": MAX_MODEL_LEN, "port": rport,
               "host": "127.0.0.1", "spec": {"policy": "kv-aware", "disaggregation": "never",
                        **({"maxLoadSkew": args.max_load_skew} if args.max_load_skew else {})},
               "decode": [{"url": p.url, "kv_events": p.kv_events} for p in procs]}
        (logs / "picker.json").write_text(json.dumps(cfg))
        ours = router(logs / "picker.json", rport, logs, "--mode", "picker", "--grpc-port", str(grpc_port))
        ours.name, ours.log_path = "picker", logs / "picker.log"
        ours.start()
        stack.callback(ours.stop)
        ours.wait_ready(timeout=120)

        gateways = {}
        pickers = (("disagg picker", f"127.0.0.1:{grpc_port}"), ("reference EPP", f"127.0.0.1:{epp.grpc_port}"))
        for name, picker in pickers:
            envoy = Envoy(logs / f"envoy-{name.split()[0]}", port=free_port(), admin_port=free_port(), picker=picker,
                          pool=endpoints, failure_mode=FAIL_CLOSE, body_mode=STREAMED)
            stack.enter_context(envoy)
            gateways[name] = envoy.url
        # warm-up through each gateway (own text): the pickers' first decisions, vLLM's first requests
        for name, url in gateways.items():
            for i in range(4):
                t, err = one_request(url, block_text(f"warmup-{name}", i, 40, words), 4)
                if err:
                    raise RuntimeError(f"{name}: warm-up request failed: {err}\nEPP log:\n{epp.tail()}")
        log(f"gateways answer: {gateways}")

        names = list(gateways)
        order = [names[0] if r % 4 in (0, 3) else names[1] for r in range(args.rounds)]   # ABBA ABBA ...
        rounds = []
        for r, name in enumerate(order):
            load = os.getloadavg()[0]
            hist = decision_histogram(ours.url)
            res = run_round(gateways[name], prompts_for(trace, f"round-{r}", args.block_tokens, words),
                            args.concurrency, procs)
            res.update(picker=name, round=r, load=load)
            if name == names[0]:
                after = decision_histogram(ours.url)
                res["decision"] = (bucket_quantile(hist, after, 50), bucket_quantile(hist, after, 99))
            rounds.append(res)
            ratio = res["hits"] / res["queries"] if res["queries"] else float("nan")
            log(f"round {r} {name}: hit ratio {ratio:.3f}, computed {res['queries'] - res['hits']:.0f} tokens, "
                f"TTFT p50 {pct(res['ttft'], 50) * 1000:.0f} ms p99 {pct(res['ttft'], 99) * 1000:.0f} ms, "
                f"{len(res['errors'])} errors, {res['wall']:.0f} s, load {load:.1f}, prompt tokens by worker "
                f"{[round(v) for v in res['prompt_by_worker'].values()]}"
                + (f"; our picker's decision time p50 {ms(res['decision'][0])}, p99 {ms(res['decision'][1])} "
                   "(histogram buckets)" if "decision" in res else ""))
            for e in res["errors"][:3]:
                log(f"  error: {e}")

    table = report(rounds, names, args, trace)
    print(table)
    if args.markdown:
        args.markdown.write_text(table + "\n")
    if not args.keep:
        shutil.rmtree(logs, ignore_errors=True)
    return 0


def report(rounds: list[dict], names: list[str], args, trace) -> str:
    lines = [f"{len(rounds)} rounds ({' '.join('A' if r['picker'] == names[0] else 'B' for r in rounds)}; "
             f"A = {names[0]}, B = {names[1]}), {len(trace)} requests a round, concurrency {args.concurrency}, "
             f"load average {min(r['load'] for r in rounds):.1f}-{max(r['load'] for r in rounds):.1f}",
             "",
             "| picker | requests | prefix-cache hit ratio | prefill tokens computed | TTFT p50 | TTFT p99 | errors | "
             "prompt tokens per worker |",
             "|---|---|---|---|---|---|---|---|"]
    agg = {}
    for name in names:
        rs = [r for r in rounds if r["picker"] == name]
        ttft = [t for r in rs for t in r["ttft"]]
        q, h = sum(r["queries"] for r in rs), sum(r["hits"] for r in rs)
        per_worker = collections.Counter()
        for r in rs:
            per_worker.update(r["prompt_by_worker"])
        share = " / ".join(f"{v / max(1, sum(per_worker.values())):.0%}" for v in per_worker.values())
        errors = sum(len(r["errors"]) for r in rs)
        agg[name] = (h / q if q else float("nan"), q - h, pct(ttft, 50), pct(ttft, 99), errors)
        lines.append(f"| {name} | {len(ttft) + errors} | {agg[name][0]:.3f} | {q - h:.0f} | "
                     f"{pct(ttft, 50) * 1000:.0f} ms | {pct(ttft, 99) * 1000:.0f} ms | {errors} | {share} |")
    a, b = agg[names[0]], agg[names[1]]
    lines += ["", f"ratios {names[0]} / {names[1]}: hit ratio {a[0] / b[0]:.2f}, prefill computed {a[1] / b[1]:.2f}, "
              f"TTFT p50 {a[2] / b[2]:.2f}, p99 {a[3] / b[3]:.2f}",
              f"goal (at least the reference EPP's hit ratio, lower TTFT): hit ratio {'>=' if a[0] >= b[0] else '<'} "
              f"({a[0]:.3f} vs {b[0]:.3f}), TTFT p50 {'lower' if a[2] < b[2] else 'NOT lower'}, "
              f"p99 {'lower' if a[3] < b[3] else 'NOT lower'}: "
              f"{'met' if a[0] >= b[0] and a[2] < b[2] and a[3] < b[3] else 'NOT met'}",
              "", "per round:", "",
              "| round | picker | hit ratio | computed | TTFT p50 | TTFT p99 | errors | wall | load "
              "| our decision p50/p99 |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rounds:
        ratio = r["hits"] / r["queries"] if r["queries"] else float("nan")
        decision = f"{ms(r['decision'][0])} / {ms(r['decision'][1])}" if "decision" in r else "-"
        lines.append(f"| {r['round']} | {r['picker']} | {ratio:.3f} | {r['queries'] - r['hits']:.0f} | "
                     f"{pct(r['ttft'], 50) * 1000:.0f} ms | {pct(r['ttft'], 99) * 1000:.0f} ms | {len(r['errors'])} | "
                     f"{r['wall']:.0f} s | {r['load']:.1f} | {decision} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
