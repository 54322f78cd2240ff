"""Prefill scale-down must not break in-flight KV reads (real vLLM CPU build, real NIXL): SIGTERM lands
after a prefill and before its decode pulled the blocks; the worker stops taking work but holds those
blocks (vLLM keeps a request whose KV awaits a remote reader as engine work) until they are read, then
exits cleanly. Its own prefill/decode pair: on two cores a vLLM started while two others run can take
minutes to get scheduled, so no test here restarts a worker."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest

from disagg.api import metrics as m
from disagg.e2e.testing import wait_for
from disagg.router.service import REMOTE_DECODE
from disagg.workers.command import build
from disagg.workers.local import cpu_settings, metric_sum, scrape, wait_metric, worker

PROMPT = "The quick brown fox jumps over the lazy dog " * 6     # several full 32-token blocks
# the prefill's kv_lease_seconds: long enough that on a loaded host the read lands inside it (a
# lease that ran out fails the test below, which then takes up to this long)
LEASE = 120


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture
def pair(tiny_model, worker_python, tmp_path):
    settings = cpu_settings("prefill", tiny_model, "0", drain_seconds=LEASE + 30, kv_lease_seconds=LEASE)
    procs = {"prefill": worker("prefill", settings, worker_python, tmp_path),
             "decode": worker("decode", cpu_settings("decode", tiny_model, "1"), worker_python, tmp_path)}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_ready()
        yield {**procs, "settings": settings}
    finally:
        for p in procs.values():
            p.stop()


def _remote_prefill(prefill, body: dict) -> dict:
    return _post(f"{prefill.url}/v1/completions",
                 {**body, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE})["kv_transfer_params"]


def _log_once(proc, text: str) -> str:
    """The worker's log once it contains ``text``; the worker must stay up meanwhile."""
    def check() -> str:
        log = proc.log_path.read_text(errors="replace")
        assert text in log or proc.proc.poll() is None, f"{proc.name} exited before {text!r}:\n{proc.tail()}"
        return log if text in log else ""
    return wait_for(check, timeout=120, what=f"{proc.name} to log {text!r}")


# vLLM's engine (v1/engine/core.py): on SIGTERM with a shutdown timeout it logs DRAIN_STARTED and, in
# the same call, TEARDOWN at once when it has no work left; KV awaiting a remote reader is work
# (NixlConnector's pending sends), so TEARDOWN follows only the decode's read or the lease's end
DRAIN_STARTED = "[shutdown] EngineCore: start mode=drain"
TEARDOWN = "[shutdown] EngineCore: request processing complete"
LEASE_EXPIRED = "Releasing expired KV blocks"      # NixlConnector, when nobody read them in time


def test_a_draining_prefill_keeps_its_kv_until_decode_pulls_it(pair):
    prefill, decode = pair["prefill"], pair["decode"]
    # local mode's transports: the READ itself by cross-memory attach (process_vm_readv), TCP for
    # NIXL's messages (README, workers; bench/nixl_transfer.py). The pull below went through with
    # UCX_TLS=tcp alone as well: what it needs is the prefill process up with its blocks, which the
    # drain gives, not a transport that reads without the prefill's help
    assert "cma" in build(pair["settings"]).env["UCX_TLS"].split(",")
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "seed": 7}
    # what decode answers when it prefills itself, for the text check (a producer-only worker refuses
    # plain requests); the transfer count below shows the blocks were still pulled
    local = _post(f"{decode.url}/v1/completions", {**body, "max_tokens": 12})["choices"][0]["text"]
    # one hand-off first, as any serving pair has done long before a scale-down: the NIXL handshake
    # is then not part of what the drain has to carry
    warm = {**body, "prompt": "warm up " + PROMPT, "max_tokens": 2}
    _post(f"{decode.url}/v1/completions", {**warm, "kv_transfer_params": _remote_prefill(prefill, warm)})
    params = _remote_prefill(prefill, body)
    transfers = metric_sum(scrape(decode.url), m.VLLM_NIXL_BYTES_TRANSFERRED + "_count")
    prefill.proc.send_signal(signal.SIGTERM)            # the supervisor only, as the kubelet does
    # the engine is draining and, holding unread KV, has not finished: a prefill that dropped its
    # KV on SIGTERM would have logged TEARDOWN together with DRAIN_STARTED
    log = _log_once(prefill, DRAIN_STARTED)
    assert TEARDOWN not in log[log.index(DRAIN_STARTED):], "the prefill finished with KV nobody had pulled"
    text = _post(f"{decode.url}/v1/completions",
                 {**body, "max_tokens": 12, "kv_transfer_params": params})["choices"][0]["text"]
    # pulled from the draining worker: the text decode computes itself, one more transfer, none failed
    assert text == local
    assert wait_metric(decode.url, m.VLLM_NIXL_BYTES_TRANSFERRED + "_count", transfers + 1) > transfers
    assert metric_sum(scrape(decode.url), m.VLLM_NIXL_FAILED_TRANSFERS + "_total") == 0
    # the read released the blocks (not the lease running out), then the prefill exited cleanly
    assert prefill.proc.wait(timeout=LEASE + 60) == 0
    log = prefill.log_path.read_text(errors="replace")
    assert TEARDOWN in log and LEASE_EXPIRED not in log, prefill.tail()
