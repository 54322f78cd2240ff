"""Goodput as the field's own benchmark clients measure it, for layouts of the tiny model on this machine's
two cores, each run with the same prompts, output lengths and targets.

Local processes (`disagg serve --local`'s pieces):

* ``disaggregated``: what `disagg serve --local` runs: prefill vLLM (core 0), decode vLLM (core 1), NIXL
  between them, the router in front (every request prefilled remotely);
* ``aggregated``: one ordinary vLLM (no KV connector, cores 0-1) behind the router (no prefill workers: every
  request served whole by that engine, the router's own path and cost still in it);
* ``direct``: the same engine, the client straight to it: the baseline the ratios are against.

A DisaggDeployment on the local cluster's real node (kubelet, containerd, the project's images; the operator
in this process), the client on this host through the deployment's Service (kube-proxy's ClusterIP):

* ``node-disaggregated``: 1 prefill + 1 decode pod, disaggregation always (e2e/realnode.py's deployment);
* ``node-aggregated``: prefill 0, 1 decode pod, disaggregation never: the router pod in front of one engine;
* ``node-direct``: that decode pod, the client straight to its pod IP: the node rows' baseline.

The node layouts start a cluster with a real node (one per machine at a time: hold the machine's real-node
lock around the run if other jobs use it) and take it down at the end.

Clients: ``vllm bench serve`` (disagg.e2e.fieldclients: vLLM's own, run from the worker environment), aiperf
(NVIDIA's) from its own environment in ~/.cache/disagg/aiperf-env (``--aiperf``), and guidellm (Red Hat's)
from ~/.cache/disagg/guidellm-env (``--guidellm``; bench/guidellm_env.sh builds it); each client is skipped
when its environment is not there. Bench only: both conflict with the project's pins. Each run:
``--prompts`` random prompts of ``--input-len`` tokens, exactly ``--output-len`` tokens out (EOS ignored),
``--concurrency`` at a time, goodput at each of ``--targets`` (TTFT and TPOT in ms). Tiny model, CPU engines: the
figures rank the layouts' overheads on this machine, not what GPUs serve.

    .venv/bin/python bench/field_clients.py [--prompts 32] [--input-len 256] [--output-len 32] [--concurrency 4]
        [--targets 2000:200,100:10] [--aiperf] [--guidellm] [--json rows.json]
        [--layouts direct,aggregated,disaggregated,node-direct,node-aggregated,node-disaggregated]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from disagg.e2e.fieldclients import vllm_bench_serve
from disagg.workers.envpath import worker_python
from disagg.workers.local import (cpu_settings, free_port, pd_processes, router, start_pd, stop_all, worker)
from disagg.workers.tinymodel import ensure

AIPERF_ENV = Path.home() / ".cache" / "disagg" / "aiperf-env"
GUIDELLM_ENV = Path(os.environ.get("DISAGG_GUIDELLM_ENV", Path.home() / ".cache" / "disagg" / "guidellm-env"))
LOCAL_LAYOUTS = ("direct", "aggregated", "disaggregated")
NODE_LAYOUTS = ("node-direct", "node-aggregated", "node-disaggregated")
NODE_NS = "field-clients"


def aiperf(base_url: str, tokenizer: str, out_dir: Path, args) -> dict | None:
    """One aiperf profile run (its own environment), its summary JSON; None when aiperf is not installed."""
    binary = AIPERF_ENV / "bin" / "aiperf"
    if not binary.exists():
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(binary), "profile", "--model", "tiny", "--url", base_url, "--endpoint-type", "completions",
            "--streaming", "--tokenizer", tokenizer, "--synthetic-input-tokens-mean", str(args.input_len),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.output_len),
            "--output-tokens-stddev", "0", "--extra-inputs", "ignore_eos:true", "--extra-inputs",
            f"min_tokens:{args.output_len}", "--concurrency", str(args.concurrency),
            "--request-count", str(args.prompts),
            "--goodput", f"time_to_first_token:{args.ttft_ms:g} inter_token_latency:{args.tpot_ms:g}",
            "--artifact-dir", str(out_dir), "--ui-type", "none"]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}   # a local directory, not a hub id
    run = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env)
    found = sorted(out_dir.rglob("profile_export_aiperf.json"))
    if run.returncode != 0 or not found:
        return {"error": f"aiperf exited {run.returncode}: {(run.stdout + run.stderr)[-1500:]}"}
    return json.loads(found[-1].read_text())


def guidellm(base_url: str, tokenizer: str, out_dir: Path, args) -> dict | None:
    """One guidellm run (its own environment) from a scenario file, its JSON report; None when guidellm is
    not installed. The same workload as the other clients: synthetic prompts of exactly ``input_len`` tokens,
    ``output_len`` tokens asked for with EOS ignored (guidellm sends max_tokens and ignore_eos itself),
    ``concurrency`` streams, ``prompts`` requests, goodput at the TTFT and TPOT targets (guidellm compares
    its TPOT target with the inter-token latency, as vLLM's client does)."""
    binary = GUIDELLM_ENV / "bin" / "guidellm"
    if not binary.exists():
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    report = out_dir / "guidellm.json"
    scenario = {"spec": {
        "backend": {"kind": "openai_http", "target": base_url, "model": "tiny", "request_format": "/v1/completions",
                    "stream": True},
        "profile": {"kind": "concurrent", "streams": [args.concurrency]},
        "constraints": [{"kind": "max_requests", "count": args.prompts}],
        "tokenizer": {"kind": "huggingface_auto", "model": tokenizer},
        "data": [{"kind": "synthetic_text", "prompt_tokens": args.input_len, "output_tokens": args.output_len}],
        "outputs": [{"kind": "json", "path": str(report)}],
        "metrics": {"kind": "generative", "slo": {"ttft_ms": args.ttft_ms, "tpot_ms": args.tpot_ms}}}}
    (out_dir / "scenario.json").write_text(json.dumps(scenario))
    argv = [str(binary), "run", "--scenario", str(out_dir / "scenario.json"), "--disable-console-interactive"]
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    # its own cwd: guidellm's worker processes put the caller's directory on sys.path, where this repository's
    # operator/ would shadow the standard library's
    run = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=env, cwd=out_dir)
    if run.returncode != 0 or not report.exists():
        return {"error": f"guidellm exited {run.returncode}: {(run.stdout + run.stderr)[-1500:]}"}
    return json.loads(report.read_text())


