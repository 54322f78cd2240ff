"""A non-leader pod finds its replica's leader before vLLM starts.

vLLM binds and connects its ZMQ and torch.distributed sockets with the leader's address, and ZMQ does not
resolve names (kserve#5155), while a pod's name only resolves once the pod runs and its headless Service
has it. Peers' users know what happens otherwise: every worker pod crash-loops on DNS until the leader is
up, the group restarts as a whole, and it never settles (aws-do-eks#62, kthena#487). So the supervisor
resolves the leader's name itself, waiting (and saying so) as long as the pod's startup probe allows,
and hands vLLM the IP.
"""

from __future__ import annotations

import ipaddress
import socket
import sys
import time
from collections.abc import Callable

from .command import LEADER_ADDRESS_FLAGS

# As long as a worker pod's startup probe lets it start (operator/render.py: 180 x 10 s): a leader that is
# not there by then is a replica the operator recreates as a whole.
LEADER_WAIT_SECONDS = 1800
# How long a non-leader pod's preStop waits for its leader to go: the leader's whole drain (contract's
# grace, its preStop sleep and vLLM's drain) fits in the pod's grace period, which bounds this anyway.
LEADER_DRAIN_WAIT_SECONDS = 600


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return False


def resolve(name: str, timeout: float, interval: float = 1.0,
            log: Callable[..., None] | None = None) -> str:
    """The IPv4 or IPv6 address ``name`` resolves to, waiting up to ``timeout`` seconds for it to exist."""
    if _is_ip(name):
        return name
    deadline = time.monotonic() + timeout
    waited_since = time.monotonic()
    while True:
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
            return sorted({i[4][0] for i in infos})[0]
        except socket.gaierror as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the replica's leader {name} did not resolve within {timeout:.0f} s "
                                   f"(last: {e})") from None
            if log and time.monotonic() - waited_since >= 10:
                log("waiting-for-leader", leader=name, waited_s=round(time.monotonic() - waited_since))
                waited_since = time.monotonic()
            time.sleep(interval)


def resolve_leader_flags(engine_args: list[str], timeout: float,
                         log: Callable[..., None] | None = None) -> list[str]:
    """``engine_args`` with the value of each leader-address flag resolved to an IP."""
    out = list(engine_args)
    for i, arg in enumerate(out):
        name, eq, value = arg.partition("=")
        if name not in LEADER_ADDRESS_FLAGS:
            continue
        if eq:
            out[i] = f"{name}={resolve(value, timeout, log=log)}"
        elif i + 1 < len(out):
            out[i + 1] = resolve(out[i + 1], timeout, log=log)
    return out


def wait_gone(host: str, port: int, timeout: float, interval: float = 1.0) -> bool:
    """Wait until the leader no longer takes connections on ``port`` (its engine drained and exited, or its
    pod is gone and its name with it); True if it went within ``timeout``. A non-leader pod's preStop runs
    this: its ranks must outlive the leader's drain, as the leader's engine computes with them."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(interval * 2, 5)):
                pass
        except OSError:
            return True
        time.sleep(interval)
    return False


def main(argv: list[str]) -> int:
    """``wait-gone HOST PORT [TIMEOUT]``: the preStop of a replica's non-leader pods (operator/render.py).
    Always exits 0: the kubelet stops the pod after the hook either way, the grace period bounds it."""
    if len(argv) < 3 or argv[0] != "wait-gone":
        print("usage: python -m disagg.workers.leader wait-gone HOST PORT [TIMEOUT]", file=sys.stderr)
        return 2
    timeout = float(argv[3]) if len(argv) > 3 else LEADER_DRAIN_WAIT_SECONDS
    gone = wait_gone(argv[1], int(argv[2]), timeout)
    print(f"leader {argv[1]}:{argv[2]} {'gone' if gone else f'still serving after {timeout:.0f} s'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
