"""KV-aware vs round-robin vs least-loaded on a scaled-down replay of the Mooncake conversation trace.

The trace (../shared/traces/mooncake_conversation.jsonl, beside the repository) gives each request
its arrival time and one anonymised id per 512-token prefix block. Scaled down: every block id
becomes BLOCK generated token ids (seeded by the id), so equal ids give equal tokens, and the
router's own chained keys see exactly the trace's prefix sharing. Simulated workers hold an LRU
cache of a fixed number of blocks; a request keeps its worker busy for a time proportional to its
uncached blocks plus its output length (time compressed). Every store and eviction goes through the
router's real PrefixIndex as vLLM's events would, and the router's real policies pick the worker.
Reported per policy: prefix hit ratio (cached / prompt blocks), the ratio of prefill blocks computed
to round-robin's (the baseline), and the worst load spread seen.

    .venv/bin/python bench/router_trace.py [--requests 4000] [--workers 8] [--cache-blocks 3000]
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
from collections import OrderedDict
from pathlib import Path

from disagg.api.v1alpha1 import RouterSpec
from disagg.router import policies
from disagg.router.index import PrefixIndex, block_keys

BLOCK = 4
TRACE = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / "mooncake_conversation.jsonl"


def tokens_for(ids: list[int]) -> list[int]:
    out: list[int] = []
    for i in ids:
        rng = random.Random(i)
        out += [rng.randrange(32000) for _ in range(BLOCK)]
    return out


def simulate(policy_name: str, requests, n_workers: int, cache_blocks: int, time_scale: float):
    index = PrefixIndex()
    policy = policies.create(policy_name, RouterSpec())
    names = [f"w{i}" for i in range(n_workers)]
    caches = {w: OrderedDict() for w in names}     # key -> None, LRU order
    active = {w: 0 for w in names}
    done: list[tuple[float, str]] = []              # (finish time, worker)
    prompt_blocks = cached_blocks = 0
    worst_spread = 0
    for ts, keys, output_len in requests:
        while done and done[0][0] <= ts:
            _, w = heapq.heappop(done)
            active[w] -= 1
        overlap = index.match(keys) if policy_name == "kv-aware" else {}
        d = policy.choose([policies.Candidate(w, active[w]) for w in names],
                          policies.Request(blocks=len(keys), overlap=overlap))
        w = d.worker
        hit = index.match(keys).get(w, 0)
        prompt_blocks += len(keys)
        cached_blocks += hit
        # serve: store the prompt's blocks (LRU), evicting the oldest as vLLM would
        cache = caches[w]
        new = []
        for k in keys:
            if k in cache:
                cache.move_to_end(k)
            else:
                cache[k] = None
                new.append(k)
        index.add_keys(w, new)
        evicted = []
        while len(cache) > cache_blocks:
            k, _ = cache.popitem(last=False)
            evicted.append(k)
        index.removed(w, evicted)
        active[w] += 1
        worst_spread = max(worst_spread, max(active.values()) - min(active.values()))
        busy = ((len(keys) - hit) * 1.0 + output_len * 0.05) * time_scale
        heapq.heappush(done, (ts + busy, w))
    return prompt_blocks, cached_blocks, worst_spread


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--cache-blocks", type=int, default=3000)
    ap.add_argument("--time-scale", type=float, default=2.0, help="ms of service per uncached block")
    args = ap.parse_args()
    requests = []
    with TRACE.open() as f:
        for line in f:
            r = json.loads(line)
            requests.append((float(r["timestamp"]), block_keys(tokens_for(r["hash_ids"]), BLOCK),
                             r["output_length"]))
            if len(requests) >= args.requests:
                break
    print(f"trace: {TRACE.name}, first {len(requests)} requests, {args.workers} workers, "
          f"{args.cache_blocks} cached blocks each")
    results = {name: simulate(name, requests, args.workers, args.cache_blocks, args.time_scale)
               for name in ("round-robin", "least-loaded", "kv-aware")}
    base_prompt, base_cached, _ = results["round-robin"]
    for name, (prompt, cached, spread) in results.items():
        print(f"{name:13s} prefix hit ratio {cached / prompt:.3f}   prefill blocks computed vs round-robin "
              f"{(prompt - cached) / (base_prompt - base_cached):.3f}   worst load spread {spread}")


if __name__ == "__main__":
    main()