def row(layout: str, client: str, r: dict) -> dict:
    return {"layout": layout, "client": client, **r}


def vllm_row(layout: str, r: dict) -> dict:
    return row(layout, "vllm bench serve", {
        "completed": r["completed"], "failed": r["failed"], "req_s": r["request_throughput"],
        "goodput_req_s": r["request_goodput"], "out_tok_s": r["output_throughput"],
        "ttft_p50_ms": r["median_ttft_ms"], "ttft_p90_ms": r["p90_ttft_ms"], "tpot_p50_ms": r["median_tpot_ms"],
        "itl_p90_ms": r["p90_itl_ms"]})


def aiperf_row(layout: str, r: dict) -> dict:
    if "error" in r:
        return row(layout, "aiperf", {"error": r["error"]})

    def metric(name: str, stat: str = "avg"):
        m = r.get(name) or next((x for x in r.get("records", []) if x.get("tag") == name), None) or {}
        return m.get(stat)
    return row(layout, "aiperf", {
        "completed": metric("request_count"), "failed": metric("error_request_count") or 0,
        "req_s": metric("request_throughput"), "goodput_req_s": metric("goodput"),
        "out_tok_s": metric("output_token_throughput"), "ttft_p50_ms": metric("time_to_first_token", "p50"),
        "ttft_p90_ms": metric("time_to_first_token", "p90"), "tpot_p50_ms": metric("inter_token_latency", "p50"),
        "itl_p90_ms": metric("inter_token_latency", "p90")})


def guidellm_row(layout: str, r: dict) -> dict:
    if "error" in r:
        return row(layout, "guidellm", {"error": r["error"]})
    b = r["benchmarks"][-1]
    m = b["metrics"]

    def stat(name: str, key: str = "median", status: str = "successful"):
        d = (m.get(name) or {}).get(status) or {}
        if key.startswith("p"):
            return (d.get("percentiles") or {}).get(key)
        return d.get(key)
    totals = m["request_totals"]
    goodput = m.get("request_goodput")
    return row(layout, "guidellm", {
        "completed": totals["successful"], "failed": totals["errored"] + totals.get("incomplete", 0),
        "req_s": stat("requests_per_second", "mean"),
        "goodput_req_s": ((goodput or {}).get("successful") or {}).get("mean"),
        "out_tok_s": stat("output_tokens_per_second", "mean"),
        "ttft_p50_ms": stat("time_to_first_token_ms"), "ttft_p90_ms": stat("time_to_first_token_ms", "p90"),
        "tpot_p50_ms": stat("inter_token_latency_ms"), "itl_p90_ms": stat("inter_token_latency_ms", "p90")})


