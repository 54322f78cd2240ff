"""Where a lone request's TTFT goes on the local P/D path (`disagg serve --local`'s processes: prefill vLLM
on core 0, decode vLLM on core 1, NIXL between them, the router in front).

Lone streamed completions, one at a time (prompts of 16-800 random token ids, max_tokens 16, temperature 0,
ignore_eos), each sent two ways, alternately, so both see the same machine:

* ``router``: through the router, as a client sends them;
* ``direct``: the router's two hops made by this script: the prefill request the router sends (max_tokens
  1, not streamed, ``kv_transfer_params`` asking for a remote decode) straight to the prefill worker, then
  the decode request with the ``kv_transfer_params`` it returned straight to the decode worker. The same
  engines' work without the router: a stall here is the engines'.

and after two idle gaps (``--gaps``, seconds between one request's end and the next one's start). Per
request: the client's TTFT (and for ``direct`` its split: prefill answered, decode's response headers, its
first token), and each component's own view from its /metrics, scraped after every request (deltas of the
histogram sums): the router's TTFT; each engine's TTFT (arrival at its frontend to its first token), queue
time (arrival at its engine core to first scheduled: a decode's wait for its KV is in there) and prefill
time (scheduled to first token); vLLM's mean time per output token. NIXL's transfer histogram is published
at vLLM's logging interval, so it is summed over each phase. Also printed: each process's threads' CPU
affinity once ready, and the CPU time each process took while idle and over each phase (who spins).

Variants (``--variants``) restart the pair with worker settings changed, one thing each; ``base`` is the
setup as shipped (run it in the same invocation as the others: this host's speed drifts), ``vllm`` the
one before the two fixes in workers/engine_site (vLLM's own spin and core reservation).

    flock /tmp/quiet.lock .venv/bin/python bench/pd_path_timing.py [--requests 40] [--variants base,...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from disagg.router.handoff import REMOTE_DECODE   # what the router asks a prefill for
from disagg.workers.envpath import worker_python
from disagg.workers.local import free_port, metric_sum, pd_processes, scrape, start_pd, stop_all
from disagg.workers.tinymodel import ensure

LENGTHS = (16, 64, 128, 256, 400, 600, 800)
ENGINE_SUMS = {"ttft": "vllm:time_to_first_token_seconds_sum", "queue": "vllm:request_queue_time_seconds_sum",
               "prefill": "vllm:request_prefill_time_seconds_sum", "tpot": "vllm:request_time_per_output_token_seconds_sum"}
# name -> both engines' worker settings (DISAGG_* variables) over the shipped ones
VARIANTS = {
    "base": {},
    # vLLM's own shared-memory queue readers: a sched_yield spin for 1 s after every read
    # (shm_broadcast.SpinCondition) instead of waiting on the writer's notification (settings.vllm_shm_wait_ms)
    "vllm-spin": {"DISAGG_VLLM_SHM_WAIT_MS": "0"},
    # vLLM's NIXL worker pins its creating thread (the CPU worker's compute) to the machine's last core:
    # the prefill's compute on the decode's core (settings.nixl_keep_affinity)
    "lastcore": {"DISAGG_NIXL_KEEP_AFFINITY": "false"},
    "vllm": {"DISAGG_VLLM_SHM_WAIT_MS": "0", "DISAGG_NIXL_KEEP_AFFINITY": "false"},   # both: as before
}


def post(url: str, body: dict, timeout: float = 120):
    return urllib.request.urlopen(urllib.request.Request(url, data=json.dumps(body).encode(),
                                                         headers={"Content-Type": "application/json"}), timeout=timeout)


def stream(url: str, body: dict, t0: float) -> dict:
    """A streamed completion: headers and first-token times (s since t0), token times, usage."""
    out: dict = {}
    with post(f"{url}/v1/completions", body) as r:
        out["headers"] = time.perf_counter() - t0
        times = []
        for line in r:
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                if ev.get("choices"):
                    times.append(time.perf_counter() - t0)
                if ev.get("usage"):
                    out["tokens"] = ev["usage"]["completion_tokens"]
    out["first"], out["end"] = times[0], times[-1]
    out["itl"] = (times[-1] - times[0]) / max(out.get("tokens", len(times)) - 1, 1)
    return out


def one(path: str, procs, prompt: list[int]) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    if path == "router":
        r = stream(procs[2].url, body, t0)
    else:
        pbody = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        pbody.update(max_tokens=1, stream=False, kv_transfer_params=REMOTE_DECODE)
        with post(f"{procs[0].url}/v1/completions", pbody) as resp:
            params = json.loads(resp.read())["kv_transfer_params"]
        prefilled = time.perf_counter() - t0
        r = stream(procs[1].url, dict(body, kv_transfer_params=params), t0)
        r["prefilled"] = prefilled
    return r


def sums(procs) -> dict[str, float]:
    out = {"router ttft": metric_sum(scrape(procs[2].url), "disagg_router_ttft_seconds_sum")}
    for role, p in (("P", procs[0]), ("D", procs[1])):
        m = scrape(p.url)
        out |= {f"{role} {k}": metric_sum(m, name) for k, name in ENGINE_SUMS.items()}
        out[f"{role} nixl"] = metric_sum(m, "vllm:nixl_xfer_time_seconds_sum")
        out[f"{role} nixl n"] = metric_sum(m, "vllm:nixl_xfer_time_seconds_count")
    return out


def tree(pid: int) -> list[int]:
    """pid and its descendants."""
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def name(pid: int) -> str:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return (cmd[0].decode() if b"python" not in cmd[0] else " ".join(c.decode() for c in cmd[1:4]))[:40]
    except OSError:
        return "?"


def cpu_times(procs) -> dict[str, float]:
    """CPU seconds of every process of the pair and the router ('<role>/<pid> <name>')."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for role, p in zip(("prefill", "decode", "router"), procs):
        for pid in tree(p.proc.pid):
            try:
                f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                out[f"{role}/{pid} {name(pid)}"] = (int(f[11]) + int(f[12])) / tick
            except (OSError, IndexError):
                pass
    return out


