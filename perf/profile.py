"""``disagg profile``: measure a running worker (any OpenAI-compatible completions endpoint, e.g. vLLM)
and write the performance profile the planner plans with (a file, or a ConfigMap for ``profileRef``).

Prefill: ``batch`` prompts of ``tokens`` random token ids sent together with ``max_tokens=1``; the point's
seconds are the slowest time to first token (the batch finishes together). Random ids per request keep
the prefix cache out of it. Decode: ``concurrency`` streams of ``decode_tokens`` tokens after a
``context``-token prompt; the point's seconds are the mean inter-token latency, at the mean context, as
the engine measured it (vLLM's ``vllm:inter_token_latency_seconds``, from its engine core's timestamps,
read from ``/metrics`` before and after); from the client's chunk arrival times only where the server
exports no such histogram. The client's view misleads when the server's frontend falls behind its
engine: it sends the tokens in bursts, and a 5 ms decode step was measured as 12-21 us (a CPU vLLM
whose frontend shared a core with its engine, 2026-12-02).
With ``path_url`` (``--path-url``: the router in front of this worker and a decode worker), a lone
request of each prompt length is also sent through the whole P/D path, and its TTFT (router, prefill, KV
pull, decode's first step) kept as a hand-off point: what the path costs beyond this worker's prefill
(:class:`.model.Profile`). The path is measured right after the worker, on the same machine state.
With ``repeats`` > 1 each point is measured that many times and its median kept: on a shared or noisy
machine one sample can be off by a factor (seen on a busy 2-core CPU host: a 32-token prefill slower
than a 768-token one).
"""

from __future__ import annotations

import json
import random
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import yaml

from prometheus_client.parser import text_string_to_metric_families

from disagg.api.metrics import VLLM_ITL_SECONDS

from .model import PROFILE_KEY, Profile


def stream_tokens(url: str, model: str, prompt: list[int], max_tokens: int,
                  timeout: float) -> tuple[list[float], int]:
    """Send one streaming completion; return the arrival times of its token chunks (seconds since
    sending) and how many tokens came back: the usage vLLM reports at the end (a busy server puts
    several tokens in one chunk, so chunks undercount them), else the number of chunks."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{url.rstrip('/')}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start = time.perf_counter()
    times, tokens = [], None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter() - start
            event = json.loads(line[6:])
            if event.get("choices"):
                times.append(now)
            if event.get("usage"):
                tokens = event["usage"].get("completion_tokens")
    if not times:
        raise RuntimeError(f"{url}: no tokens streamed back")
    return times, int(tokens or len(times))


def mean_itl(times: list[float], tokens: int) -> float | None:
    """Mean time between tokens after the first (the first chunk carries the first token alone: it is
    sent as soon as prefill ends)."""
    return (times[-1] - times[0]) / (tokens - 1) if tokens > 1 and len(times) > 1 else None


def itl_totals(url: str) -> tuple[float, float] | None:
    """(sum, count) of the server's inter-token latency histogram (every series), or None where its
    /metrics has none."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/metrics", timeout=10) as r:
            text = r.read().decode()
    except (OSError, ValueError):
        return None
    totals = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (f"{VLLM_ITL_SECONDS}_sum", f"{VLLM_ITL_SECONDS}_count"):
                key = sample.name.rsplit("_", 1)[1]
                totals[key] = totals.get(key, 0.0) + sample.value
    return (totals["sum"], totals["count"]) if len(totals) == 2 else None


