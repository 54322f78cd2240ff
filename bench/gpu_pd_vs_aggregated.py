"""GPU only (never run by tests): prefill + decode vLLM on one GPU with NIXL (CUDA buffers) behind
the router, vs a single aggregated vLLM server on the same GPU, at the same offered load.

Needs a Python with a CUDA build of vLLM and NIXL (--python), and a model directory (--model;
default: the generated tiny model, which exercises the path but says little about speed).
Reports TTFT and ITL p50/p90 of each setup and their ratios (disaggregated / aggregated).

    .venv/bin/python bench/gpu_pd_vs_aggregated.py --python /opt/vllm/bin/python --model /models/x
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from disagg.workers.local import free_port, router, worker
from disagg.workers.settings import WorkerSettings

BLOCK_SIZE = 16  # workers and router alike


def settings(role: str, model: str, kv_transfer: bool, util: float) -> WorkerSettings:
    return WorkerSettings(role=role, model=model, served_model_name="m", host="127.0.0.1", port=free_port(),
                          nixl_port=free_port(), kv_events_port=free_port(), kv_buffer_device="cuda",
                          kv_transfer=kv_transfer, max_model_len=4096, block_size=BLOCK_SIZE,
                          engine_args=["--gpu-memory-utilization", str(util)])


def one(url: str, prompt: str, tokens: int) -> tuple[float, list[float]]:
    body = {"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, stamps = time.perf_counter(), []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def load(url: str, n: int, concurrency: int, prompt_words: int, tokens: int):
    prompts = [f"request {i} " + "lorem ipsum " * prompt_words for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda p: one(url, p, tokens), prompts))
    ttft = sorted(t for t, _ in results)
    itl = sorted(x for _, xs in results for x in xs)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return {"ttft_p50": q(ttft, .5), "ttft_p90": q(ttft, .9), "itl_p50": q(itl, .5), "itl_p90": q(itl, .9)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", required=True, help="Python of an environment with CUDA vLLM + NIXL")
    ap.add_argument("--model")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-words", type=int, default=800)
    ap.add_argument("--tokens", type=int, default=128)
    args = ap.parse_args()
    if not args.model:
        from disagg.workers.tinymodel import ensure
        args.model = str(ensure(args.python))
    logs = Path(tempfile.mkdtemp(prefix="bench-gpu-"))
    results = {}

    agg = worker("aggregated", settings("decode", args.model, False, 0.85), args.python, logs).start()
    try:
        agg.wait_ready(600)
        results["aggregated"] = load(agg.url, args.requests, args.concurrency, args.prompt_words, args.tokens)
    finally:
        agg.stop()

    p, d = settings("prefill", args.model, True, 0.4), settings("decode", args.model, True, 0.4)
    port = free_port()
    (logs / "router.json").write_text(json.dumps({
        "model": "m", "tokenizer": args.model, "port": port, "host": "127.0.0.1", "max_model_len": 4096,
        "block_size": BLOCK_SIZE,
        "spec": {"disaggregation": "always"},
        "prefill": [{"url": f"http://127.0.0.1:{p.port}", "kv_events": f"tcp://127.0.0.1:{p.kv_events_port}"}],
        "decode": [{"url": f"http://127.0.0.1:{d.port}", "kv_events": f"tcp://127.0.0.1:{d.kv_events_port}"}]}))
    procs = [worker("prefill", p, args.python, logs), worker("decode", d, args.python, logs),
             router(logs / "router.json", port, logs)]
    try:
        for x in procs:
            x.start()
        for x in procs:
            x.wait_ready(600)
        results["disaggregated"] = load(procs[2].url, args.requests, args.concurrency, args.prompt_words,
                                        args.tokens)
    finally:
        for x in reversed(procs):
            x.stop()
    for name, r in results.items():
        print(name, " ".join(f"{k}={v * 1000:.1f}ms" for k, v in r.items()))
    a, b = results["aggregated"], results["disaggregated"]
    print("ratios disaggregated/aggregated:", " ".join(f"{k}={b[k] / a[k]:.3f}" for k in a))


if __name__ == "__main__":
    main()
