"""TCP ports for processes started on this machine (tests, benchmarks, `disagg serve --local`).

A vLLM worker's ports (HTTP, NIXL side channel, KV events, KV replay) are chosen before it starts and
bound by vLLM minutes later on a loaded machine; the router is told them up front, so the process that
binds cannot pick its own (vLLM does not report a port it chose), and a port cannot be held open for
it (vLLM's sockets set no SO_REUSEPORT). The old way, binding to port 0 and closing, handed out a port
from the kernel's ephemeral range: until vLLM bound it, any outgoing connection on the machine could
take it as its source port, and any other bind(0) could get it too. That is how a worker died with
"Address already in use" on its KV replay port after a 4-minute start-up.

So ports come from outside the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``; also
outside Kubernetes' NodePort range), where the kernel never puts a port on its own, and each is
reserved among this project's processes by a POSIX byte-range lock at the port's offset in one lock
file in the temporary directory: held by the process that chose it until that process exits (the
kernel drops the locks of a dead process, so nothing stale stays), never handed out twice by one
process. A port is taken only if it can be bound right now (something with a fixed port is running).
Where the lock file or the range is not usable, it falls back to the kernel's choice (bind to 0).

That covers every TCP port a local vLLM worker binds: vLLM 0.32 here picks none of its own (its
distributed init is a file store, its engine sockets ipc:// paths; only data parallel or a TCP store
would take ports from vLLM's own bind(0)). So no restart on "Address already in use" either, which
would also hide a regression in this module.
"""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import threading
from pathlib import Path

_NODE_PORTS = range(30000, 32768)      # Kubernetes' default NodePort range: kube-proxy may hold these
_LOWEST = 10000                        # below: well-known and registered services
_LOCK_NAME = "disagg-ports.lock"

_lock = threading.Lock()
_fd: int | None = None
_handed_out: set[int] = set()
_random = random.Random(os.urandom(16))     # not the global one: pytest-randomly reseeds that per test


def _ranges() -> list[range]:
    """Ports the kernel never hands out by itself: below and above its ephemeral range."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return []
    ranges = [range(_LOWEST, min(low, _NODE_PORTS.start)), range(max(high + 1, _NODE_PORTS.stop), 65536)]
    return [r for r in ranges if len(r) >= 1000]


def _lock_fd() -> int | None:
    """The lock file, opened once per process: closing any descriptor of it would drop all of this
    process's locks on it (POSIX record-lock semantics)."""
    global _fd
    if _fd is None:
        path = Path(tempfile.gettempdir()) / _LOCK_NAME
        try:
            _fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            return None
        try:
            os.fchmod(_fd, 0o666)       # every user's processes reserve in the same file
        except OSError:
            pass                        # another user's file, already shared
    return _fd


def _bindable(port: int) -> bool:
    # the wildcard address: it conflicts with a socket bound to any address on that port, as the
    # workers' ZMQ sockets (tcp://*:port) would; no SO_REUSEADDR: a port in TIME_WAIT is passed over
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _ephemeral() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port() -> int:
    """A TCP port that no other process of this project is given and the kernel does not hand out as
    an ephemeral port, free now; reserved until this process exits."""
    with _lock:
        ranges, fd = _ranges(), _lock_fd()
        if not ranges or fd is None:
            return _ephemeral()
        total = sum(len(r) for r in ranges)
        for _ in range(1000):
            i = _random.randrange(total)
            for r in ranges:
                if i < len(r):
                    port = r[i]
                    break
                i -= len(r)
            if port in _handed_out:
                continue
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, port, os.SEEK_SET)
            except OSError:
                continue                # another process of ours has it
            if not _bindable(port):
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, port, os.SEEK_SET)
                continue
            _handed_out.add(port)
            return port
        return _ephemeral()
