"""Router overhead: TTFT and streaming tokens/s through the router vs straight to the same vLLM server.

One vLLM worker (CPU build, the tiny model, no NIXL) and the router in front of it (disaggregation
never, so both paths run the same engine work). Requests alternate direct / routed, so drift hits
both alike. Reported: TTFT p50 of each and the added TTFT, and routed tokens/s as a ratio of direct.
By default vLLM gets core 0 and the router and this client core 1, as in a cluster where the router
runs on its own (CPU) node: vLLM's OpenMP threads spin, and a router sharing their core measures the
scheduler, not the router. `--shared` puts all three on both cores (the old, noisier setup).

    .venv/bin/python bench/router_overhead.py [--requests 40] [--tokens 64] [--engine vllm|paced]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from disagg.workers.envpath import worker_python
from disagg.workers.local import LocalProcess, cpu_settings, free_port, router, worker
from disagg.workers.tinymodel import ensure


def stream(url: str, prompt: str, tokens: int) -> tuple[float, float]:
    """(TTFT, tokens/s after the first) of one streamed completion, read with aiohttp as an async
    OpenAI client would (urllib's chunked reader adds its own delay before the first line)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}

    async def run() -> tuple[float, float]:
        async with aiohttp.ClientSession() as session:
            start = time.perf_counter()
            first, n = None, 0
            async with session.post(f"{url}/v1/completions", json=body) as r:
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        first = first or time.perf_counter()
                        n += 1
            end = time.perf_counter()
            return first - start, (n - 1) / max(end - first, 1e-9)

    return asyncio.run(run())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--shared", action="store_true", help="no pinning: vLLM, router and client share all cores")
    ap.add_argument("--engine", choices=["vllm", "paced"], default="vllm",
                    help="paced: an OpenAI-shaped server emitting one token every --itl-ms (tests/sse_upstream.py), "
                         "so the router's own cost is not lost in CPU vLLM's bursty streaming")
    ap.add_argument("--itl-ms", type=float, default=10.0)
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    pinned = not args.shared and len(cores) >= 2
    python = worker_python()
    model = str(ensure(python))
    logs = Path(tempfile.mkdtemp(prefix="bench-overhead-"))
    engine_cores = str(cores[0]) if pinned else f"{cores[0]}-{cores[-1]}"
    if args.engine == "vllm":
        w = worker("vllm", cpu_settings("decode", model, engine_cores, kv_transfer=False), python, logs)
    else:
        up = free_port()
        paced = Path(__file__).resolve().parent.parent / "tests" / "sse_upstream.py"
        w = LocalProcess("paced", [sys.executable, str(paced), str(up), str(args.tokens), str(args.itl_ms / 1000)],
                         {}, f"http://127.0.0.1:{up}", logs)
    port = free_port()
    (logs / "router.json").write_text(json.dumps({
        "model": "tiny", "tokenizer": model, "block_size": 32, "max_model_len": 1024, "port": port,
        "host": "127.0.0.1", "spec": {"disaggregation": "never"}, "decode": [{"url": w.url}]}))
    r = router(logs / "router.json", port, logs)
    w.start()                               # before this process pins itself: vLLM's own processes stay free
    if pinned:
        rest = ",".join(str(c) for c in cores[1:])
        r.argv = ["taskset", "-c", rest, *r.argv]
        os.sched_setaffinity(0, set(cores[1:]))
    r.start()
    try:
        w.wait_ready(), r.wait_ready()
        for url in (w.url, r.url):           # warm both paths
            stream(url, "warm up", 8)
        direct, routed = [], []
        for i in range(args.requests):
            prompt = f"request {i}: the parser returns the value of"
            direct.append(stream(w.url, prompt + " (d)", args.tokens))
            routed.append(stream(r.url, prompt + " (r)", args.tokens))
        d_ttft = statistics.median(t for t, _ in direct)
        r_ttft = statistics.median(t for t, _ in routed)
        d_rate = statistics.median(x for _, x in direct)
        r_rate = statistics.median(x for _, x in routed)
        print(f"{args.requests} requests each path, {args.tokens} tokens each, engine {args.engine}; "
              f"{'router and client on cores %s' % cores[1:] if pinned else 'all on all cores'}")
        print(f"TTFT p50: direct {d_ttft * 1000:.2f} ms, routed {r_ttft * 1000:.2f} ms, "
              f"added {(r_ttft - d_ttft) * 1000:.2f} ms (ratio {r_ttft / d_ttft:.3f})")
        print(f"stream tokens/s p50: direct {d_rate:.1f}, routed {r_rate:.1f}, ratio {r_rate / d_rate:.3f}")
    finally:
        r.stop()
        w.stop()


if __name__ == "__main__":
    main()
