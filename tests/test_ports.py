"""Ports for local processes (disagg.workers.ports): outside the kernel's ephemeral range, reserved
between this project's processes until the one that chose them exits, never a port in use."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from disagg.workers import ports
from disagg.workers.local import free_port


class _Picks:
    """Stands in for the chooser's random source: the given ports first, in order, then any."""

    def __init__(self, wanted: list[int]):
        self.indexes, self.rest = [_index(p) for p in wanted], ports._random

    def randrange(self, total: int) -> int:
        return self.indexes.pop(0) if self.indexes else self.rest.randrange(total)


def _index(port: int) -> int:
    offset = 0
    for r in ports._ranges():
        if port in r:
            return offset + r.index(port)
        offset += len(r)
    raise AssertionError(f"{port} is in none of {ports._ranges()}")


def test_ports_come_from_outside_the_ephemeral_and_nodeport_ranges_and_never_repeat():
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    assert ports._ranges(), "no room outside the ephemeral range on this machine"
    chosen = [free_port() for _ in range(200)]
    assert len(set(chosen)) == len(chosen)
    assert not [p for p in chosen if low <= p <= high or p in ports._NODE_PORTS or p < 1024]


def test_a_port_reserved_by_another_process_is_not_given_until_that_process_exits(monkeypatch):
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom disagg.workers.ports import free_port\n"
         "print(*[free_port() for _ in range(20)], flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tempfile.gettempdir())
    try:
        theirs = [int(p) for p in child.stdout.readline().split()]
        assert len(theirs) == 20
        monkeypatch.setattr(ports, "_random", _Picks(theirs))
        assert free_port() not in theirs           # every one of theirs was offered first and refused
    finally:
        child.stdin.close()
        child.wait(60)
    # the kernel dropped the dead process's locks: each of its ports can be reserved again
    fd = ports._lock_fd()
    for p in theirs:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, p, os.SEEK_SET)
        fcntl.lockf(fd, fcntl.LOCK_UN, 1, p, os.SEEK_SET)


def test_a_port_something_listens_on_is_passed_over(monkeypatch):
    taken = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))     # a process outside the project, with a fixed port
        s.listen()
        # as if no process of ours had reserved it
        ports._handed_out.discard(taken)
        fcntl.lockf(ports._lock_fd(), fcntl.LOCK_UN, 1, taken, os.SEEK_SET)
        monkeypatch.setattr(ports, "_random", _Picks([taken]))
        assert free_port() != taken
