"""Several router processes on one port (``spec.router.processes``, ``--processes N``).

One Python process runs one event loop, about one core: past a few hundred streams the router is
CPU-bound there (router/README, "Several router processes on one port"). So a replica may run N
processes sharing its serving port (SO_REUSEPORT: the kernel spreads new connections over them).

How they run: this parent starts N children (``python -m disagg.router`` again, fresh processes
rather than forks of a process that already holds threads and sockets), each with ``--reuse-port``,
its own metrics port (``--metrics-port`` + i: a scrape of the shared port would reach one process),
and its share of ``maxInFlight`` and ``maxQueued``. The parent serves nothing itself. It forwards
SIGTERM and SIGINT to every child (each drains as a single router does) and waits for them; when a
child exits on its own, the parent stops the others and exits non-zero, so the kubelet restarts the
container as a whole rather than leaving a replica serving with fewer processes than it says.
Children run in their own sessions (a terminal's Ctrl-C reaches them once, through the parent) and
get SIGTERM from the kernel if the parent dies without forwarding (PR_SET_PDEATHSIG).

What each process knows: its own requests (load, admission), its own health probes, and the whole
prefix index (every process subscribes to every worker's KV events): what separate replicas know.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import signal
import subprocess
import sys
import time

log = logging.getLogger("disagg.router.processes")

_PR_SET_PDEATHSIG = 1
# a child that does not stop this long after SIGTERM is killed: as long as one router's own shutdown
# may take (aiohttp's) plus a margin
STOP_GRACE_S = 70.0


def share(total: int, processes: int) -> int:
    """One process's part of a replica-wide bound: rounded up, so the replica admits at least ``total``
    (the kernel spreads connections by hash, not by load, so one process may fill while another has room)."""
    return max(1, math.ceil(total / processes))


def child_argv(argv: list[str], index: int, processes: int, max_in_flight: int, max_queued: int,
               metrics_port: int | None) -> list[str]:
    """The parent's own arguments plus what makes a child one of ``processes`` (argparse: the last of a
    repeated flag wins, so these override the parent's)."""
    extra = ["--processes", "1", "--reuse-port",
             "--max-in-flight", str(share(max_in_flight, processes)),
             "--max-queued", str(math.ceil(max_queued / processes))]
    if metrics_port is not None:
        extra += ["--metrics-port", str(metrics_port + index)]
    return [sys.executable, "-P", "-m", "disagg.router", *argv, *extra]


def _die_with_parent() -> None:
    # runs in the child between fork and exec; the parent has started no thread yet
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(argv: list[str], processes: int, max_in_flight: int, max_queued: int,
              metrics_port: int | None) -> int:
    children = [subprocess.Popen(child_argv(argv, i, processes, max_in_flight, max_queued, metrics_port),
                                 start_new_session=True, preexec_fn=_die_with_parent)
                for i in range(processes)]
    log.info("started %d router processes: %s", processes, [c.pid for c in children])
    stopping = False

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        for c in children:
            if c.poll() is None:
                c.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    worst = 0
    while any(c.returncode is None for c in children):
        try:
            pid, status = os.wait()
        except ChildProcessError:
            break
        child = next((c for c in children if c.pid == pid), None)
        if child is None:
            continue
        child.returncode = os.waitstatus_to_exitcode(status)
        if not stopping:
            log.error("router process %d exited with %s: stopping the others", pid, child.returncode)
            worst = child.returncode or 1
            forward(signal.SIGTERM, None)
            _reap(children, STOP_GRACE_S)
            break
        worst = worst or child.returncode
    return worst


def _reap(children: list[subprocess.Popen], grace: float) -> None:
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