def measure(layout: str, url: str, model: str, python: str, work: Path, args) -> list[dict]:
    """Every client against ``url``, once per goodput target (the engines stay up between them). Each row
    carries the machine's 1-minute load average when its client finished: other jobs share these cores."""
    out = []
    for ttft_ms, tpot_ms in args.targets:
        a = argparse.Namespace(**{**vars(args), "ttft_ms": ttft_ms, "tpot_ms": tpot_ms})
        tag = f"{layout}-{ttft_ms:g}-{tpot_ms:g}"
        target = f"TTFT {ttft_ms:g} ms, TPOT {tpot_ms:g} ms"

        def add(r: dict) -> None:
            out.append(dict(r, target=target, load=round(os.getloadavg()[0], 1)))
        add(vllm_row(layout, vllm_bench_serve(python, url, "tiny", model, work / f"{tag}-vllm.json",
                                              num_prompts=a.prompts, input_len=a.input_len, output_len=a.output_len,
                                              max_concurrency=a.concurrency, ttft_ms=ttft_ms, tpot_ms=tpot_ms,
                                              timeout=3600)))
        if a.aiperf and (r := aiperf(url, model, work / f"{tag}-aiperf", a)) is not None:
            add(aiperf_row(layout, r))
        if a.guidellm and (r := guidellm(url, model, work / f"{tag}-guidellm", a)) is not None:
            add(guidellm_row(layout, r))
    return out


def table(rows: list[dict]) -> str:
    """One markdown table per goodput target."""
    cols = ["layout", "client", "completed", "failed", "req_s", "goodput_req_s", "out_tok_s", "ttft_p50_ms",
            "ttft_p90_ms", "tpot_p50_ms", "itl_p90_ms", "goodput_vs_direct", "load"]
    out = []
    for target in dict.fromkeys(r["target"] for r in rows):
        these = [r for r in rows if r["target"] == target]
        # each row against its own client's direct row on the same ground (local processes or the real node)
        base = {(r["layout"].startswith("node-"), r["client"]): r.get("goodput_req_s") for r in these
                if r["layout"] in ("direct", "node-direct")}
        lines = [f"goodput at {target}:", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in these:
            if "error" in r:
                lines.append(f"| {r['layout']} | {r['client']} | error: {r['error'][:200]} |")
                continue
            b = base.get((r["layout"].startswith("node-"), r["client"]))
            r = dict(r, goodput_vs_direct=(r["goodput_req_s"] / b) if b and r.get("goodput_req_s") is not None
                     else None)
            lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c))
                                           for c in cols) + " |")
        out.append("\n".join(lines))
    return "\n\n".join(out)


def targets(text: str) -> list[tuple[float, float]]:
    """``--targets``: TTFT_MS:TPOT_MS pairs, comma-separated."""
    try:
        pairs = [tuple(float(x) for x in pair.split(":")) for pair in text.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(pair) != 2 or min(pair) <= 0 for pair in pairs):
        raise argparse.ArgumentTypeError(f"--targets: {text!r} is not TTFT_MS:TPOT_MS[,TTFT_MS:TPOT_MS...] "
                                         "with positive numbers")
    return pairs


def progress(text: str) -> None:
    """Printed as it comes, also while kopf's test runner (the in-process operator) has swapped sys.stdout
    for its own capture."""
    print(text, file=sys.__stdout__, flush=True)


