"""The simulator against the real engines: the same trace through a real CPU prefill/decode pair and
through `disagg simulate`'s simulator driven by a `disagg profile` of those same workers.

What runs (no GPU, the tiny test model):

1. `disagg serve --local`'s processes: a CPU vLLM prefill worker (core 0) and a decode worker (core 1)
   with NIXL between them, and the router in front (disaggregation always);
2. `disagg profile` against each worker on its own (prefill points from the prefill worker, decode
   points from the decode worker), written to two profile files; the prefill worker's profile also
   times lone requests through the router (``--path-url``): the P/D hand-off, which the serving model
   charges each request between its prefill and its first decode step;
3. a few minutes of the Mooncake conversation trace (../shared/traces), scaled down so two one-core
   engines serve it without unbounded queueing: prompt lengths / ``--in-scale``, output lengths /
   ``--out-scale`` (clipped to the workers' 1024-token context), the request rate set so the profile
   predicts ``--load`` utilisation of the whole P/D path (a request's prefill, hand-off and first decode
   step as one server's time: on this host the hand-off is CPU work of processes sharing the two cores)
   and at most ``--decode-concurrency`` requests decoding at once; random token ids (no prefix sharing: the
   simulator's prefix cache and vLLM's are both idle, so neither is judged here);
4. the trace replayed open-loop (each request sent at its arrival time, streaming, ``ignore_eos``)
   through the router, TTFT and ITL measured by the client; ``--arrivals``: with the trace's own arrival
   times (the Mooncake trace logs its requests in bursts, ~10 at one instant every few seconds), and/or with
   each burst spread evenly over the time to the next one (same requests, same mean rate);
5. the two workers profiled again after the replays, the same way (this host's speed drifts within minutes);
6. the same trace through :class:`disagg.simulator.simulate.Simulation` with one prefill and one decode
   replica (a static policy), its performance model fitted to both profiles' points (and, to show the
   drift, to each profile alone).

Printed, per replay: TTFT and ITL p50/p90, real, simulated and simulated / real, and whether each is
within 20%; the TTFT p50 by a request's position in its burst, real and simulated (where queueing behind a
burst goes);
and the p50s of ``--unloaded`` requests of the trace sent one at a time (rows "alone"), which separate
the profile's shape and the path's fixed costs from queueing. For the lone requests and for the replay,
the mean TTFT as each component's own histogram saw it (router; prefill engine and decode engine, each
from arrival there to its first token) and the decode worker's mean NIXL transfer time.
TTFT is arrival to the first token; ITL is a request's mean time between its output tokens (the
simulator's definitions).

    nice -n 19 .venv/bin/python bench/sim_vs_real.py [--minutes 3] [--load 0.5] [--json out.json]

``--flex`` (issue 31's check: the simulator's role switch against the router's): a third engine, a flex
worker (kv_role kv_both), on the prefill's core (``--flex-cores``), listed in the router's config as a flex
worker serving prefill whose role the router reads from a roles file (``flex_roles_file``, re-read every
``ROLES_POLL_S``; in Kubernetes the planner writes a pod label instead). The trace gets a load step: before
``--switch-at`` prompts x2 and outputs /4 (prompt-heavy), from it prompts /4 and outputs x4 (output-heavy,
outputs up to 256 tokens); the rate is set from the heavy side of each half (the prompt-heavy half's path,
the output-heavy half's decode), one engine each. During the replay (by default with the trace's own
bursts) the bench itself writes "decode" to the roles file at ``--switch-at`` (by default just after the
first burst from mid-replay arrives, so the flex worker is prefilling its share when the router sees it);
the router drains the worker (its prefills in flight, the KV blocks it holds until the decodes pull them)
and flips it. The planner's ``react_flex`` does not decide the switch here: the check is the switch's
execution and what it does to latency, at a time both sides share. The simulator gets one prefill, one
decode and one flex worker serving prefill (``SimConfig.flex_switches``), switched to decode when the real
router saw the switch (its log's time, to the ms), its drain modelled as for the planner's
switches, its flip free (``switch_flip`` 0: the router flips in memory, the engine reloads nothing).
Printed besides the table above: TTFT and ITL p50/p90 per phase, by arrival: 'before' (up to
``--drain-window`` s before the switch), 'drain' (from then to the later of the two flips: what is in flight
when the switch comes, and the drain), 'after'; and the drain, real (the router's
``disagg_router_switch_drain_seconds``: seen to flipped) against simulated, each with whether it is within
20%. Three engines on two cores: the two prefill engines share core 0 in the prompt-heavy half (the
simulator gives each replica its own hardware: where their work overlaps the real side is slower), the flex
worker decodes on core 0 beside the prefill engine in the output-heavy half; ``--flex-cores 1`` trades that
for two decode engines on core 1 (planner/README.md, Flex workers: four runs, what agrees and why). The flex
engine is not profiled: the simulator runs it on the role's profile.

    flock /work/cpu-heavy.lock nice -n 19 .venv/bin/python bench/sim_vs_real.py --flex --minutes 2 --load 0.1 [--json out.json]

CPU contention: the workers share this machine's cores with whatever else runs; the profile is
measured minutes before the replay, so load that changes in between moves the real figures and not
the simulated ones. The load average before and after is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from pd_path_timing import cpu_times   # this directory's: CPU seconds of every process of the pair and router
from disagg.perf import model as perfmodel
from disagg.perf import serving
from disagg.perf.profile import mean_itl, stream_tokens
from disagg.simulator import traces
from disagg.simulator.simulate import SimConfig, Simulation, StaticPolicy, _pct
from disagg.workers.envpath import worker_python
from disagg.api.contract import KV_LEASE_SECONDS
from disagg.api.metrics import (ROUTER_FLEX_WORKERS, ROUTER_SWITCH_DRAIN_SECONDS, ROUTER_TTFT_SECONDS,
                                VLLM_NIXL_XFER_TIME_SECONDS, VLLM_TTFT_SECONDS)
from disagg.workers.local import (cpu_settings, free_port, metric_sum, pd_processes, scrape, start_pd, stop_all,
                                  worker)
from disagg.workers.tinymodel import ensure

REPO = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 1024        # workers.local.cpu_settings
MAX_NUM_SEQS = 64           # workers.local.cpu_settings' --max-num-seqs
TOLERANCE = 0.20


def profile_worker(url: str, out: Path, role: str, path_url: str | None = None) -> perfmodel.Profile:
    """`disagg profile` (the CLI, as a user runs it) against one worker (and, with ``path_url``, lone
    requests through the router: the hand-off)."""
    exe = shutil.which("disagg", path=str(Path(sys.executable).parent)) or "disagg"
    args = [exe, "profile", "--url", url, "--model", "tiny", "--vocab", "500", "--out", str(out),
            "--repeats", "3"]   # medians: one sample on this shared machine can be off by a factor
    if role == "prefill":   # prompts up to what the trace sends; decode points are not used from here
        args += ["--prompt-tokens", "32,256,768", "--batches", "1,3", "--concurrency", "1,2,4",
                 "--context", "64", "--decode-tokens", "8"]
        if path_url:
            args += ["--path-url", path_url]
    else:                   # concurrencies the replay reaches; prefill points are not used from here
        args += ["--prompt-tokens", "32,64,128", "--batches", "1", "--concurrency", "1,2,4,8,16",
                 "--context", "192", "--decode-tokens", "48"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    if run.returncode:
        raise RuntimeError(f"disagg profile {role} failed:\n{run.stderr[-3000:]}")
    print(f"  {role}: {run.stdout.strip()}", flush=True)
    return perfmodel.Profile.load(out)


def scaled_trace(minutes: float, in_scale: float, out_scale: float, start: float) -> traces.Trace:
    """The Mooncake trace from ``start`` s, lengths scaled down and clipped to the workers' context."""
    full = traces.real(REPO)
    reqs = []
    for r in full.requests:
        if r.t < start:
            continue
        out = min(max(round(r.output_tokens / out_scale), 2), 128)
        inp = min(max(round(r.input_tokens / in_scale), 8), MAX_MODEL_LEN - out - 8)
        reqs.append(traces.Request(r.t - start, inp, out, None, ()))
    return traces.Trace("mooncake-scaled", tuple(reqs))


