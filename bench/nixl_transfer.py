"""NIXL READ between two processes on one host, per UCX transport set (UCX_TLS), as ratios against
TCP measured in the same run; and whether a read completes while the target process is frozen.

Two processes each create a NIXL agent (UCX backend) and register a host buffer; the initiator READs
the target's buffer (as vLLM's decode pulls prefill KV), repeated, and checks the bytes arrived. Then
it SIGSTOPs the target and reads once more: a transport that reads without the remote side's help
(cross-memory attach: process_vm_readv) completes; TCP, where UCX emulates a read with messages the
target must answer, waits until the target runs again. A draining vLLM prefill whose engine is idle
is such a target (README, workers). Each transport set runs in its own processes (UCX reads UCX_TLS
once), the sets interleaved over --rounds; an in-process memory copy of the same size is printed as
a ceiling. Runs in the worker environment (NIXL, torch):

    $(bash workers/env/build.sh)/bin/python -P bench/nixl_transfer.py [--mib 64] [--iters 20] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time

# "tcp" first: the baseline. NIXL asks UCX for peer-failure handling, which only tcp offers for
# active messages (sm or cma alone: "no active messages transport ... Destination is unreachable"),
# so every set keeps tcp; what differs is the transport UCX picks for the READ itself.
TRANSPORTS = ["tcp", "tcp,self,posix,sysv", "tcp,self,cma", "tcp,self,sm"]
FROZEN_WAIT_S = 5.0     # how long a read from a frozen target may take before it counts as waiting


def target(conn, nbytes: int) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    buf = torch.arange(nbytes // 4, dtype=torch.int32)
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), agent.get_serialized_descs(agent.get_xfer_descs(buf))))
    conn.recv()           # the initiator is done
    conn.close()


def one(nbytes: int, iters: int) -> dict:
    """One transport set (this process's UCX_TLS): median READ rate, memcpy rate, frozen-target read."""
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    torch.set_num_threads(1)                     # the copy baseline on one core, as a read runs
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, nbytes))
    proc.start()
    meta, remote_descs_blob = parent.recv()

    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    local = torch.zeros(nbytes // 4, dtype=torch.int32)
    expected = torch.arange(nbytes // 4, dtype=torch.int32)
    agent.register_memory(local)
    remote_name = agent.add_remote_agent(meta)
    remote_descs = agent.deserialize_descs(remote_descs_blob)
    local_descs = agent.get_xfer_descs(local)

    def read_once(deadline: float | None = None) -> tuple[float, bool]:
        """Seconds the read took, and whether it finished before ``deadline`` (then it is waited out)."""
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote_name, b"x")
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        in_time = True
        while state == "PROC":
            if deadline is not None and in_time and time.perf_counter() > deadline:
                in_time = False
                os.kill(proc.pid, signal.SIGCONT)    # let the target answer, so the read can end
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer failed: {state}")
        agent.release_xfer_handle(handle)
        return elapsed, in_time

    read_once()                                  # connection set-up
    nixl_times = sorted(read_once()[0] for _ in range(iters))
    assert torch.equal(local, expected), "bytes did not arrive intact"

    local.zero_()
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        frozen_s, frozen_done = read_once(deadline=time.perf_counter() + FROZEN_WAIT_S)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    assert torch.equal(local, expected), "bytes read from the frozen target did not arrive intact"

    src, dst = expected, torch.empty_like(expected)
    dst.copy_(src)
    copy_times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_times.append(time.perf_counter() - t0)
    parent.send("done")
    proc.join(30)
    return {"tls": os.environ.get("UCX_TLS", ""), "read_Bps": nbytes / statistics.median(nixl_times),
            "copy_Bps": nbytes / statistics.median(copy_times),
            "frozen_done": frozen_done, "frozen_s": frozen_s if frozen_done else None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transports", default=";".join(TRANSPORTS),
                    help="UCX_TLS values separated by ';', the first one the baseline")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: this UCX_TLS only
    args = ap.parse_args()
    nbytes = args.mib * 2**20
    if args.one:
        print(json.dumps(one(nbytes, args.iters)))
        return

    sets = args.transports.split(";")
    runs: dict[str, list[dict]] = {t: [] for t in sets}
    for r in range(args.rounds):
        for tls in sets:                         # interleaved: load on a shared host hits every set
            out = subprocess.run([sys.executable, "-P", __file__, "--one", "--mib", str(args.mib),
                                  "--iters", str(args.iters)], env={**os.environ, "UCX_TLS": tls},
                                 capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise SystemExit(f"UCX_TLS={tls} failed:\n{out.stderr[-2000:]}")
            runs[tls].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1}/{args.rounds} UCX_TLS={tls}: done", file=sys.stderr)

    base = statistics.median(x["read_Bps"] for x in runs[sets[0]])
    print(f"{args.mib} MiB READ x {args.iters} per run, {args.rounds} rounds (medians); "
          f"frozen target: READ while the target is SIGSTOPped, waited {FROZEN_WAIT_S:.0f} s")
    print(f"| UCX_TLS | READ GiB/s | vs {sets[0]} | vs memcpy | read from a frozen target |")
    print("|---|---|---|---|---|")
    for tls in sets:
        rs = runs[tls]
        rate = statistics.median(x["read_Bps"] for x in rs)
        copy = statistics.median(x["copy_Bps"] for x in rs)
        done = sum(x["frozen_done"] for x in rs)
        frozen = f"completed {done}/{len(rs)}"
        if done:
            took = statistics.median(x["frozen_s"] for x in rs if x["frozen_done"])
            frozen += f" (median {took * 1e3:.0f} ms)"
        if done < len(rs):
            frozen += f", waited for the target {len(rs) - done}/{len(rs)}"
        print(f"| `{tls}` | {rate / 2**30:.2f} | {rate / base:.2f} | {rate / copy:.2f} | {frozen} |")


if __name__ == "__main__":
    main()