def affinity(procs) -> list[str]:
    """Each process's threads grouped by CPU affinity."""
    lines = []
    for role, p in zip(("prefill", "decode", "router"), procs):
        for pid in tree(p.proc.pid):
            groups: dict[str, list[str]] = {}
            try:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                    cpus = ",".join(map(str, sorted(os.sched_getaffinity(int(tid)))))
                    groups.setdefault(cpus, []).append(comm + ("*" if tid == str(pid) else ""))
            except OSError:
                continue
            lines.append(f"  {role}/{pid} {name(pid)}: " + "; ".join(
                f"cpus {c}: {len(t)} threads ({', '.join(sorted(set(t))[:6])})" for c, t in groups.items()))
    return lines


def cpu_delta(before: dict, after: dict, seconds: float) -> str:
    rows = sorted(((after[k] - before.get(k, 0), k) for k in after), reverse=True)
    return ", ".join(f"{k} {v / seconds * 100:.0f}%" for v, k in rows if v / seconds >= 0.02) or "none above 2%"


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(int(round(p / 100 * (len(xs) - 1))), len(xs) - 1)]


def summary(label: str, xs: list[float]) -> str:
    ms = [x * 1000 for x in xs]
    return (f"{label:<34} n {len(ms):>3}  p50 {pct(ms, 50):7.1f}  mean {statistics.mean(ms):7.1f}  "
            f"p90 {pct(ms, 90):7.1f}  max {max(ms):7.1f} ms")