# --flex's load step: (prompt factor, output factor) before the switch (prompt-heavy) and from it (output-heavy)
FLEX_MIX = ((2.0, 0.25), (0.25, 4.0))
FLEX_MAX_OUTPUT = 256


def load_step(trace: traces.Trace, at: float, mix: tuple[tuple[float, float], tuple[float, float]] = FLEX_MIX) -> traces.Trace:
    """The trace with a change of mix at ``at`` s: each request's prompt and output lengths times
    ``mix[0]`` before it, ``mix[1]`` from it; outputs within 2-``FLEX_MAX_OUTPUT``, prompts at least 8 tokens
    and within the workers' context with their output."""
    reqs = []
    for r in trace.requests:
        fi, fo = mix[r.t >= at]
        out = min(max(round(r.output_tokens * fo), 2), FLEX_MAX_OUTPUT)
        inp = min(max(round(r.input_tokens * fi), 8), MAX_MODEL_LEN - out - 8)
        reqs.append(replace(r, input_tokens=inp, output_tokens=out))
    return traces.Trace(trace.name + "-step", tuple(reqs))


PHASES = ("before", "drain", "after")
# --flex's default switch: this long after the first burst from mid-replay arrives, so that the flex worker
# is prefilling its share of that burst when the router sees the switch (within ROLES_POLL_S): a drain with
# something to wait for (an idle worker flips at once, in both)
SWITCH_AFTER_BURST = 0.05


def switch_time(trace: traces.Trace, at: float) -> float:
    """Just after the first arrival at or after ``at`` s (the trace's last arrival if none)."""
    later = [r.t for r in trace.requests if r.t >= at]
    return (min(later) if later else trace.duration) + SWITCH_AFTER_BURST


def phases(records: list[tuple[float, float, float | None]], start: float,
           end: float) -> dict[str, dict[str, list[float]]]:
    """Requests' TTFT and ITL by when they arrived: 'before' ``start``, 'drain' from it to ``end``, 'after';
    (arrival, TTFT, ITL or None) each."""
    out = {p: {"ttft": [], "itl": []} for p in PHASES}
    for t, ttft, itl in records:
        phase = out["before" if t < start else "drain" if t < end else "after"]
        phase["ttft"].append(ttft)
        if itl is not None:
            phase["itl"].append(itl)
    return out


def phase_rows(real: dict[str, dict[str, list[float]]], sim: dict[str, dict[str, list[float]]]) -> list[dict]:
    """:func:`table`'s rows for each phase both sides have requests in (a short drain may have none)."""
    rows = []
    for p in PHASES:
        if all(real[p][k] and sim[p][k] for k in ("ttft", "itl")):
            rows += [dict(r, phase=p, n=len(real[p]["ttft"])) for r in table(real[p], sim[p], f" {p}")]
    return rows


