"""spec.router.processes: two real router processes on one port (``python -m disagg.router --processes 2``,
as the operator runs a router pod), over tests/sse_upstream.py. Each process is scraped on its own metrics
port; the two scrapes together count every request sent, whichever process the kernel gave it to. The
parent stops both on SIGTERM, and when one process dies the parent stops the other and exits non-zero; when
one hangs (SIGSTOP: alive, not answering), the parent finds it by its own /livez and does the same."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from disagg.api import metrics as m
from disagg.e2e.testing import wait_for
from disagg.workers.local import LocalProcess, free_port, metric_sum, router, scrape

PROCESSES = 2
REQUESTS = 60
TOKENS = 4


def _consecutive_free_ports(n: int) -> int:
    """A port p with p..p+n-1 all free now (the metrics ports are the base + the process index)."""
    for _ in range(50):
        base = free_port()
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


@pytest.fixture
def two_processes(tiny_model, tmp_path):
    yield from _two_processes(tiny_model, tmp_path)


def _two_processes(tiny_model, tmp_path, *args: str):
    up_port, port, metrics = free_port(), free_port(), _consecutive_free_ports(PROCESSES)
    upstream = LocalProcess("upstream", [sys.executable, str(Path(__file__).with_name("sse_upstream.py")),
                                         str(up_port), str(TOKENS), "0.001"], {},
                            f"http://127.0.0.1:{up_port}", tmp_path).start()
    cfg = {"model": "tiny", "tokenizer": tiny_model, "block_size": 16, "port": port, "host": "127.0.0.1",
           "metrics_port": metrics, "spec": {"disaggregation": "never", "processes": PROCESSES, "maxInFlight": 9},
           "decode": [{"url": upstream.url}]}
    (tmp_path / "router.json").write_text(json.dumps(cfg))
    r = router(tmp_path / "router.json", port, tmp_path)
    r.argv += args
    r.start()
    try:
        upstream.wait_ready(timeout=60)
        r.wait_ready(timeout=120)
        urls = [f"http://127.0.0.1:{metrics + i}" for i in range(PROCESSES)]
        for u in urls:      # every process up (the serving port answers as soon as one is)
            wait_for(lambda u=u: _live(u), timeout=120, what=f"router process at {u}")
        yield r, urls
    finally:
        r.stop()
        upstream.stop()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def _flag(pid: int, flag: str) -> str:
    """The value a process was given for ``flag`` last (argparse's rule: the last one wins)."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    return argv[len(argv) - 1 - argv[::-1].index(flag) + 1]


def _running(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _live(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/livez", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _complete(url: str, i: int) -> str:
    body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": TOKENS, "stream": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "Connection": "close"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return resp.read().decode()


def test_two_processes_on_one_port_are_counted_in_full_across_their_metrics_ports(two_processes):
    r, urls = two_processes
    # a new connection per request (Connection: close), so the kernel spreads them over both processes
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: _complete(r.url, i), range(REQUESTS)))
    assert all(a.rstrip().endswith("data: [DONE]") for a in answers)
    pages = [scrape(u) for u in urls]
    per_process = [metric_sum(p, m.ROUTER_REQUESTS) for p in pages]
    # each scrape is one process's own count: together, every request once
    assert sum(per_process) == REQUESTS, per_process
    assert all(n > 0 for n in per_process), per_process     # the kernel spread them (60 connections)
    assert sum(p.get(f'{m.ROUTER_REQUESTS}{{outcome="success",path="{m.PATH_LOCAL_PREFILL}"}}', 0)
               for p in pages) == REQUESTS
    # maxInFlight 9 divided between 2 processes, rounded up
    children = _children(r.proc.pid)
    assert len(children) == PROCESSES
    assert [_flag(c, "--max-in-flight") for c in children] == ["5", "5"]

    # one process dies: the parent stops the other and exits non-zero (the kubelet restarts the pod)
    os.kill(children[0], signal.SIGKILL)
    wait_for(lambda: r.proc.poll() is not None, timeout=120, what="the parent to exit")
    assert r.proc.returncode != 0
    assert not any(_running(c) for c in children)


def test_sigterm_stops_every_process_cleanly(two_processes):
    r, _ = two_processes
    children = _children(r.proc.pid)
    assert len(children) == PROCESSES
    r.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: r.proc.poll() is not None, timeout=120, what="the parent to exit")
    assert r.proc.returncode == 0
    # the parent returns only after it has reaped both
    assert not any(_running(c) for c in children)


LIVENESS_S = 5


@pytest.fixture
def watched(tiny_model, tmp_path):
    yield from _two_processes(tiny_model, tmp_path, "--process-liveness-seconds", str(LIVENESS_S))


def test_a_hung_process_is_found_by_the_parent_and_the_replica_exits_non_zero(watched):
    """The pod's liveness probe reaches one process through the shared port; a hung one among N would keep
    its share of the connections unanswered. The parent asks each on its own metrics port."""
    r, urls = watched
    children = _children(r.proc.pid)
    assert len(children) == PROCESSES
    # the parent checks a process from its first answer on (before that, start-up may take minutes)
    for c in children:
        wait_for(lambda c=c: f"router process {c} answers" in r.tail(10**6), timeout=120,
                 what=f"the parent to see process {c} answer")
    hung = children[1]
    os.kill(hung, signal.SIGSTOP)
    try:
        wait_for(lambda: r.proc.poll() is not None, timeout=120, what="the parent to find the hung process and exit")
        assert r.proc.returncode != 0
        assert f"router process {hung} has not answered" in r.tail(10**6)
        assert not any(_running(c) for c in children)
    finally:
        try:
            os.kill(hung, signal.SIGCONT)      # a stopped process left behind would never end
        except ProcessLookupError:
            pass