def run_variant(variant: str, args, model: str, python: str, work: Path) -> list[dict]:
    log_dir = work / variant
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = pd_processes(model, free_port(), python, log_dir)
    for p in procs[:2]:
        p.env |= VARIANTS[variant]
    rows = []
    try:
        print(f"\n=== variant {variant}: starting (logs in {log_dir}) ...", flush=True)
        start_pd(procs, engine_timeout=900)
        print("threads' CPU affinity:\n" + "\n".join(affinity(procs)), flush=True)
        rng = random.Random(7)
        for i in range(3):     # warm the path: the first NIXL handshake, first shapes
            one(("router", "direct")[i % 2], procs, [rng.randrange(10, 500) for _ in range(200)])
        time.sleep(3)
        c0, t = cpu_times(procs), time.monotonic()
        time.sleep(3)
        print(f"CPU while idle (3 s): {cpu_delta(c0, cpu_times(procs), time.monotonic() - t)}", flush=True)
        for gap in args.gaps:
            c0, t, s0 = cpu_times(procs), time.monotonic(), sums(procs)
            nixl0 = s0
            for i in range(args.requests):
                n = LENGTHS[(i // 2) % len(LENGTHS)]
                path = ("router", "direct")[i % 2]
                time.sleep(gap)
                r = one(path, procs, [rng.randrange(10, 500) for _ in range(n)])
                s1 = sums(procs)
                d = {k: (s1[k] - s0[k]) for k in s1 if not k.endswith("nixl") and not k.endswith("nixl n")}
                s0 = s1
                rows.append({"variant": variant, "gap": gap, "path": path, "prompt": n, **r, **d})
                print(f"  {variant} gap {gap:g} {path:<6} {n:>4} tok: TTFT {r['first'] * 1000:7.1f} ms"
                      + (f" (prefilled {r['prefilled'] * 1000:6.1f}, decode headers {r['headers'] * 1000:6.1f})"
                         if path == "direct" else f" (router's {d['router ttft'] * 1000:6.1f})")
                      + f"; P ttft {d['P ttft'] * 1000:6.1f} queue {d['P queue'] * 1000:5.1f}; D ttft "
                      f"{d['D ttft'] * 1000:6.1f} queue {d['D queue'] * 1000:6.1f} prefill {d['D prefill'] * 1000:5.1f};"
                      f" ITL {r['itl'] * 1000:5.1f} (D tpot {d['D tpot'] * 1000:5.1f})", flush=True)
            el = time.monotonic() - t
            s1 = sums(procs)
            xfers = s1["D nixl n"] - nixl0["D nixl n"]
            print(f"  gap {gap:g}: NIXL mean transfer {(s1['D nixl'] - nixl0['D nixl']) / max(xfers, 1) * 1000:.2f} ms "
                  f"over {xfers:.0f} published; CPU over the phase ({el:.0f} s): {cpu_delta(c0, cpu_times(procs), el)}",
                  flush=True)
    finally:
        stop_all(procs)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40, help="per variant and gap (half each path)")
    ap.add_argument("--gaps", type=lambda s: [float(x) for x in s.split(",")], default=[0.2, 1.5],
                    help="idle seconds before each request")
    ap.add_argument("--variants", default="base", help=f"comma-separated, of {', '.join(VARIANTS)}")
    ap.add_argument("--json", help="write every request's row here")
    args = ap.parse_args()
    python = worker_python()
    model = str(ensure(python))
    work = Path(tempfile.mkdtemp(prefix="pd-path-timing-"))
    rows = []
    for v in args.variants.split(","):
        rows += run_variant(v, args, model, python, work)
    print(f"\nlone requests, {args.requests} per variant and gap; load average now {os.getloadavg()[0]:.1f}")
    for v in args.variants.split(","):
        for gap in args.gaps:
            for path in ("router", "direct"):
                rs = [r for r in rows if r["variant"] == v and r["gap"] == gap and r["path"] == path]
                if not rs:
                    continue
                tag = f"{v} gap {gap:g} {path}"
                print(summary(f"{tag} TTFT", [r["first"] for r in rs]))
                if path == "router":
                    print(summary(f"{tag} router's TTFT", [r["router ttft"] for r in rs]))
                else:
                    print(summary(f"{tag} prefill answered", [r["prefilled"] for r in rs]))
                print(summary(f"{tag} P engine TTFT", [r["P ttft"] for r in rs]))
                print(summary(f"{tag} D engine TTFT", [r["D ttft"] for r in rs]))
                print(summary(f"{tag} D queue (KV wait)", [r["D queue"] for r in rs]))
                print(summary(f"{tag} ITL", [r["itl"] for r in rs]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
