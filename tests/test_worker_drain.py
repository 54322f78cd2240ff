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
from disagg.router.service import REMOTE_DECODE
from disagg.workers.local import cpu_settings, metric_sum, scrape, wait_metric, worker
from disagg.workers.testing import tiny_model, worker_python  # noqa: F401  (fixtures)

PROMPT = "The quick brown fox jumps over the lazy dog " * 6     # several full 32-token blocks


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


@pytest.fixture
def pair(tiny_model, worker_python, tmp_path):
    procs = {"prefill": worker("prefill", cpu_settings("prefill", tiny_model, "0", drain_seconds=60),
                               worker_python, tmp_path),
             "decode": worker("decode", cpu_settings("decode", tiny_model, "1"), worker_python, tmp_path)}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.mark.xfail(strict=False, reason="vLLM's CPU build on a 2-core machine sometimes stalls the decode's "
                   "NIXL pull until the prefill's 30 s KV lease expires (seen in CI: the prefill held the "
                   "blocks after SIGTERM as it should, but nobody read them); passes when the pull is prompt")
def test_a_draining_prefill_keeps_its_kv_until_decode_pulls_it(pair):
    prefill, decode = pair["prefill"], pair["decode"]
    body = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "seed": 7}
    # what decode answers when it prefills itself, for the text check (a producer-only worker refuses
    # plain requests); the transfer count below shows the blocks were still pulled
    local = _post(f"{decode.url}/v1/completions", {**body, "max_tokens": 12})["choices"][0]["text"]
    params = _post(f"{prefill.url}/v1/completions",
                   {**body, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE})["kv_transfer_params"]
    transfers = metric_sum(scrape(decode.url), m.VLLM_NIXL_BYTES_TRANSFERRED + "_count")
    prefill.proc.send_signal(signal.SIGTERM)            # the supervisor only, as the kubelet does
    time.sleep(8)                                       # longer than an idle worker takes to exit
    assert prefill.proc.poll() is None, "the prefill exited with KV nobody had pulled yet"
    out = _post(f"{decode.url}/v1/completions", {**body, "max_tokens": 12, "kv_transfer_params": params})
    assert out["choices"][0]["text"] == local
    assert wait_metric(decode.url, m.VLLM_NIXL_BYTES_TRANSFERRED + "_count", transfers + 1) > transfers
    assert metric_sum(scrape(decode.url), m.VLLM_NIXL_FAILED_TRANSFERS + "_total") == 0
    assert prefill.proc.wait(timeout=60) == 0
