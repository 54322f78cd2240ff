"""KV-aware vs round-robin routing on real vLLM: prefill tokens computed and TTFT.

Two vLLM workers (CPU build, tiny model, prefix caching on, one core each) behind the router with
local prefill (disaggregation never). The workload: G groups of requests sharing a long prompt
prefix, shuffled. Each policy gets its own fresh prefixes (same sizes), so neither benefits from the
other's cache. Reported per policy: prefill tokens the workers computed (vLLM's
prefix_cache_queries - prefix_cache_hits) and TTFT p50, as ratios to round-robin.

    .venv/bin/python bench/router_kv_vllm.py [--groups 6] [--per-group 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from disagg.api import metrics as m
from disagg.workers.envpath import worker_python
from disagg.workers.local import cpu_settings, free_port, metric_sum, router, scrape, worker
from disagg.workers.tinymodel import ensure

WORDS = "alpha beta gamma delta parser token value buffer stream block cache route prefill decode".split()


def ttft(url: str, prompt: str) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {") and first is None:
                first = time.perf_counter()
    return first - start


def computed(workers) -> float:
    total = 0.0
    for w in workers:
        s = scrape(w.url)
        total += metric_sum(s, m.VLLM_PREFIX_CACHE_QUERIES + "_total") - metric_sum(
            s, m.VLLM_PREFIX_CACHE_HITS + "_total")
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=2)
    args = ap.parse_args()
    python = worker_python()
    model = str(ensure(python))
    logs = Path(tempfile.mkdtemp(prefix="bench-kv-"))
    workers = [worker(f"w{i}", cpu_settings("decode", model, str(i), kv_transfer=False), python, logs)
               for i in range(2)]
    for w in workers:
        w.start()
    results = {}
    try:
        for w in workers:
            w.wait_ready()
        for seed, policy in ((10, "round-robin"), (20, "kv-aware")):
            port = free_port()
            cfg = {"model": "tiny", "tokenizer": model, "block_size": 32, "max_model_len": 1024, "port": port,
                   "host": "127.0.0.1", "spec": {"policy": policy, "disaggregation": "never"},
                   "decode": [{"url": w.url, "kv_events": f"tcp://127.0.0.1:{w.env['DISAGG_KV_EVENTS_PORT']}"}
                              for w in workers]}
            (logs / f"{policy}.json").write_text(json.dumps(cfg))
            r = router(logs / f"{policy}.json", port, logs).start()
            try:
                r.wait_ready()
                rng = random.Random(seed)
                prefixes = [" ".join(rng.choice(WORDS) for _ in range(120)) for _ in range(args.groups)]
                prompts = [f"{p} question {i}" for p in prefixes for i in range(args.per_group)]
                rng.shuffle(prompts)
                before = computed(workers)
                with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                    ttfts = list(pool.map(lambda p: ttft(r.url, p), prompts))
                results[policy] = (computed(workers) - before, statistics.median(ttfts))
            finally:
                r.stop()
    finally:
        for w in workers:
            w.stop()
    rr_tokens, rr_ttft = results["round-robin"]
    for policy, (tokens, t) in results.items():
        print(f"{policy:12s} prefill tokens computed {int(tokens):6d} (ratio {tokens / rr_tokens:.3f})   "
              f"TTFT p50 {t * 1000:.1f} ms (ratio {t / rr_ttft:.3f})")


if __name__ == "__main__":
    main()
