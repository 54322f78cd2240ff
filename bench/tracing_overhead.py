"""What request tracing costs the router: CPU per streamed request with tracing off, on but sampling nothing
(ratio 0: the decision still goes to the workers in a traceparent), and on sampling everything (ratio 1: the
spans made and handed to the exporter; the SDK's in-memory one here, so the OTLP export thread, which runs
apart from the event loop, is not counted).

The router runs in this process (its app on a real port) in front of tests/sse_upstream.py (no delay between
tokens: the router's work, not the upstream's pacing, is what is measured), with the client in this process
too; the three configurations alternate round by round, so drift hits all alike. Reported: this process's
CPU time (router + client; the client's part is the same in each) per request, and each configuration's as a
ratio of tracing off.

    .venv/bin/python bench/tracing_overhead.py [--requests 200] [--rounds 5] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from disagg.router.app import ROUTER_KEY, make_app
from disagg.router.config import RouterConfig, WorkerEndpoint
from disagg.router.tracing import Tracing
from disagg.workers.envpath import worker_python
from disagg.workers.local import LocalProcess, free_port, stop_all
from disagg.workers.tinymodel import ensure

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {"off": None, "ratio 0": 0.0, "ratio 1": 1.0}


async def _round(tokenizer: str, upstream: str, ratio: float | None, requests: int, concurrency: int,
                 tokens: int) -> float:
    """CPU seconds of this process per request, for ``requests`` streamed completions."""
    cfg = RouterConfig(model="tiny", tokenizer=tokenizer, block_size=16, max_model_len=1024, host="127.0.0.1",
                       port=free_port(), spec={"disaggregation": "never"}, decode=[WorkerEndpoint(url=upstream)])
    app = make_app(cfg)
    exporter = InMemorySpanExporter()
    if ratio is not None:
        app[ROUTER_KEY].tracing = Tracing(None, ratio, exporter=exporter, batch=False)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, cfg.host, cfg.port).start()
    url = f"http://{cfg.host}:{cfg.port}/v1/completions"
    body = {"model": "tiny", "prompt": "hello " * 40, "max_tokens": tokens, "stream": True}
    try:
        async with aiohttp.ClientSession() as s:
            async def one() -> None:
                async with s.post(url, json=body) as r:
                    await r.read()

            await asyncio.gather(*(one() for _ in range(concurrency)))      # warm: connections, tokenizer
            exporter.clear()
            sem = asyncio.Semaphore(concurrency)

            async def bounded() -> None:
                async with sem:
                    await one()

            t0 = time.process_time()
            await asyncio.gather(*(bounded() for _ in range(requests)))
            cpu = time.process_time() - t0
            if ratio == 1.0:
                assert len(exporter.get_finished_spans()) >= 5 * requests, len(exporter.get_finished_spans())
            elif ratio is not None:
                assert not exporter.get_finished_spans()
            return cpu / requests
    finally:
        await runner.cleanup()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    args = ap.parse_args()
    tokenizer = str(ensure(worker_python()))
    logs = Path(tempfile.mkdtemp(prefix="tracing-overhead-"))
    port = free_port()
    up = LocalProcess("upstream", [sys.executable, str(REPO / "tests" / "sse_upstream.py"), str(port),
                                   str(args.tokens), "0"], {}, f"http://127.0.0.1:{port}", logs).start()
    try:
        up.wait_ready(timeout=30)
        per: dict[str, list[float]] = {name: [] for name in CONFIGS}
        for _ in range(args.rounds):
            for name, ratio in CONFIGS.items():
                per[name].append(asyncio.run(_round(tokenizer, up.url, ratio, args.requests, args.concurrency,
                                                    args.tokens)))
    finally:
        stop_all([up])
    base = statistics.median(per["off"])
    print(f"{args.rounds} rounds x {args.requests} streamed requests ({args.tokens} tokens, {args.concurrency} "
          f"at a time); CPU of router + client per request, median of rounds:")
    for name, values in per.items():
        med = statistics.median(values)
        print(f"  tracing {name:8s} {med * 1e6:8.0f} us  {med / base:5.3f}x off  "
              f"(rounds: {', '.join(f'{v * 1e6:.0f}' for v in values)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
