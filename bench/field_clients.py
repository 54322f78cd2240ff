"""Goodput as the field's own benchmark clients measure it, for three layouts of the tiny model on this
machine's two cores, each run with the same prompts, output lengths and targets:

* ``disaggregated``: what `disagg serve --local` runs: prefill vLLM (core 0), decode vLLM (core 1), NIXL
  between them, the router in front (every request prefilled remotely);
* ``aggregated``: one ordinary vLLM (no KV connector, cores 0-1) behind the router (no prefill workers: every
  request served whole by that engine, the router's own path and cost still in it);
* ``direct``: the same engine, the client straight to it: the baseline the ratios are against.

Clients: ``vllm bench serve`` (disagg.e2e.fieldclients: vLLM's own, run from the worker environment) and
aiperf (NVIDIA's) from its own environment in ~/.cache/disagg/aiperf-env when it is installed there
(``--aiperf``; bench only, it conflicts with the project's pins). Each run: ``--prompts`` random prompts of
``--input-len`` tokens, exactly ``--output-len`` tokens out (EOS ignored), ``--concurrency`` at a time,
goodput at ``--ttft-ms`` and ``--tpot-ms``. Tiny model, CPU engines: the figures rank the layouts' overheads
on this machine, not what GPUs serve.

    .venv/bin/python bench/field_clients.py [--prompts 32] [--input-len 256] [--output-len 32] [--concurrency 4]
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


def measure(layout: str, url: str, model: str, python: str, work: Path, args) -> list[dict]:
    out = [vllm_row(layout, vllm_bench_serve(python, url, "tiny", model, work / f"{layout}-vllm.json",
                                             num_prompts=args.prompts, input_len=args.input_len,
                                             output_len=args.output_len, max_concurrency=args.concurrency,
                                             ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, timeout=3600))]
    if args.aiperf:
        r = aiperf(url, model, work / f"{layout}-aiperf", args)
        if r is not None:
            out.append(aiperf_row(layout, r))
    return out


def table(rows: list[dict]) -> str:
    cols = ["layout", "client", "completed", "failed", "req_s", "goodput_req_s", "out_tok_s", "ttft_p50_ms",
            "ttft_p90_ms", "tpot_p50_ms", "itl_p90_ms", "goodput_vs_direct"]
    base = {r["client"]: r.get("goodput_req_s") for r in rows if r["layout"] == "direct"}
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layout']} | {r['client']} | error: {r['error'][:200]} |")
            continue
        b = base.get(r["client"])
        r = dict(r, goodput_vs_direct=(r["goodput_req_s"] / b) if b and r.get("goodput_req_s") is not None else None)
        lines.append("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c))
                                       for c in cols) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--ttft-ms", type=float, default=2000)
    p.add_argument("--tpot-ms", type=float, default=200)
    p.add_argument("--aiperf", action="store_true", help=f"also aiperf, from {AIPERF_ENV} when it is installed")
    p.add_argument("--layouts", default="direct,aggregated,disaggregated")
    args = p.parse_args()
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
    print(f"\n{args.prompts} prompts x {args.input_len} tokens in, {args.output_len} out, concurrency "
          f"{args.concurrency}, goodput at TTFT {args.ttft_ms:g} ms and TPOT {args.tpot_ms:g} ms\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