def within(real: float, sim: float) -> dict:
    ratio = sim / real if real else math.nan
    return {"real_ms": real * 1000, "sim_ms": sim * 1000, "ratio": ratio, "within": abs(ratio - 1) <= TOLERANCE}


def with_rate(trace: traces.Trace, rate: float, seconds: float) -> traces.Trace:
    k = rate / (len(trace.requests) / trace.duration)
    return trace.scaled(rate=k, limit=seconds)


class ProfiledConfig(SimConfig):
    """A SimConfig whose performance models are the measured profiles (the simulator asks
    ``planning_models()`` for them); the shape is the tiny model's own config.json, the
    hardware entry only gives the physical floors, far below these CPU timings."""

    def with_models(self, prefill: perfmodel.PerfModel, decode: perfmodel.PerfModel) -> ProfiledConfig:
        object.__setattr__(self, "_models", (prefill, decode))
        return self

    def planning_models(self):
        return self._models


def role_models(model_dir: str, prefill: perfmodel.Profile,
                decode: perfmodel.Profile) -> tuple[perfmodel.PerfModel, perfmodel.PerfModel]:
    """The planner's performance models of the two workers: the tiny model's shape, each profile."""
    shape = perfmodel.model_from_config(model_dir, "tiny")
    shape = replace(shape, dtype_bytes=4)   # the CPU workers run float32
    # a same-host link: NIXL over UCX/TCP on loopback
    base = perfmodel.PerfModel(shape, perfmodel.gpu("L40S"), 1, perfmodel.interconnect("tcp-25g"))
    return replace(base, profile=prefill), replace(base, profile=decode)


def merged(a: perfmodel.Profile, b: perfmodel.Profile) -> perfmodel.Profile:
    """One profile fitted to both profiles' points (the same worker measured twice)."""
    return perfmodel.Profile(a.model, a.gpu, a.tensor_parallel_size, a.prefill + b.prefill, a.decode + b.decode,
                             a.handoff + b.handoff)


def path_seconds(models: tuple[perfmodel.PerfModel, perfmodel.PerfModel], tokens: int) -> float:
    """A lone request's TTFT through the P/D path as the serving model charges it: prefill, hand-off,
    decode's first step."""
    pre, dec = models
    return pre.ttft(tokens) + serving.kv_transfer_time(pre, tokens, dec.tp) + dec.decode_step_time(1, tokens)


