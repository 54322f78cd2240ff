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

Liveness of each process: the pod's liveness probe reaches the shared port, so it reaches whichever
process the kernel picks, and a process that hangs (alive, not answering: a stuck event loop, SIGSTOP)
would keep its share of connections unanswered without the kubelet ever noticing. So the parent asks every
process for ``/livez`` on its own metrics port every few seconds (a thread; the main thread waits for
exits). A process that has not answered for ``--process-liveness-seconds`` (60, as long as the kubelet's
probe allows the whole replica: 6 x 10 s) is killed (SIGKILL also ends a stopped process), and the parent
then does what it does for any process that exits: stops the others and exits non-zero, so the kubelet
restarts the container. Checked from a process's first answer on (or after ``STARTUP_S`` without one:
loading the tokenizer on a busy node takes a while), and no longer once the replica is stopping (a
draining process closes its ports). Without ``--metrics-port`` there is nothing to ask, and no check.

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
import threading
import time
import urllib.request

log = logging.getLogger("disagg.router.processes")

_PR_SET_PDEATHSIG = 1
# a child that does not stop this long after SIGTERM is killed: as long as one router's own shutdown
# may take (aiohttp's) plus a margin
STOP_GRACE_S = 70.0
# how long a process may not answer /livez before the replica restarts (the flag's default), and how long a
# process that has never answered yet may take to start (the tokenizer's load on a busy node)
LIVENESS_S = 60.0
STARTUP_S = 300.0


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


def _local(host: str) -> str:
    """Where this host reaches a process listening on ``host``."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else f"[{host}]" if ":" in host else host


def _answers(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (OSError, ValueError):       # refused, reset, timed out (a stopped process accepts, never answers)
        return False


def watch_liveness(children: list[subprocess.Popen], urls: list[str], limit_s: float,
                   stopping: threading.Event, startup_s: float = STARTUP_S) -> None:
    """Kills the first process that has not answered /livez at ``urls[i]`` for ``limit_s`` (``startup_s``
    before its first answer); returns then, or once ``stopping`` is set. The parent's main loop sees the
    exit and stops the replica."""
    interval = min(max(limit_s / 6, 0.5), 10.0)       # the kubelet's rhythm: 6 probes a period
    started = time.monotonic()
    last_ok: list[float | None] = [None] * len(children)
    while not stopping.wait(interval):
        for i, (child, url) in enumerate(zip(children, urls)):
            # returncode, not poll(): only the main thread reaps (a child reaped here would never be
            # seen exiting there)
            if stopping.is_set() or child.returncode is not None:
                continue
            now = time.monotonic()
            if _answers(url, timeout=interval):
                if last_ok[i] is None:
                    log.info("router process %d answers %s: restarted if it stops answering for %g s",
                             child.pid, url, limit_s)
                last_ok[i] = time.monotonic()
                continue
            since = last_ok[i] if last_ok[i] is not None else started
            allowed = limit_s if last_ok[i] is not None else max(startup_s, limit_s)
            if now - since > allowed and not stopping.is_set():
                log.error("router process %d has not answered %s for %.0f s (hung): killing it, and with it "
                          "the replica", child.pid, url, now - since)
                try:
                    os.kill(child.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                return


def supervise(argv: list[str], processes: int, max_in_flight: int, max_queued: int,
              metrics_port: int | None, liveness_s: float = LIVENESS_S, host: str = "127.0.0.1") -> int:
    children = [subprocess.Popen(child_argv(argv, i, processes, max_in_flight, max_queued, metrics_port),
                                 start_new_session=True, preexec_fn=_die_with_parent)
                for i in range(processes)]
    log.info("started %d router processes: %s", processes, [c.pid for c in children])
    stopping = False
    stop_watching = threading.Event()
    if metrics_port is not None:
        threading.Thread(target=watch_liveness, name="liveness", daemon=True,
                         args=(children, [f"http://{_local(host)}:{metrics_port + i}/livez" for i in range(processes)],
                               liveness_s, stop_watching)).start()

    def forward(signum, _frame):
        nonlocal stopping
        stopping = True
        stop_watching.set()
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
