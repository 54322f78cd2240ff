"""This router side by side with vLLM's own router (`vllm-router`, Rust) and with going direct.

Two paced OpenAI-shaped upstreams (tests/sse_upstream.py: N tokens, one every --itl-ms), or with
`--engine vllm` two real CPU vLLM workers (the tiny test model, one core each, at the concurrency they
can take: levels 1 and 8 by default), one client process, streaming completions. At each concurrency level the targets run one after another
(direct, this router, vllm-router), so drift hits all alike:

- direct: the client alternates between the two upstreams itself;
- this router: round-robin, disaggregation never, both upstreams as decode workers;
- vllm-router: `--worker-urls` both upstreams, `--policy round_robin`;
- envoy-picker (Envoy + picker): the same router configuration in picker mode (`--mode picker`: Envoy's
  ext_proc over gRPC, as a Gateway API Inference Extension endpoint picker) and a release Envoy in front of
  it (disagg.e2e.gateway: static config, body BUFFERED, FailClose, both upstreams as the pool); the client
  streams through Envoy's port, Envoy asks the picker for each request's decode and streams the decode's
  answer back itself (no token passes through Python). Envoy runs `--envoy-concurrency` worker threads:
  default 1 on a machine of 2 cores or fewer, else 2 (on 2 cores shared with other work, two A/B pairs at
  256/1,000/2,000 streams: tokens/s and TTFT within the run-to-run noise either way, but with 2 the picker
  fell further behind, 504/503s at 1,000 streams too, with 1 only at 2,000: one more busy thread competing
  with the picker, the upstreams and the client). Envoy waits `--picker-message-timeout` for each of the
  picker's answers (default the gateway configuration's 30 s; then it answers 504 itself, counted as errors);
  when a level has errors its ext_proc counters are printed.

Reported per level and target: TTFT p50/p99, tokens/s (all streams' tokens over the level's wall
time), errors (HTTP errors, exceptions, streams without every token and [DONE]), and the router's
CPU seconds per 1,000 requests (its process's user+system time, all threads; envoy-picker: Envoy's
process and the picker's together). Ratios against vllm-router in the same run: added TTFT p50 (over
direct) and tokens/s. For envoy-picker also the picker's decision p99 at that level, from the router's
histogram `disagg_router_picker_decision_seconds{kind="plan"}` (body to destination: parse, plan; not
the gRPC stream around it): its buckets are coarse (10 us up, each 2-2.5x the last), so the p99 is given as
the bucket that holds it, a bound `lo < p99 <= hi`, from the histogram's counts over that level alone.
Everything shares this machine's cores: a router that burns more CPU slows the upstreams and the
client too, which is how it would crowd a node.

Needs the bench extra (`make bench-deps`).

    .venv/bin/python bench/router_vs_vllm_router.py [--levels 1,64,256,1000,2000] [--tokens 64]
    .venv/bin/python bench/router_vs_vllm_router.py --engine vllm [--levels 1,8] [--tokens 32]
    .venv/bin/python bench/router_vs_vllm_router.py --levels 1 --interleave [--requests 1000]  # one-stream TTFT
    .venv/bin/python bench/router_vs_vllm_router.py --targets direct,router,envoy-picker,vllm-router \
        [--envoy-concurrency 1]   # Envoy + the router as its endpoint picker
    # A/B of two versions of the router, taking turns (the order alternating level by level):
    git archive <commit> router | tar -x -C "$DIR" && mv "$DIR/router" "$DIR/router_base"
    .venv/bin/python bench/router_vs_vllm_router.py --baseline "$DIR/router_base" --targets router,router-base \
        --levels 1000,1000,1000,1000 --alternate
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from disagg.api.metrics import ROUTER_PICKER_DECISION_SECONDS
from disagg.workers.envpath import worker_python
from disagg.workers.local import LocalProcess, cpu_settings, free_port, router, scrape, stop_all, worker
from disagg.workers.tinymodel import ensure

PACED = Path(__file__).resolve().parent.parent / "tests" / "sse_upstream.py"
TICK = os.sysconf("SC_CLK_TCK")
PICKER = "envoy-picker"
LE = re.compile(r'le="([^"]+)"')


def open_files(streams: int) -> None:
    """Sockets for ``streams`` at once in the client, and in the routers, Envoy and the upstreams (all
    started from here, inheriting the limit): a socket each way per stream, and some to spare."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 4 * streams + 1024
    if soft != resource.RLIM_INFINITY and soft < want:
        if hard != resource.RLIM_INFINITY and hard < want:
            sys.exit(f"open files: hard limit {hard} < {want} for {streams} streams (ulimit -Hn)")
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def decision_buckets(url: str) -> dict[float, float]:
    """The picker's cumulative decision histogram (kind="plan"): {upper bound: count}."""
    out = {}
    for k, v in scrape(url).items():
        if k.startswith(f"{ROUTER_PICKER_DECISION_SECONDS}_bucket{{") and 'kind="plan"' in k:
            out[float(LE.search(k).group(1))] = v
    return out


