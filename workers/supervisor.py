"""Runs vLLM for one worker and drains it on SIGTERM.

vLLM's own graceful shutdown does the draining (``--shutdown-timeout``: stop
taking new requests, let in-flight ones finish, then abort the rest); the
supervisor forwards the signal, waits, and escalates to SIGKILL only after the
grace period: the drain plus ``DRAIN_MARGIN_SECONDS``, which is what the pod's
``terminationGracePeriodSeconds`` adds to the drain too (``disagg.api.contract``).
KV a prefill produced stays pinned until the decode pulls it or its lease
(``kv_lease_seconds``) expires, inside vLLM's NixlConnector.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from disagg import redact
from disagg.api.contract import DRAIN_MARGIN_SECONDS

from .command import Command


def log(event: str, **fields) -> None:
    print(json.dumps({"ts": round(time.time(), 3), "component": "worker", "event": event, **fields}),
          file=sys.stderr, flush=True)


def run(cmd: Command, drain_seconds: int) -> int:
    env = {**os.environ, **cmd.env}
    proc = subprocess.Popen(cmd.argv, env=env)
    # engine args may carry --api-key and the like: logged masked (disagg.redact)
    log("started", pid=proc.pid, argv=redact.argv(cmd.argv))
    deadline: list[float] = []

    def on_signal(signum, _frame):
        if not deadline:
            log("draining", signal=signal.Signals(signum).name, grace_seconds=drain_seconds)
            deadline.append(time.monotonic() + drain_seconds + DRAIN_MARGIN_SECONDS)
            proc.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while True:
        try:
            code = proc.wait(timeout=1)
            break
        except subprocess.TimeoutExpired:
            if deadline and time.monotonic() > deadline[0]:
                log("killing", reason="grace period over")
                proc.kill()
    log("exited", code=code)
    return code if code >= 0 else 128 - code