class _Recording(Simulation):
    """The simulator as it is, also keeping each request's TTFT by its arrival time (the burst table) and
    its ITL (the per-phase table of ``--flex``)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.by_arrival: list[tuple[float, float]] = []
        self.records: dict[int, list] = {}      # id of the request's state -> [arrival, TTFT, ITL]

    def _ttft(self, a) -> None:
        super()._ttft(a)
        self.by_arrival.append((a.r.t, a.first - a.r.t))
        self.records[id(a)] = [a.r.t, a.first - a.r.t, None]

    def _finish(self, a, rep, now) -> None:
        super()._finish(a, rep, now)
        self.records[id(a)][2] = self.itl[-1]


def sim_config(max_batch_tokens: int, **kw) -> ProfiledConfig:
    return ProfiledConfig(model="tiny", gpu="L40S", ttft_target=1e9, itl_target=1e9, interval=60.0,
                          startup=0.0, max_batch_tokens=max_batch_tokens, max_num_seqs=MAX_NUM_SEQS,
                          drain_limit=3600.0, **kw)


def simulate(trace: traces.Trace, models: tuple[perfmodel.PerfModel, perfmodel.PerfModel],
             max_batch_tokens: int) -> tuple[list[float], list[float], list[tuple[float, float]]]:
    cfg = sim_config(max_batch_tokens)
    cfg.with_models(*models)
    sim = _Recording(cfg, trace, StaticPolicy(1, 1))
    res = sim.run()
    return res.ttft, res.itl, sorted(sim.by_arrival)


def simulate_flex(trace: traces.Trace, models: tuple[perfmodel.PerfModel, perfmodel.PerfModel],
                  max_batch_tokens: int, switch_at: float) -> tuple[list[tuple[float, float, float | None]], list[float]]:
    """One prefill, one decode and one flex worker serving prefill, switched to decode at ``switch_at`` s
    (``SimConfig.flex_switches``: the simulator's own drain); its flip costs nothing beyond the drain
    (``switch_flip`` 0: the local router flips the role in memory, the kv_both engine reloads nothing).
    Returns each request's (arrival, TTFT, ITL) and the switch's drain(s), in seconds."""
    cfg = sim_config(max_batch_tokens, initial_flex_prefill=1, flex_min=1, flex_max=1, switch_flip=0.0,
                     kv_lease=float(KV_LEASE_SECONDS), flex_switches=((switch_at, "decode"),))
    cfg.with_models(*models)
    sim = _Recording(cfg, trace, StaticPolicy(1, 1))
    res = sim.run()
    return sorted((tuple(v) for v in sim.records.values()), key=lambda v: v[0]), res.switch_drains


def spread(trace: traces.Trace) -> traces.Trace:
    """The trace with each burst (requests logged at the same instant: the Mooncake trace logs its
    arrivals in clumps of ~10 every few seconds) spread evenly over the time to the next burst, in
    the trace's order: the same requests at the same mean rate without the simultaneous arrivals."""
    reqs = list(trace.requests)
    out, i = [], 0
    while i < len(reqs):
        j = i
        while j < len(reqs) and reqs[j].t == reqs[i].t:
            j += 1
        end = reqs[j].t if j < len(reqs) else reqs[i].t + (reqs[i].t - reqs[0].t) / max(len(out), 1) * (j - i)
        for k in range(i, j):
            out.append(replace(reqs[k], t=reqs[i].t + (end - reqs[i].t) * (k - i) / (j - i)))
        i = j
    return traces.Trace(trace.name + "-spread", tuple(out))


def by_position(arrivals: list[tuple[float, float]], positions: tuple[int, ...] = (0, 1, 3, 6, 9)) -> dict[int, float]:
    """Median TTFT of the requests at each position in their burst (0: the fastest of the requests that
    arrived at the same instant, 1 the next, ...): queueing behind a burst shows as a rise with it."""
    ranks, last, k = {}, None, 0
    for t, v in sorted(arrivals):
        k = k + 1 if t == last else 0
        last = t
        ranks.setdefault(k, []).append(v)
    return {p: _pct(ranks[p], 50) for p in positions if p in ranks}


def _send(url: str, prompt: list[int], max_tokens: int, sent: float, out: list, i: int) -> None:
    begin = time.perf_counter()
    try:
        times, tokens = stream_tokens(url, "tiny", prompt, max_tokens, 600.0)
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        out[i] = ("error", repr(e))
        return
    out[i] = ("ok", begin - sent, times, tokens)


def unloaded(url: str, trace: traces.Trace, n: int, gap: float = 120.0) -> tuple[traces.Trace, list, list]:
    """``n`` of the trace's requests one at a time (closed loop: nothing queues), and the same requests
    as a trace whose arrivals are ``gap`` s apart for the simulator: the profile's shape and the
    path's fixed costs, without queueing."""
    picked = sorted(trace.requests, key=lambda r: r.input_tokens)[:: max(len(trace.requests) // n, 1)][:n]
    ttft, itl = [], []
    for i, r in enumerate(picked):
        t, it, _ = replay(url, traces.Trace("one", (traces.Request(0.0, r.input_tokens, r.output_tokens, None, ()),)),
                          seed=100 + i)
        ttft += t
        itl += it
    return (traces.Trace("unloaded", tuple(traces.Request(i * gap, r.input_tokens, r.output_tokens, None, ())
                                            for i, r in enumerate(picked))), ttft, itl)


def replay(url: str, trace: traces.Trace, seed: int = 0,
           arrivals: list[tuple[float, float]] | None = None,
           records: list[tuple[float, float, float | None]] | None = None,
           on_start=None) -> tuple[list[float], list[float], int]:
    """Open loop: each request at its arrival time; TTFT from the scheduled arrival (so a late send
    counts against the real system, as a queue would). ``records``: each request's (arrival, TTFT, ITL or
    None); ``on_start(t0)``: called with the ``time.perf_counter()`` that is the trace's time 0."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, 500) for _ in range(r.input_tokens)] for r in trace.requests]
    results: list = [None] * len(trace.requests)
    threads = []
    t0 = time.perf_counter() + 1.0
    if on_start is not None:
        on_start(t0)
    for i, r in enumerate(trace.requests):
        delay = t0 + r.t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        th = threading.Thread(target=_send, args=(url, prompts[i], r.output_tokens, t0 + r.t, results, i),
                              daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    ttft, itl, errors, one_chunk = [], [], 0, 0
    for r, res in zip(trace.requests, results):
        if res is None or res[0] != "ok":
            errors += 1
            print(f"  request failed: {res[1] if res else 'no answer'}", file=sys.stderr, flush=True)
            continue
        _, late, times, tokens = res
        ttft.append(late + times[0])   # from the scheduled arrival: a late send counts as queueing
        if arrivals is not None:
            arrivals.append((r.t, ttft[-1]))
        v = mean_itl(times, tokens)
        if records is not None:
            records.append((r.t, ttft[-1], v))
        if v is None:
            # every token in one chunk (a lagging frontend merges them): its TTFT counts, its ITL is unknown
            one_chunk += 1
            continue
        itl.append(v)
    if one_chunk:
        print(f"  {one_chunk} of {len(results)} streams came in one chunk (TTFT kept, no ITL)", flush=True)
    return ttft, itl, errors


def ttft_totals(procs) -> dict[str, tuple[float, float]]:
    """(sum, count) of the router's TTFT histogram, each engine's own (arrival at that engine to its
    first token) and the decode worker's NIXL transfer times: differences over a phase split the
    client's TTFT by where it was spent."""
    out = {}
    # --flex: the flex engine's own TTFT too (its prefills' and, after the switch, its decodes')
    flex = (("flex engine", procs[3], VLLM_TTFT_SECONDS),) if len(procs) > 3 else ()
    for key, p, name in (("router", procs[2], ROUTER_TTFT_SECONDS), ("prefill engine", procs[0], VLLM_TTFT_SECONDS),
                         ("decode engine", procs[1], VLLM_TTFT_SECONDS), *flex,
                         ("KV pull (NIXL)", procs[1], VLLM_NIXL_XFER_TIME_SECONDS)):
        m = scrape(p.url)
        out[key] = (metric_sum(m, name + "_sum"), metric_sum(m, name + "_count"))
    return out


def ttft_split(before: dict, after: dict, client: list[float]) -> tuple[dict[str, float], str]:
    means = {k: (after[k][0] - before[k][0]) / max(after[k][1] - before[k][1], 1) for k in after}
    text = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in means.items())
    return means, (f"mean TTFT: client {sum(client) / max(len(client), 1) * 1000:.1f} ms; as each saw it: {text} "
                   f"(an engine's: arrival there to its first token; NIXL: per transfer)")


# --flex: how often the router re-reads the roles file (its health_interval_s; 2 s by default): the switch
# is seen within this of being written
ROLES_POLL_S = 0.1


def add_flex(model: str, python: str, work: Path, cores: str):
    """A third engine, kv_role kv_both (a flex worker), on ``cores``, added to the router's config (not yet
    started) as a flex worker serving prefill whose role is read from a roles file, as `disagg serve`'s
    router does without Kubernetes (there, the planner writes a pod label). Returns (process, roles file)."""
    path = work / "router.json"
    config = json.loads(path.read_text())
    s = cpu_settings("flex", model, cores)
    url = f"http://127.0.0.1:{s.port}"
    roles = work / "flex-roles.json"
    roles.write_text(json.dumps({url: "prefill"}))
    # the pair's KV revision: the router pairs a prefill and a decode of one revision only
    config["flex"] = [{"url": url, "role": "prefill", "kv_events": f"tcp://127.0.0.1:{s.kv_events_port}",
                       "kv_replay": f"tcp://127.0.0.1:{s.kv_replay_port}",
                       "revision": config["prefill"][0].get("revision")}]
    config["flex_roles_file"], config["health_interval_s"] = str(roles), ROLES_POLL_S
    path.write_text(json.dumps(config))
    return worker("flex", s, python, work), roles


def flex_state(router_url: str, role: str, state: str = "serving") -> float:
    return metric_sum(scrape(router_url), ROUTER_FLEX_WORKERS, role=role, state=state)


def drain_totals(router_url: str) -> tuple[float, float]:
    """(sum, count) of the router's completed switch drains (outcome switched)."""
    m = scrape(router_url)
    return (metric_sum(m, ROUTER_SWITCH_DRAIN_SECONDS + "_sum", outcome="switched"),
            metric_sum(m, ROUTER_SWITCH_DRAIN_SECONDS + "_count", outcome="switched"))


def set_role(router_url: str, roles: Path, flex_url: str, role: str, timeout: float = 300) -> None:
    """The flex worker switched to ``role`` (if it is not serving it) and serving it."""
    roles.write_text(json.dumps({flex_url: role}))
    deadline = time.monotonic() + timeout
    while flex_state(router_url, role) < 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router does not report the flex worker serving {role} after {timeout:.0f} s")
        time.sleep(0.2)


def router_switch(log: Path, since: float, frm: str = "prefill", to: str = "decode") -> tuple[float | None, float | None]:
    """When the router (its log, to the ms) began the last drain of a flex worker from ``frm`` to ``to`` after
    ``since`` (time.time()) and when it flipped it; None where the log has no such line."""
    import datetime
    import re

    seen = flipped = None
    for line in log.read_text(errors="replace").splitlines():
        m = re.match(r'\{"ts":"([0-9-]+ [0-9:]+,[0-9]+)"', line)
        if not m:
            continue
        t = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if t < since:
            continue
        if f"switching {frm} -> {to}, draining" in line:
            seen, flipped = t, None
        elif f"serves {to} (drained {frm}" in line and seen is not None:
            flipped = t
    return seen, flipped


class ScheduledSwitch:
    """During a replay: at trace time ``at``, the flex worker's new role written to the router's roles file
    (the planner's decision, as it would land); then the router's metrics watched until it reports the
    worker serving that role. ``flipped``: that moment in trace time (to the poll's 50 ms)."""

    def __init__(self, router_url: str, roles: Path, flex_url: str, at: float, to: str = "decode"):
        self.router_url, self.roles, self.flex_url, self.at, self.to = router_url, roles, flex_url, at, to
        self.written: float | None = None
        self.flipped: float | None = None
        self.thread: threading.Thread | None = None

    def start(self, t0: float) -> None:   # replay's on_start
        self.t0_wall = time.time() - (time.perf_counter() - t0)   # the trace's time 0 on the wall clock
        self.thread = threading.Thread(target=self._run, args=(t0,), daemon=True)
        self.thread.start()

    def _run(self, t0: float) -> None:
        time.sleep(max(t0 + self.at - time.perf_counter(), 0.0))
        self.roles.write_text(json.dumps({self.flex_url: self.to}))
        self.written = time.perf_counter() - t0
        deadline = time.perf_counter() + 600
        while time.perf_counter() < deadline:
            if flex_state(self.router_url, self.to) >= 1:
                self.flipped = time.perf_counter() - t0
                return
            time.sleep(0.05)

    def join(self, timeout: float = 600) -> None:
        if self.thread:
            self.thread.join(timeout)


def engine_max_batch_tokens(log: Path) -> int:
    """vLLM's max_num_batched_tokens as the prefill worker logged it (its scheduler's token budget)."""
    import re

    m = re.findall(r"max_num_batched_tokens=(\d+)", log.read_text(errors="replace"))
    return int(m[-1]) if m else 2048


def table(real: dict[str, list[float]], sim: dict[str, list[float]], label: str = "",
          percentiles: tuple[int, ...] = (50, 90)) -> list[dict]:
    rows = []
    for metric in ("ttft", "itl"):
        for p in percentiles:
            r, s = _pct(real[metric], p), _pct(sim[metric], p)
            ratio = s / r if r else math.nan
            rows.append({"metric": f"{metric.upper()} p{p}{label}", "real_ms": r * 1000, "sim_ms": s * 1000,
                         "ratio": ratio, "within": abs(ratio - 1) <= TOLERANCE})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--load", type=float, default=0.5, help="utilisation of the P/D path (prefill + hand-off + first decode step) the profile predicts")
    ap.add_argument("--decode-concurrency", type=float, default=8.0,
                    help="mean requests decoding at once the rate is held to (Little's law on the profile)")
    ap.add_argument("--in-scale", type=float, default=32.0, help="prompt lengths divided by this")
    ap.add_argument("--out-scale", type=float, default=8.0, help="output lengths divided by this")
    ap.add_argument("--start", type=float, default=600.0, help="trace offset in seconds")
    ap.add_argument("--unloaded", type=int, default=8,
                    help="requests of the trace also sent one at a time (rows '... alone': no queueing)")
    ap.add_argument("--arrivals", default=None,
                    help="replays, in order: 'trace' (the trace's own arrival times: bursts of ~10 at one "
                         "instant) and/or 'spread' (each burst spread evenly to the next); default "
                         "'trace,spread', with --flex 'trace' (its switch lands in a burst)")
    ap.add_argument("--flex", action="store_true",
                    help="a third engine as a flex worker (kv_both) serving prefill, switched to decode at "
                         "--switch-at; the trace prompt-heavy before it, output-heavy from it")
    ap.add_argument("--switch-at", type=float,
                    help="--flex: trace time of the switch and of the change of mix, s (default: just after "
                         "the first burst from mid-replay arrives)")
    ap.add_argument("--flex-cores", default="0", help="--flex: the flex engine's cores (the prefill's: 0)")
    ap.add_argument("--drain-window", type=float, default=1.0,
                    help="--flex: the 'drain' phase starts this long before the switch (s): the requests in "
                         "flight when it comes (the burst it lands in)")
    ap.add_argument("--json", help="write the rows and settings here")
    ap.add_argument("--keep", help="keep logs and profiles in this directory")
    args = ap.parse_args()
    arrival_modes = (args.arrivals or ("trace" if args.flex else "trace,spread")).split(",")

    python = worker_python()
    model = str(ensure(python))
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="sim-vs-real-"))
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = pd_processes(model, port, python, work)
    flex = roles = None
    if args.flex:
        flex, roles = add_flex(model, python, work, args.flex_cores)
        procs.append(flex)     # procs[3]: the indices of the pair and the router stay
    load_before = os.getloadavg()
    try:
        print(f"starting prefill, decode{', flex' if flex else ''}, router (logs in {work}) ...", flush=True)
        if flex:   # the three engines at once, then the router (start_pd's order)
            for p in (procs[0], procs[1], flex):
                p.start()
            for p in (procs[0], procs[1], flex):
                p.wait_ready(900)
            procs[2].start().wait_ready()
            set_role(procs[2].url, roles, flex.url, "prefill")
        else:
            start_pd(procs, engine_timeout=900)
        # warm the path (first NIXL handshake, compiled shapes, the engines' first minute) before anything
        # is timed through it: 40 requests, 16-800 tokens, over 20 s
        print("warming the path ...", flush=True)
        warm = traces.Trace("warm", tuple(traces.Request(i * 0.5, 16 + (i * 97) % 785, 8 + i % 24, None, ())
                                          for i in range(40)))
        replay(procs[2].url, warm, seed=1)
        if flex:   # the flex engine's first decode (its first KV pull) before the replay: switch it there and back
            set_role(procs[2].url, roles, flex.url, "decode")
            replay(procs[2].url, traces.Trace("warm-flex", tuple(warm.requests[:10])), seed=2)
            set_role(procs[2].url, roles, flex.url, "prefill")
        print("profiling the workers (disagg profile) ...", flush=True)
        pre = profile_worker(procs[0].url, work / "prefill-profile.yaml", "prefill", procs[2].url)
        dec = profile_worker(procs[1].url, work / "decode-profile.yaml", "decode")
        models = role_models(model, pre, dec)   # the rate is set from this one (the replays have not run)

        base = scaled_trace(args.minutes, args.in_scale, args.out_scale, args.start)
        # --flex: the rate from each half's heavy side: the prompt-heavy half's path, the output-heavy half's
        # decode (one engine each: the two prefill engines share a core, the output-heavy half's decode is
        # held to one decode's --decode-concurrency)
        path_reqs = load_step(base, math.inf).requests if flex else base.requests
        dec_reqs = load_step(base, -math.inf).requests if flex else base.requests
        ins = [r.input_tokens for r in path_reqs]
        # the whole path's capacity: a request's prefill, hand-off and first decode step as one server's
        mean_path = sum(path_seconds(models, n) for n in ins) / len(ins)
        # and at most --decode-concurrency requests decoding at once on average (Little's law at the
        # profile's step time for that batch): past its knee a one-core decode queues without bound
        outs = [r.output_tokens for r in dec_reqs]
        c = args.decode_concurrency
        ctx = sum(r.input_tokens for r in dec_reqs) / len(dec_reqs) + sum(outs) / len(outs) / 2
        decode_rate = c / (sum(outs) / len(outs) * dec.decode_seconds(c, c * ctx))
        rate = min(args.load / mean_path, decode_rate)
        trace = with_rate(base, rate, args.minutes * 60.0)
        switch_at = None
        if flex:
            switch_at = args.switch_at if args.switch_at is not None else switch_time(trace, trace.duration / 2)
            trace = load_step(trace, switch_at)
        n = len(trace.requests)
        t_ins, t_outs = [r.input_tokens for r in trace.requests], [r.output_tokens for r in trace.requests]
        print(f"trace: {n} requests over {trace.duration:.0f} s ({n / trace.duration:.2f}/s; the path takes "
              f"{mean_path * 1000:.1f} ms a request, decode allows {decode_rate:.2f}/s), prompt "
              f"p50/p90 {_pct(t_ins, 50):.0f}/{_pct(t_ins, 90):.0f} tokens, output p50 {_pct(t_outs, 50):.0f}",
              flush=True)
        if flex:
            for label, part in (("before the switch", [r for r in trace.requests if r.t < switch_at]),
                                ("from it", [r for r in trace.requests if r.t >= switch_at])):
                print(f"  {label}: {len(part)} requests, prompt p50 {_pct([r.input_tokens for r in part], 50):.0f}, "
                      f"output p50 {_pct([r.output_tokens for r in part], 50):.0f} tokens", flush=True)

        print("one request at a time ...", flush=True)
        before = ttft_totals(procs)
        alone, alone_ttft, alone_itl = unloaded(procs[2].url, trace, args.unloaded)
        alone_means, text = ttft_split(before, ttft_totals(procs), alone_ttft)
        sim_alone = [path_seconds(models, r.input_tokens) for r in alone.requests]
        print(f"  {text}; the model charges {sum(sim_alone) / len(sim_alone) * 1000:.1f} ms "
              f"(hand-off {1000 * sum(serving.kv_transfer_time(models[0], r.input_tokens) for r in alone.requests) / len(sim_alone):.1f} ms)",
              flush=True)
        replays = {}
        for mode in arrival_modes:
            t_mode = spread(trace) if mode == "spread" else trace
            switch = None
            if flex:
                set_role(procs[2].url, roles, flex.url, "prefill")
                switch = ScheduledSwitch(procs[2].url, roles, flex.url, switch_at)
                drains_before = drain_totals(procs[2].url)
            print(f"replaying through the router (arrivals: {mode}) ...", flush=True)
            t = time.perf_counter()
            before, cpu_before, own_before = ttft_totals(procs), cpu_times(procs), sum(os.times()[:2])
            if flex:
                cpu_before.update(cpu_times([flex]))
            arrivals: list[tuple[float, float]] = []
            records: list[tuple[float, float, float | None]] = []
            real_ttft, real_itl, errors = replay(procs[2].url, t_mode, arrivals=arrivals, records=records,
                                                 on_start=switch.start if switch else None)
            after, cpu_after, own = ttft_totals(procs), cpu_times(procs), sum(os.times()[:2]) - own_before
            if flex:
                cpu_after.update(cpu_times([flex]))
            served = sum(cpu_after.values()) - sum(cpu_before.get(k, 0.0) for k in cpu_after)
            wall = time.perf_counter() - t
            print(f"  done in {wall:.0f} s, {errors} failed; CPU per request: {served / len(t_mode.requests) * 1000:.0f} ms "
                  f"in the engines, frontends and router, {own / len(t_mode.requests) * 1000:.0f} ms in this client "
                  f"({(served + own) / wall / (os.cpu_count() or 1) * 100:.0f}% of the machine's {os.cpu_count()} "
                  f"cores over the replay)", flush=True)
            means, text = ttft_split(before, after, real_ttft)
            print(f"  {text}", flush=True)
            flex_real = None
            if switch:
                switch.join()
                d_sum, d_count = drain_totals(procs[2].url)
                drained = ((d_sum - drains_before[0]) / (d_count - drains_before[1])
                           if d_count > drains_before[1] else None)
                # when the router saw the change (its drain's start) and flipped, from its log to the ms
                # (the metrics poll's flip, to 50 ms, less the measured drain, where the log has neither)
                seen, flipped = router_switch(procs[2].log_path, switch.t0_wall)
                if seen is not None and flipped is not None:
                    seen, flipped = seen - switch.t0_wall, flipped - switch.t0_wall
                else:
                    flipped = switch.flipped
                    seen = flipped - drained if flipped is not None and drained is not None else None
                flex_real = {"written": switch.written, "flipped": flipped, "drain": drained, "seen": seen,
                             "flipped_polled": switch.flipped}
                print(f"  switch prefill -> decode written at {switch.written:.3f} s (trace time), seen by the router at "
                      f"{'-' if seen is None else f'{seen:.3f} s'}, drained in "
                      f"{'-' if drained is None else f'{drained * 1000:.0f} ms'}, serving decode at "
                      f"{'-' if flipped is None else f'{flipped:.3f} s'}", flush=True)
            replays[mode] = (t_mode, real_ttft, real_itl, errors, arrivals, means, records, flex_real)
        # the same workers profiled again after the replays: this host's speed drifts within minutes (two
        # runs' profiles 2026-12-04: hand-off 5.8 and 41.4 ms, decode step 4.3 and 8.7 ms), so the
        # simulator is driven by both profiles' points in one fit, and by each alone to show the drift
        print("profiling the workers again ...", flush=True)
        pre_after = profile_worker(procs[0].url, work / "prefill-profile-after.yaml", "prefill", procs[2].url)
        dec_after = profile_worker(procs[1].url, work / "decode-profile-after.yaml", "decode")
        mbt = engine_max_batch_tokens(procs[0].log_path)
    finally:
        stop_all(procs)
    profiles = {"before": (pre, dec), "after": (pre_after, dec_after),
                "both": (merged(pre, pre_after), merged(dec, dec_after))}
    models = role_models(model, *profiles["both"])
    load_after = os.getloadavg()

    print(f"\nsimulator (profile of these workers, max_batch_tokens {mbt}) vs the real CPU P/D "
          f"{'pair and flex worker' if flex else 'pair'}; load average {load_before[0]:.1f} before, "
          f"{load_after[0]:.1f} after")
    a_ttft, a_itl, _ = simulate(alone, models, mbt)
    alone_rows = table({"ttft": alone_ttft, "itl": alone_itl}, {"ttft": a_ttft, "itl": a_itl}, " alone", (50,))
    report = {"requests": n, "rate": n / trace.duration, "max_batch_tokens": mbt, "alone_ttft_seen_by": alone_means,
              "load_before": load_before, "load_after": load_after, "flex": bool(flex), "switch_at": switch_at,
              "profiles": {k: {"prefill": p.to_dict(), "decode": d.to_dict()} for k, (p, d) in profiles.items()
                           if k != "both"},
              "handoff_ms": {k: p.handoff_base * 1000 for k, (p, _) in profiles.items() if p.handoff_base is not None},
              "replays": {}}
    for mode, (t_mode, real_ttft, real_itl, errors, arrivals, means, records, flex_real) in replays.items():
        if flex:
            # the simulator's switch when the real router saw it (written + up to ROLES_POLL_S)
            sim_switch = flex_real["seen"] if flex_real["seen"] is not None else switch_at
            sim_records, sim_drains = simulate_flex(t_mode, models, mbt, sim_switch)
            sim_ttft = [v for _, v, _ in sim_records]
            sim_itl = [v for _, _, v in sim_records if v is not None]
            sim_arrivals = [(t, v) for t, v, _ in sim_records]
        else:
            sim_ttft, sim_itl, sim_arrivals = simulate(t_mode, models, mbt)
        rows = table({"ttft": real_ttft, "itl": real_itl}, {"ttft": sim_ttft, "itl": sim_itl})
        if mode == arrival_modes[0]:
            rows += alone_rows
        print(f"\narrivals: {mode}, {len(real_ttft)} requests")
        print(f"{'metric':<16}{'real ms':>10}{'sim ms':>10}{'sim/real':>10}  within 20%")
        for r in rows:
            print(f"{r['metric']:<16}{r['real_ms']:>10.1f}{r['sim_ms']:>10.1f}{r['ratio']:>10.2f}  "
                  f"{'yes' if r['within'] else 'NO'}")
        entry = {"rows": rows, "errors": errors, "mean_ttft_seen_by": means}
        if flex:
            sim_drain = sim_drains[0] if sim_drains else None
            real_end = flex_real["flipped"] if flex_real["flipped"] is not None else switch_at
            sim_end = sim_switch + (sim_drain or 0.0)
            drain_start, drain_end = switch_at - args.drain_window, max(real_end, sim_end, switch_at)
            real_ph, sim_ph = phases(records, drain_start, drain_end), phases(sim_records, drain_start, drain_end)
            p_rows = phase_rows(real_ph, sim_ph)
            print(f"\nflex worker prefill -> decode, the switch written at {switch_at:.2f} s; phases by arrival: "
                  f"before {drain_start:.2f} s, 'drain' to {drain_end:.2f} s (what is in flight when the switch "
                  f"comes, and the drain), after")
            print(f"{'metric':<20}{'n':>5}{'real ms':>10}{'sim ms':>10}{'sim/real':>10}  within 20%")
            for p in PHASES:
                if not any(r["phase"] == p for r in p_rows):
                    print(f"{p}: too few requests on one side (real {len(real_ph[p]['ttft'])}, "
                          f"simulated {len(sim_ph[p]['ttft'])})")
            for r in p_rows:
                print(f"{r['metric']:<20}{r['n']:>5}{r['real_ms']:>10.1f}{r['sim_ms']:>10.1f}{r['ratio']:>10.2f}  "
                      f"{'yes' if r['within'] else 'NO'}")
            drain_row = None
            if flex_real["drain"] is not None and sim_drain is not None:
                drain_row = within(flex_real["drain"], sim_drain)
                print(f"{'drain':<20}{'':>5}{drain_row['real_ms']:>10.1f}{drain_row['sim_ms']:>10.1f}"
                      f"{drain_row['ratio']:>10.2f}  {'yes' if drain_row['within'] else 'NO'}")
            else:
                print(f"drain: real {flex_real['drain']}, simulated {sim_drain} (one side did not switch)")
            print(f"  the router saw the switch at {sim_switch:.2f} s (written {flex_real['written']:.2f} s), served "
                  f"decode by {real_end:.2f} s; the simulator switched at {sim_switch:.2f} s, served decode at "
                  f"{sim_end:.2f} s")
            entry.update(phase_rows=p_rows, switch={**flex_real, "sim_switch": sim_switch, "sim_drain": sim_drain,
                                                    "drain_start": drain_start, "drain_end": drain_end,
                                                    "drain_row": drain_row})
        else:
            drift = {}
            for label in ("before", "after"):
                d_ttft, d_itl, _ = simulate(t_mode, role_models(model, *profiles[label]), mbt)
                drift[label] = {"ttft_p50": _pct(d_ttft, 50) / _pct(real_ttft, 50), "itl_p50": _pct(d_itl, 50) / _pct(real_itl, 50)}
            print("  sim / real with one profile alone: " + "; ".join(
                f"{k}: TTFT p50 {v['ttft_p50']:.2f}, ITL p50 {v['itl_p50']:.2f}" for k, v in drift.items()))
            entry["one_profile"] = drift
        real_pos, sim_pos = by_position(arrivals), by_position(sim_arrivals)
        if mode == "trace":
            print("TTFT p50 by position in its burst (requests that arrived at the same instant, fastest first), "
                  "real / sim ms: " + ", ".join(f"#{k} {real_pos[k] * 1000:.0f} / {sim_pos.get(k, math.nan) * 1000:.0f}"
                                                for k in real_pos))
        entry["ttft_by_position"] = {"real": real_pos, "sim": sim_pos}
        report["replays"][mode] = entry
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