def quantile_bound(before: dict[float, float], after: dict[float, float], q: float) -> tuple[float, float, int]:
    """(lo, hi, n): the ``q`` quantile of the decisions between two scrapes lies in (lo, hi] (the bucket
    holding it; hi is inf above the last bound), n decisions."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    n = int(counts[-1]) if counts else 0
    if n == 0:
        return float("nan"), float("nan"), 0
    rank = math.ceil(q * n)
    lo = 0.0
    for b, c in zip(bounds, counts):
        if c >= rank:
            return lo, b, n
        lo = b
    return lo, float("inf"), n


def fmt_bound(lo: float, hi: float) -> str:
    if math.isnan(hi):
        return "-"
    if math.isinf(hi):
        return f"> {lo * 1e3:g} ms"
    return f"{lo * 1e3:g} .. {hi * 1e3:g} ms"


def family(pid: int) -> list[int]:
    """A process and its children."""
    return [pid, *(int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())]


def cpu_seconds(pid: int) -> float:
    """User + system time of a process, all its threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    requests: int = 0
    errors: int = 0
    first_error: str = ""
    wall: float = 0.0
    cpu: float | None = None
    decision_p99: tuple[float, float, int] | None = None   # envoy-picker: the picker's (lo, hi], n decisions
    envoy_cpu: float | None = None                         # envoy-picker: Envoy's share of cpu

    def p(self, q: float) -> float:
        if not self.ttft:
            return float("nan")
        s = sorted(self.ttft)
        return s[min(len(s) - 1, math.ceil(q * len(s)) - 1)]


async def one(session: aiohttp.ClientSession, url: str, i: int, tokens: int, res: Result) -> None:
    # ignore_eos: a real engine generates every token asked for (the paced upstream always does); the
    # usage chunk says how many, since a real engine's chunk may carry several tokens
    body = {"model": "tiny", "prompt": f"stream {i}: the parser returns the value of", "max_tokens": tokens,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    start = time.perf_counter()
    first, n, done, counted = None, 0, False, None
    try:
        async with session.post(f"{url}/v1/completions", json=body) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            async for line in r.content:
                if line.startswith(b"data: {"):
                    if b'"error"' in line:
                        raise RuntimeError(line[:200].decode())
                    if b'"choices": []' in line or b'"choices":[]' in line:
                        counted = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens")
                        continue
                    first = first or time.perf_counter()
                    n += 1
                elif line.startswith(b"data: [DONE]"):
                    done = True
        n = n if counted is None else counted
        if n != tokens or not done:
            raise RuntimeError(f"{n} of {tokens} tokens, [DONE] {'seen' if done else 'missing'}")
        res.ttft.append(first - start)
    except Exception as e:  # noqa: BLE001 - every failure is an error of the run, counted
        res.errors += 1
        res.first_error = res.first_error or f"{type(e).__name__}: {e}"
    res.tokens += n
    res.requests += 1


async def level(urls: list[str], streams: int, rounds: int, tokens: int, pids: list[int]) -> Result:
    """``streams`` concurrent clients, each running ``rounds`` requests back to back."""
    res = Result()
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=300)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        async def client(c: int) -> None:
            for r in range(rounds):
                i = c * rounds + r
                await one(session, urls[i % len(urls)], i, tokens, res)

        cpu0 = sum(cpu_seconds(p) for p in pids)
        t0 = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(streams)))
        res.wall = time.perf_counter() - t0
        if pids:
            res.cpu = sum(cpu_seconds(p) for p in pids) - cpu0
    return res


async def interleaved(urls: dict[str, list[str]], rounds: int, tokens: int,
                      pids: dict[str, list[int]]) -> dict[str, Result]:
    """One stream at a time, the targets taking turns request by request (``rounds`` each): at one stream
    the added TTFT is a millisecond or two, less than a shared machine drifts between two targets' runs."""
    res = {t: Result() for t in urls}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        cpu0 = {t: sum(cpu_seconds(p) for p in pids[t]) for t in urls}
        t0 = time.perf_counter()
        for i in range(rounds):
            for t, u in urls.items():
                await one(session, u[i % len(u)], i, tokens, res[t])
        wall = time.perf_counter() - t0
        for t, r in res.items():
            r.wall = wall / len(urls)       # each target's share of the run: tokens/s comparable
            if pids[t]:
                r.cpu = sum(cpu_seconds(p) for p in pids[t]) - cpu0[t]
    return res


