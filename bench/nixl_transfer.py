"""NIXL bytes/s of a KV-sized transfer between two processes vs a plain memory copy of the same size.

Two processes each create a NIXL agent (UCX backend) and register a host buffer; the initiator READs
the target's buffer (as vLLM's decode pulls prefill KV), repeated, and checks the bytes arrived.
The baseline is an in-process copy of the same size (torch copy_, i.e. memcpy) in the same run.
Runs in the worker environment (NIXL, torch):

    $(bash workers/env/build.sh)/bin/python -P bench/nixl_transfer.py [--mib 64] [--iters 20]

UCX_TLS defaults to tcp,self,sm here (on CPU, shared memory alone fails with "Destination is
unreachable"); set it to compare transports.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

os.environ.setdefault("UCX_TLS", "tcp,self,sm")


def target(conn, nbytes: int) -> None:
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("target", nixl_agent_config(backends=["UCX"]))
    buf = torch.arange(nbytes // 4, dtype=torch.int32)
    agent.register_memory(buf)
    conn.send((agent.get_agent_metadata(), agent.get_serialized_descs(agent.get_xfer_descs(buf))))
    conn.recv()           # the initiator is done
    conn.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    nbytes = args.mib * 2**20

    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, nbytes))
    proc.start()
    meta, remote_descs_blob = parent.recv()

    agent = nixl_agent("initiator", nixl_agent_config(backends=["UCX"]))
    local = torch.zeros(nbytes // 4, dtype=torch.int32)
    agent.register_memory(local)
    remote_name = agent.add_remote_agent(meta)
    remote_descs = agent.deserialize_descs(remote_descs_blob)
    local_descs = agent.get_xfer_descs(local)

    def read_once() -> float:
        handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote_name, b"x")
        t0 = time.perf_counter()
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        elapsed = time.perf_counter() - t0
        if state != "DONE":
            raise RuntimeError(f"NIXL transfer failed: {state}")
        agent.release_xfer_handle(handle)
        return elapsed

    read_once()                                  # connection set-up
    nixl_times = sorted(read_once() for _ in range(args.iters))
    assert torch.equal(local, torch.arange(nbytes // 4, dtype=torch.int32)), "bytes did not arrive intact"
    src, dst = torch.arange(nbytes // 4, dtype=torch.int32), torch.empty(nbytes // 4, dtype=torch.int32)
    dst.copy_(src)
    copy_times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        dst.copy_(src)
        copy_times.append(time.perf_counter() - t0)
    copy_times.sort()
    parent.send("done")
    proc.join(30)

    nixl_rate = nbytes / nixl_times[len(nixl_times) // 2]
    copy_rate = nbytes / copy_times[len(copy_times) // 2]
    print(f"{args.mib} MiB x {args.iters}, UCX_TLS={os.environ['UCX_TLS']}")
    print(f"NIXL READ between processes: {nixl_rate / 2**30:.2f} GiB/s (median)")
    print(f"memory copy in one process:  {copy_rate / 2**30:.2f} GiB/s (median)")
    print(f"ratio NIXL / copy: {nixl_rate / copy_rate:.3f}")


if __name__ == "__main__":
    main()
