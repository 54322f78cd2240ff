"""Prefix index and routing-decision throughput, against a plain-dict baseline run in the same process.

64 simulated workers store KV blocks of prompts that share system prompts (as vLLM's BlockStored
events would carry them: engine hashes, the parent's engine hash, token ids), then some are
removed, then routing decisions are made for new prompts. Reported: blocks/s stored (with the
router's own chained hashing, and without it), blocks/s removed, blocks/s matched, routing decision
p50/p99 over 64 candidates, each as a ratio to the baseline (a CPython dict keyed by chained block
hash with worker sets). Tokenization is not included (bench/router_overhead.py covers the HTTP path).

    .venv/bin/python bench/router_index.py [--blocks 131072]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from disagg.api.v1alpha1 import RouterSpec
from disagg.router import policies
from disagg.router.index import PrefixIndex, block_keys

BLOCK = 16
WORKERS = [f"w{i}" for i in range(64)]


def workload(total_blocks: int, seed: int = 0):
    """Prompts of 8 shared system-prompt blocks + 24 own blocks, each stored on one worker."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(8 * BLOCK)] for _ in range(100)]
    prompts = []
    n_prompts = total_blocks // 32
    for _ in range(n_prompts):
        toks = rng.choice(systems) + [rng.randrange(32000) for _ in range(24 * BLOCK)]
        prompts.append((rng.choice(WORKERS), toks))
    return prompts


def baseline(prompts, queries):
    """The reference: dict[hash] -> set(workers), hashes chained the same way, match by walking."""
    keyed = [(w, block_keys(t, BLOCK)) for w, t in prompts]
    d: dict[int, set[str]] = {}
    t0 = time.perf_counter()
    n = 0
    for w, keys in keyed:
        for k in keys:
            d.setdefault(k, set()).add(w)
        n += len(keys)
    store_rate = n / (time.perf_counter() - t0)
    lat, walked = [], 0
    t0 = time.perf_counter()
    for keys in queries:
        s = time.perf_counter()
        live = None
        for k in keys:
            holders = d.get(k)
            if not holders:
                break
            live = set(holders) if live is None else live & holders
            if not live:
                break
            walked += 1
        lat.append(time.perf_counter() - s)
    match_rate = walked / (time.perf_counter() - t0)
    return store_rate, match_rate, lat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=131072)
    args = ap.parse_args()
    prompts = workload(args.blocks)
    rng = random.Random(1)
    queries_tokens = [rng.choice(prompts)[1][: BLOCK * rng.randrange(8, 33)] for _ in range(5000)]
    queries = [block_keys(t, BLOCK) for t in queries_tokens]

    # ---- ours: ingest from vLLM-shaped events (router computes chained keys from token ids)
    idx = PrefixIndex()
    events = []
    for i, (w, toks) in enumerate(prompts):
        n = len(toks) // BLOCK
        engine = [(i << 8) | j for j in range(n)]
        # as vLLM publishes: one event for the first 8 blocks, one for the rest, chained by parent
        events.append((w, engine[:8], None, toks[: 8 * BLOCK]))
        events.append((w, engine[8:], engine[7], toks[8 * BLOCK:]))
    t0 = time.perf_counter()
    stored = sum(idx.stored(w, e, p, t, BLOCK) for w, e, p, t in events)
    ingest_hashing = stored / (time.perf_counter() - t0)

    idx2 = PrefixIndex()
    keyed = [(w, block_keys(t, BLOCK)) for w, t in prompts]
    t0 = time.perf_counter()
    for w, keys in keyed:
        idx2.add_keys(w, keys)
    ingest_keys = stored / (time.perf_counter() - t0)

    walked = 0
    t0 = time.perf_counter()
    for keys in queries:
        walked += max(idx.match(keys).values(), default=0)
    match_rate = walked / (time.perf_counter() - t0)

    policy = policies.create("kv-aware", RouterSpec())
    cands = [policies.Candidate(w, rng.randrange(4)) for w in WORKERS]
    lat = []
    for keys in queries:
        s = time.perf_counter()
        overlap = idx.match(keys)
        policy.choose(cands, policies.Request(blocks=len(keys), overlap=overlap))
        lat.append(time.perf_counter() - s)

    # removals: a third of the prompts' own blocks are evicted
    removals = [(w, [(i << 8) | j for j in range(8, 32)]) for i, (w, _) in enumerate(prompts) if i % 3 == 0]
    t0 = time.perf_counter()
    removed = 0
    for w, hashes in removals:
        idx.removed(w, hashes)
        removed += len(hashes)
    remove_rate = removed / (time.perf_counter() - t0)

    b_store, b_match, b_lat = baseline(prompts, queries)
    q = statistics.quantiles
    p50, p99 = q(lat, n=100)[49], q(lat, n=100)[98]
    b50, b99 = q(b_lat, n=100)[49], q(b_lat, n=100)[98]
    print(f"workers={len(WORKERS)} blocks indexed={stored} unique={idx2.blocks()} queries={len(queries)}")
    print(f"ingest (events, incl. chained hashing): {ingest_hashing / 1e6:.2f} M blocks/s")
    print(f"ingest (precomputed keys):              {ingest_keys / 1e6:.2f} M blocks/s   "
          f"baseline {b_store / 1e6:.2f} M/s   ratio {ingest_keys / b_store:.2f}")
    print(f"remove:                                 {remove_rate / 1e6:.2f} M blocks/s")
    print(f"match:                                  {match_rate / 1e6:.2f} M blocks/s   "
          f"baseline {b_match / 1e6:.2f} M/s   ratio {match_rate / b_match:.2f}")
    print(f"routing decision (match + kv-aware over 64): p50 {p50 * 1e6:.1f} us  p99 {p99 * 1e6:.1f} us   "
          f"baseline match-only p50 {b50 * 1e6:.1f} us p99 {b99 * 1e6:.1f} us   p99 ratio {p99 / b99:.2f}")


if __name__ == "__main__":
    main()