def vllm_router(urls: list[str], port: int, logs: Path) -> LocalProcess:
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if exe is None:
        sys.exit("vllm-router is not installed: make bench-deps")
    # its own admission limit far above the levels (default 32768), so both routers take every stream
    return LocalProcess("vllm-router", [exe, "--worker-urls", *urls, "--policy", "round_robin",
                                        "--host", "127.0.0.1", "--port", str(port),
                                        "--prometheus-port", str(free_port()), "--log-level", "warning"],
                        {}, f"http://127.0.0.1:{port}", logs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["paced", "vllm"], default="paced",
                    help="the upstreams: two paced SSE servers, or two real CPU vLLM workers (one core each)")
    ap.add_argument("--levels", help="default 1,64,256,1000,2000 (paced), 1,8 (vllm)")
    ap.add_argument("--tokens", type=int, help="default 64 (paced), 32 (vllm)")
    ap.add_argument("--itl-ms", type=float, default=10.0)
    ap.add_argument("--requests", type=int, default=30,
                    help="at least this many requests per target and level (more when the level is wider)")
    ap.add_argument("--targets", default="direct,router,vllm-router",
                    help="any of direct, router, router-asyncio (the router on asyncio's loop), router-xN (N router "
                         "processes on one port, --processes), router-base (--baseline), envoy-picker (Envoy "
                         "in front of the router in picker mode), vllm-router")
    ap.add_argument("--baseline", help="a copy of another version's router/ package, in a folder named as the "
                                       "package it is run as (e.g. router_base): the router-base target")
    ap.add_argument("--alternate", action="store_true",
                    help="the targets' order reversed every other level (an A/B taking turns)")
    ap.add_argument("--processes", type=int, default=2, help="N of the router-xN target")
    ap.add_argument("--interleave", action="store_true",
                    help="at one stream, the targets take turns request by request instead of one after another")
    ap.add_argument("--envoy-concurrency", type=int, default=1 if (os.cpu_count() or 1) <= 2 else 2,
                    help="Envoy's worker threads (envoy-picker): default 1 on 2 cores or fewer, else 2")
    ap.add_argument("--picker-message-timeout", type=float,
                    help="seconds Envoy waits for each of the picker's answers before it answers 504 itself "
                         "(ext_proc message_timeout; default the gateway configuration's, 30)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--priority", type=int, default=-10,
                    help="nice value of this process and all it starts (as root): on a machine shared with "
                         "other work, the three targets then compete with each other, not with it")
    args = ap.parse_args()
    if os.geteuid() == 0 and args.priority:
        os.setpriority(os.PRIO_PROCESS, 0, args.priority)     # inherited by every process started below
    vllm = args.engine == "vllm"
    args.levels = args.levels or ("1,8" if vllm else "1,64,256,1000,2000")
    args.tokens = args.tokens or (32 if vllm else 64)
    levels = [int(x) for x in args.levels.split(",")]
    targets = args.targets.split(",")
    open_files(max(levels))
    logs = Path(tempfile.mkdtemp(prefix="bench-vs-vllm-router-"))
    python = worker_python()
    model = str(ensure(python))
    ups, max_model_len = [], 4096
    for k in range(2):
        if vllm:    # aggregated (no NIXL), one core each, as the tests' workers
            settings = cpu_settings("decode", model, str(k), kv_transfer=False)
            max_model_len = settings.max_model_len
            ups.append(worker(f"vllm{k}", settings, python, logs))
            continue
        port = free_port()
        ups.append(LocalProcess(f"paced{k}", [sys.executable, str(PACED), str(port), str(args.tokens),
                                               str(args.itl_ms / 1000)], {}, f"http://127.0.0.1:{port}", logs))
    port = free_port()
    (logs / "router.json").write_text(json.dumps({
        "model": "tiny", "tokenizer": model, "block_size": 32, "max_model_len": max_model_len, "port": port,
        "host": "127.0.0.1", "spec": {"disaggregation": "never", "policy": "round-robin"},
        "decode": [{"url": u.url} for u in ups]}))
    procs = {"router": [router(logs / "router.json", port, logs)],
             "vllm-router": [vllm_router([u.url for u in ups], free_port(), logs)]}
    base = procs["router"][0].argv
    # the same router on Python's own event loop: what uvloop is worth, measured in the same run
    port2 = free_port()
    procs["router-asyncio"] = [LocalProcess("router-asyncio", [*base, "--port", str(port2), "--event-loop", "asyncio"],
                                            {}, f"http://127.0.0.1:{port2}", logs)]
    # N router processes on one port (spec.router.processes: a parent starting N, SO_REUSEPORT, the kernel
    # spreads connections): what more event loops are worth; CPU is all of them together
    port3 = free_port()
    procs[f"router-x{args.processes}"] = [
        LocalProcess(f"router-x{args.processes}", [*base, "--port", str(port3), "--processes", str(args.processes)],
                     {}, f"http://127.0.0.1:{port3}", logs)]
    if args.baseline:   # python -m router_base: its modules import each other relatively, disagg.api as installed
        base_dir = Path(args.baseline).resolve()
        port4 = free_port()
        procs["router-base"] = [LocalProcess(
            "router-base", [sys.executable, "-P", "-m", base_dir.name, *base[4:], "--port", str(port4)],
            {"PYTHONPATH": str(base_dir.parent)}, f"http://127.0.0.1:{port4}", logs)]
    # the same router as the endpoint picker of an Envoy (started below, once the picker answers)
    port5, grpc_port = free_port(), free_port()
    procs[PICKER] = [LocalProcess(PICKER, [*base, "--port", str(port5), "--mode", "picker",
                                           "--grpc-port", str(grpc_port)], {}, f"http://127.0.0.1:{port5}", logs)]
    procs = {t: ps for t, ps in procs.items() if t in targets}
    everything = ups + [p for ps in procs.values() for p in ps]
    envoy = None
    for p in everything:
        p.start()
    try:
        for p in everything:
            p.wait_ready(timeout=600 if vllm else 120)
        urls = {"direct": [u.url for u in ups], **{t: [ps[0].url] for t, ps in procs.items()}}
        # a router started with --processes is a parent and its N children: all of them counted
        pids = {"direct": [], **{t: [q for p in ps for q in family(p.proc.pid)] for t, ps in procs.items()}}
        if PICKER in procs:
            from disagg.e2e.gateway import BUFFERED, FAIL_CLOSE, Envoy
            envoy = Envoy(logs / "envoy", port=free_port(), admin_port=free_port(), picker=f"127.0.0.1:{grpc_port}",
                          pool=[u.url.removeprefix("http://") for u in ups], failure_mode=FAIL_CLOSE,
                          body_mode=BUFFERED, concurrency=args.envoy_concurrency,
                          **({"message_timeout_s": args.picker_message_timeout}
                             if args.picker_message_timeout else {}))
            envoy.start()     # (assigned first: stopped in finally whatever start does)
            urls[PICKER] = [envoy.url]
            pids[PICKER] = [*pids[PICKER], envoy.process.proc.pid]    # Envoy's process (all its threads) and the picker's
        picker_url = procs[PICKER][0].url if PICKER in procs else None
        for t in targets:   # warm every path (connections, the tokenizer, vllm-router's pools)
            asyncio.run(level(urls[t], 8, 1, args.tokens, []))
        table: dict[int, dict[str, Result]] = {}
        for k, n in enumerate(levels):
            rounds = max(1, math.ceil(args.requests / n)) if n < 256 else 2
            table[n] = {}
            if n == 1 and args.interleave:
                before = decision_buckets(picker_url) if picker_url else {}
                table[n] = asyncio.run(interleaved({t: urls[t] for t in targets}, rounds, args.tokens, pids))
                if picker_url:
                    table[n][PICKER].decision_p99 = quantile_bound(before, decision_buckets(picker_url), .99)
            for t in (targets[::-1] if args.alternate and k % 2 else targets):
                if t not in table[n]:
                    before = decision_buckets(picker_url) if t == PICKER else {}
                    stats0 = envoy.stats() if t == PICKER else {}
                    envoy_cpu0 = cpu_seconds(envoy.process.proc.pid) if t == PICKER else 0.0
                    table[n][t] = asyncio.run(level(urls[t], n, rounds, args.tokens, pids[t]))
                    if t == PICKER:
                        table[n][t].envoy_cpu = cpu_seconds(envoy.process.proc.pid) - envoy_cpu0
                        table[n][t].decision_p99 = quantile_bound(before, decision_buckets(picker_url), .99)
                        if table[n][t].errors:   # what Envoy says went wrong: ext_proc's and the clusters' counters
                            grew = {k: v - stats0.get(k, 0) for k, v in envoy.stats().items()
                                    if v != stats0.get(k, 0) and any(w in k for w in (
                                        "ext_proc", "timeout", "fail", "overflow", "reset", "5xx", "503"))}
                            print(f"  envoy counters that grew: {grew}", file=sys.stderr)
                r = table[n][t]
                print(f"{n:>5} streams {t:>12}: TTFT p50 {r.p(.5) * 1e3:7.1f} ms p99 {r.p(.99) * 1e3:7.1f} ms, "
                      f"{r.tokens / r.wall:8.0f} tok/s, {r.errors} errors"
                      + (f" ({r.first_error})" if r.errors else "")
                      + (f", CPU {r.cpu / r.requests * 1000:.2f} s/1k req" if r.cpu is not None else "")
                      + (f" (Envoy {r.envoy_cpu / r.requests * 1000:.2f}, picker "
                         f"{(r.cpu - r.envoy_cpu) / r.requests * 1000:.2f})" if r.envoy_cpu is not None else "")
                      + (f", picker decision p99 {fmt_bound(*r.decision_p99[:2])} ({r.decision_p99[2]} decisions)"
                         if r.decision_p99 else ""),
                      file=sys.stderr, flush=True)
        print_table(table, targets, args)
        if args.json:
            Path(args.json).write_text(json.dumps({n: {t: {
                "ttft_p50": r.p(.5), "ttft_p99": r.p(.99), "tokens_per_s": r.tokens / r.wall,
                "errors": r.errors, "requests": r.requests,
                "cpu_s_per_1k": r.cpu / r.requests * 1000 if r.cpu is not None else None,
                **({"picker_decision_p99_bounds_s": [r.decision_p99[0], r.decision_p99[1]],
                    "picker_decisions": r.decision_p99[2]} if r.decision_p99 else {})}
                for t, r in row.items()} for n, row in table.items()}, indent=1))
    finally:
        if envoy is not None:
            envoy.stop()
        stop_all(everything)