def measure(url: str, model: str, prompt_tokens: tuple[int, ...] = (128, 512, 2048, 8192),
            batches: tuple[int, ...] = (1, 4), concurrencies: tuple[int, ...] = (1, 4, 16, 32),
            context: int = 1024, decode_tokens: int = 64, vocab: int = 1000, seed: int = 0,
            timeout: float = 600.0, gpu: str = "unknown", tensor_parallel_size: int = 1,
            repeats: int = 1, path_url: str | None = None) -> Profile:
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(10, vocab) for _ in range(n)]

    def prefill_once(n: int, b: int) -> float:
        prompts = [prompt(n) for _ in range(b)]
        with ThreadPoolExecutor(b) as pool:
            return max(pool.map(lambda p: stream_tokens(url, model, p, 1, timeout)[0][0], prompts))

    def decode_once(c: int) -> float:
        prompts = [prompt(context) for _ in range(c)]
        before = itl_totals(url)
        with ThreadPoolExecutor(c) as pool:
            runs = list(pool.map(lambda p: stream_tokens(url, model, p, decode_tokens, timeout), prompts))
        after = itl_totals(url) if before else None
        if before and after and after[1] > before[1]:
            return (after[0] - before[0]) / (after[1] - before[1])
        return statistics.median([v for v in (mean_itl(*run) for run in runs) if v is not None])

    def path_once(n: int) -> float:
        # two tokens: the first has to come out of decode (with one, a router may answer from prefill)
        return stream_tokens(path_url, model, prompt(n), 2, timeout)[0][0]

    n_runs = max(repeats, 1)
    prefill = [{"tokens": n, "batch": b, "seconds": statistics.median(prefill_once(n, b) for _ in range(n_runs))}
               for n in prompt_tokens for b in batches]
    decode = [{"concurrency": c, "context": context + decode_tokens / 2,
               "seconds": statistics.median(decode_once(c) for _ in range(n_runs))} for c in concurrencies]
    handoff = [{"tokens": n, "seconds": statistics.median(path_once(n) for _ in range(n_runs))}
               for n in prompt_tokens] if path_url else []
    return Profile(model, gpu, tensor_parallel_size, tuple(prefill), tuple(decode), tuple(handoff))


def configmap(profile: Profile, name: str, namespace: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {PROFILE_KEY: yaml.safe_dump(profile.to_dict(), sort_keys=False)}}


def add_arguments(p: Any) -> None:
    p.add_argument("--url", required=True, help="the worker's OpenAI-compatible base URL (http://host:8000)")
    p.add_argument("--model", required=True, help="the model name the worker serves")
    p.add_argument("--gpu", default="unknown", help="GPU the worker runs on (a data/gpus.yaml name)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--prompt-tokens", default="128,512,2048,8192")
    p.add_argument("--batches", default="1,4")
    p.add_argument("--concurrency", default="1,4,16,32")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens of the decode runs")
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1000, help="random prompt token ids are drawn below this")
    p.add_argument("--repeats", type=int, default=1, help="measure each point this many times, keep the median")
    p.add_argument("--path-url", help="the router in front of this (prefill) worker and a decode worker: also "
                   "time a lone request of each --prompt-tokens through it (the P/D hand-off)")
    p.add_argument("--out", default="profile.yaml", help="profile file to write")
    p.add_argument("--configmap", help="write a ConfigMap manifest with this name instead (for profileRef)")
    p.add_argument("--namespace", help="namespace of the ConfigMap")


def run_cli(args: Any) -> int:
    ints = lambda s: tuple(int(x) for x in s.split(",") if x)  # noqa: E731
    profile = measure(args.url, args.model, ints(args.prompt_tokens), ints(args.batches), ints(args.concurrency),
                      args.context, args.decode_tokens, args.vocab, gpu=args.gpu,
                      tensor_parallel_size=args.tensor_parallel_size, repeats=args.repeats, path_url=args.path_url)
    doc = configmap(profile, args.configmap, args.namespace) if args.configmap else profile.to_dict()
    Path(args.out).write_text(yaml.safe_dump(doc, sort_keys=False))
    a, b, c = profile.prefill_coef
    print(f"wrote {args.out}: prefill = {a * 1000:.2f} ms + {profile.prefill_per_prompt * 1000:.2f} ms/prompt + "
          f"{b * 1e6:.3f} us/token + {c * 1e9:.4f} ns/token^2; "
          f"decode step = {profile.decode_coef[0] * 1000:.2f} ms + {profile.decode_coef[1] * 1000:.3f} ms/request + "
          f"{profile.decode_coef[2] * 1e6:.4f} us/context token")
    if profile.handoff_base is not None:
        print(f"P/D hand-off through {args.path_url} = {profile.handoff_base * 1000:.2f} ms (beyond prefill and "
              f"the first decode step; points {', '.join('%.0f' % (h['seconds'] * 1000) for h in profile.handoff)} ms)")
    return 0