def on_real_node(layouts: list[str], model: str, python: str, work: Path, args) -> list[dict]:
    """The node layouts: a cluster with the real node, the images built into it (reused when unchanged), the
    operator in this process, then one DisaggDeployment after the other (two CPU engines at a time at most on
    this machine), each measured through its Service; the cluster taken down at the end."""
    from kubernetes import client, config

    from disagg.api.names import LABEL_DEPLOYMENT, LABEL_ROLE
    from disagg.e2e import realnode
    from disagg.e2e.images import ensure_images
    from disagg.e2e.localcluster import LocalCluster
    from disagg.e2e.operator_fixture import operator_kubeconfig, running_operator
    from disagg.e2e.suite import wait_crd_established
    from disagg.e2e.testing import DD, wait_for
    from disagg.operator.render import ROUTER_IMAGE_ENV

    rows: list[dict] = []
    cluster = LocalCluster(f"field-clients-{os.getpid()}", state_dir=work / "cluster", real_node=True)
    try:
        cluster.up()
        api = config.new_client_from_config(str(cluster.kubeconfig))
        core = client.CoreV1Api(api)
        cluster.kubectl("apply", "--server-side", "-f", str(realnode.CHART.parent.parent / "crds"))
        wait_crd_established(api)
        images = ensure_images(str(cluster.node.containerd_socket))
        os.environ[ROUTER_IMAGE_ENV] = images["control-plane"]   # as the chart tells the operator pod
        core.create_namespace({"metadata": {"name": NODE_NS}})
        wait_for(lambda: core.list_namespaced_service_account(NODE_NS).items, 60, "the default ServiceAccount")
        source = realnode.install_model(api, NODE_NS, model)

        def serve(name: str, **shape) -> tuple[DD, str]:
            dd = DD(api, NODE_NS, realnode.deployment(name, source, images["worker-cpu"], **shape))
            dd.wait_phase("Ready", timeout=900)
            realnode.wait_serving(api, NODE_NS, name, prefill=shape.get("prefill", 1), decode=shape.get("decode", 1))
            return dd, realnode.router_url(api, NODE_NS, name).removesuffix("/v1")

        def delete(dd: DD) -> None:
            client.CustomObjectsApi(api).delete_namespaced_custom_object("serving.disagg.dev", "v1alpha1", NODE_NS,
                                                                         "disaggdeployments", dd.name)
            wait_for(lambda: not dd.pods(), 300, f"{dd.name}'s pods gone")

        with running_operator(operator_kubeconfig(cluster, api, cluster.dir / "operator.kubeconfig")):
            if {"node-direct", "node-aggregated"} & set(layouts):
                dd, url = serve("agg", prefill=0, decode=1, disaggregation="never")
                pod = realnode.ready_pods(api, NODE_NS, f"{LABEL_DEPLOYMENT}=agg,{LABEL_ROLE}=decode")[0]
                for layout, target in (("node-direct", f"http://{pod.status.pod_ip}:8000"), ("node-aggregated", url)):
                    if layout in layouts:
                        rows += measure(layout, target, model, python, work, args)
                        progress(table(rows))
                delete(dd)
            if "node-disaggregated" in layouts:
                dd, url = serve("pd")
                rows += measure("node-disaggregated", url, model, python, work, args)
                progress(table(rows))
                delete(dd)
    finally:
        cluster.down()
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--targets", type=targets, default="2000:200",
                   help="goodput targets, TTFT_MS:TPOT_MS pairs, comma-separated: each client runs once per pair")
    p.add_argument("--json", type=Path, help="also write the rows here")
    p.add_argument("--aiperf", action="store_true", help=f"also aiperf, from {AIPERF_ENV} when it is installed")
    p.add_argument("--guidellm", action="store_true", help=f"also guidellm, from {GUIDELLM_ENV} when it is installed")
    p.add_argument("--layouts", default=",".join(LOCAL_LAYOUTS),
                   help=f"comma-separated, of {', '.join(LOCAL_LAYOUTS + NODE_LAYOUTS)}")
    args = p.parse_args()
    unknown = set(args.layouts.split(",")) - set(LOCAL_LAYOUTS + NODE_LAYOUTS)
    if unknown:
        p.error(f"--layouts: unknown {', '.join(sorted(unknown))} (known: {', '.join(LOCAL_LAYOUTS + NODE_LAYOUTS)})")
    python = worker_python()
    model = str(ensure(python))
    layouts = args.layouts.split(",")
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="field-clients-") as tmp:
        work = Path(tmp)
        if {"direct", "aggregated"} & set(layouts):
            # one engine over both cores, as the reference of tests/test_router_pd.py runs it
            s = cpu_settings("decode", model, "0-1", kv_transfer=False)
            engine = worker("aggregated", s, python, work)
            port = free_port()
            config = {"model": "tiny", "tokenizer": model, "block_size": s.block_size, "max_model_len": s.max_model_len,
                      "port": port, "host": "127.0.0.1", "spec": {"disaggregation": "never"},
                      "decode": [{"url": engine.url}]}
            (work / "agg-router.json").write_text(json.dumps(config))
            front = router(work / "agg-router.json", port, work)
            try:
                engine.start().wait_ready(300)
                front.start().wait_ready()
                for layout, url in (("direct", engine.url), ("aggregated", front.url)):
                    if layout in layouts:
                        rows += measure(layout, url, model, python, work, args)
                        print(table(rows), flush=True)
            finally:
                stop_all([front, engine])
        if "disaggregated" in layouts:
            procs = pd_processes(model, free_port(), python, work)
            try:
                start_pd(procs)
                rows += measure("disaggregated", procs[2].url, model, python, work, args)
            finally:
                stop_all(procs)
        if set(NODE_LAYOUTS) & set(layouts):
            rows += on_real_node(layouts, model, python, work, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(f"\n{args.prompts} prompts x {args.input_len} tokens in, {args.output_len} out, concurrency "
          f"{args.concurrency}\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