def print_table(table: dict[int, dict[str, Result]], targets: list[str], args) -> None:
    upstreams = ("two CPU vLLM workers (tiny model, one core each)" if args.engine == "vllm"
                 else f"one every {args.itl_ms:g} ms, two paced upstreams")
    print(f"\n{args.tokens} tokens a stream, {upstreams}, one client process; {os.cpu_count()} cores shared "
          f"by all (nice {os.getpriority(os.PRIO_PROCESS, 0)})"
          + (f"; Envoy --concurrency {args.envoy_concurrency}"
             + (f", ext_proc message timeout {args.picker_message_timeout:g} s" if args.picker_message_timeout else "")
             + ", its CPU and the picker's together" if PICKER in targets else "") + ".\n")
    cols = ["streams"]
    for t in targets:
        cols += [f"{t} TTFT p50/p99 ms", f"{t} tok/s", f"{t} err"]
        if t != "direct":
            cols.append(f"{t} CPU s/1k req")
        if t == PICKER:
            cols.append("picker decision p99 (bucket)")
    ours = ([t for t in targets if t.startswith("router") or t == PICKER]
            if {"direct", "vllm-router"} <= set(targets) else [])
    for t in ours:
        cols += [f"added TTFT p50, {t} ÷ vllm-router", f"tok/s, {t} ÷ vllm-router"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for n, row in table.items():
        cells = [f"{n:,}"]
        for t in targets:
            r = row[t]
            cells += [f"{r.p(.5) * 1e3:.1f} / {r.p(.99) * 1e3:.1f}", f"{r.tokens / r.wall:,.0f}", str(r.errors)]
            if t != "direct":
                cells.append(f"{r.cpu / r.requests * 1000:.2f}")
            if t == PICKER:
                cells.append(fmt_bound(*r.decision_p99[:2]) if r.decision_p99 else "-")
        for t in ours:
            d, mine, theirs = row["direct"], row[t], row["vllm-router"]
            added_ours, added_theirs = mine.p(.5) - d.p(.5), theirs.p(.5) - d.p(.5)
            cells.append(f"{added_ours * 1e3:.1f} ÷ {added_theirs * 1e3:.1f} ms"
                         + (f" = {added_ours / added_theirs:.2f}" if added_theirs > 0 else ""))
            cells.append(f"{(mine.tokens / mine.wall) / (theirs.tokens / theirs.wall):.2f}")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
