"""A router's drain and its prefill timeout, as the operator renders them.

Drain: on SIGTERM a router stops accepting and lets its streams run for ``--drain-seconds``; the pod
gives it a preStop sleep (so the Service drops it before it stops accepting) and a grace period that
covers both, as workers get. Without that, Kubernetes' default 30 s grace cut every stream older than
30 s at each router rollout (every operator upgrade rolls routers: they run the operator's image).
The upstream is tests/stall_upstream.py (a real HTTP server, streaming slowly), the router a real
``python -m disagg.router`` process signalled as the kubelet does.

Prefill timeout: ``spec.router.prefillTimeoutSeconds`` reaches the router from the spec, and a prefill
slower than it is a counted fallback to the decode worker's own prefill, the request served."""

from __future__ import annotations

import json
import signal
import sys
import threading

import pytest
import requests

from disagg.api import contract
from disagg.api import metrics as m
from disagg.api.v1alpha1 import DisaggDeployment, RouterSpec
from disagg.e2e.testing import dd_manifest, wait_for
from disagg.operator import render
from disagg.router.__main__ import _parser, config_from
from disagg.workers.local import LocalProcess, free_port, scrape

SLOW_TOKENS = 10     # stall_upstream's "slow N": one token every 0.4 s, 4 s in all


def _router(routers, tokenizer: str, logs, upstream, drain: float) -> LocalProcess:
    port = free_port()
    path = logs / f"router-drain-{drain:g}.json"
    path.write_text(json.dumps(routers.config(tokenizer, port, [upstream.url])))
    r = LocalProcess(f"router-drain-{drain:g}", [sys.executable, "-P", "-m", "disagg.router", "--config", str(path),
                                                 "--drain-seconds", str(drain)], {}, f"http://127.0.0.1:{port}", logs)
    return r.start().wait_ready(timeout=60)


def _stream(url: str, first: threading.Event, out: dict) -> None:
    """A slow stream through the router; ``out``: its tokens and whether it ended with [DONE]."""
    out.update(tokens=0, done=False, error=None)
    try:
        with requests.post(f"{url}/v1/completions", timeout=60, stream=True,
                           json={"model": "tiny", "prompt": f"slow {SLOW_TOKENS}", "max_tokens": SLOW_TOKENS,
                                 "stream": True}) as resp:
            for line in resp.iter_lines(decode_unicode=True):
                if line == "data: [DONE]":
                    out["done"] = True
                elif line.startswith("data: ") and '"text"' in line:
                    out["tokens"] += 1
                    first.set()
    except requests.RequestException as e:
        out["error"] = repr(e)
    finally:
        first.set()


@pytest.mark.parametrize("drain, whole", [(30, True), (1, False)])
def test_a_terminated_router_finishes_its_streams_within_its_drain(routers, tiny_model, tmp_path, drain, whole):
    up = routers.upstream(tmp_path, "slow", script="stall_upstream.py")
    r = None
    try:
        up.wait_ready(timeout=30)
        r = _router(routers, tiny_model, tmp_path, up, drain)
        first, out = threading.Event(), {}
        t = threading.Thread(target=_stream, args=(r.url, first, out), daemon=True)
        t.start()
        assert first.wait(30), "the stream's first token"
        r.proc.send_signal(signal.SIGTERM)           # what the kubelet sends after the preStop sleep
        # a terminating router accepts nothing new: the Service has already dropped it (the preStop sleep)
        wait_for(lambda: _refused(r.url), 10, "the terminating router to stop accepting connections", interval=0.1)
        t.join(60)
        assert not t.is_alive()
        if whole:
            assert out == {"tokens": SLOW_TOKENS, "done": True, "error": None}, out
            assert r.proc.wait(30) == 0, r.tail()
        else:   # a drain shorter than the stream cuts it: the flag is what bounds it
            assert out["tokens"] < SLOW_TOKENS and not out["done"], out
            r.proc.wait(30)
    finally:
        for p in (r, up):
            if p is not None:
                p.stop()


def _refused(url: str) -> bool:
    try:
        requests.get(f"{url}/livez", timeout=2)
    except requests.ConnectionError:
        return True
    except requests.RequestException:
        return False
    return False


def test_router_pods_get_the_workers_drain_contract():
    dd = DisaggDeployment.model_validate({**dd_manifest("drain"), "metadata": {"name": "drain", "namespace": "ns"}})
    pod = render.router_deployment(dd, "uid")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    args = c["args"]
    drain = float(contract.flag_value(args, "--drain-seconds"))
    assert drain == contract.DRAIN_SECONDS
    assert _parser().parse_args(args).drain_seconds == drain
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pre_stop >= contract.ENDPOINT_GRACE_SECONDS
    # the kubelet counts the preStop sleep inside the grace period: sleep, then the drain, then a margin
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + contract.DRAIN_MARGIN_SECONDS


def test_the_prefill_timeout_comes_from_the_spec():
    assert RouterSpec().prefill_timeout_seconds == 30
    for spec in ({}, {"prefillTimeoutSeconds": 90}):
        manifest = dd_manifest("pt", router=spec)
        manifest["metadata"]["namespace"] = "ns"
        dd = DisaggDeployment.model_validate(manifest)
        args = render.router_deployment(dd, "uid")["spec"]["template"]["spec"]["containers"][0]["args"]
        config = config_from(_parser().parse_args(args))
        assert config.spec.prefill_timeout_seconds == dd.spec.router.prefill_timeout_seconds == \
            spec.get("prefillTimeoutSeconds", 30)


def test_a_prefill_slower_than_the_timeout_falls_back_to_local_prefill(routers, tiny_model, tmp_path):
    """The stall upstream never answers a non-streamed request, which is what a prefill is."""
    stalled = routers.upstream(tmp_path, "prefill", script="stall_upstream.py")
    decode = routers.upstream(tmp_path, "decode", 4, 0.0)
    with routers.serving(tiny_model, tmp_path, [decode], prefill=[stalled],
                         spec={"disaggregation": "always", "prefillTimeoutSeconds": 1}) as r:
        resp = requests.post(f"{r.url}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "hello there", "max_tokens": 4})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "tok " * 4
        s = scrape(r.url)
        assert s[f'{m.ROUTER_FALLBACKS}{{reason="{m.FALLBACK_PREFILL_TIMEOUT}"}}'] == 1
