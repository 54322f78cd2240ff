"""The router's prefix index heals after lost KV events, against a real vLLM worker (CPU build, tiny
model, prefix caching on) and the router's own subscriber (router/events.py) over real ZMQ sockets.

Batches are lost on purpose with the subscriber's fault-injection hook (``Subscriber.discard``: the
next n batches read from the live socket are thrown away, as a full queue or a reconnect would), and
the index must come back to what the worker holds: with vLLM's replay socket exactly (checked
against vLLM's own prefix-cache hits), without it by dropping the worker's entries. The gap logic's
corner cases (restarts, an anchor gone from the buffer, duplicates) are unit-tested with synthetic
batches in tests/test_router_index.py."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import urllib.request

import pytest
import zmq.asyncio

from disagg.api import metrics as m
from disagg.e2e.testing import wait_for
from disagg.router.events import Subscriber
from disagg.router.index import PrefixIndex, block_keys
from disagg.router.metrics import RouterMetrics
from disagg.workers.local import cpu_settings, metric_sum, scrape, worker

BLOCK = 32
TOPIC = "kv-events"


@pytest.fixture(scope="module")
def vllm(tiny_model, worker_python, tmp_path_factory):
    """One aggregated worker (local prefill), one core."""
    settings = cpu_settings("decode", tiny_model, "0", kv_transfer=False)
    proc = worker("decode-0", settings, worker_python, tmp_path_factory.mktemp("kv-heal")).start()
    try:
        proc.wait_ready()
        yield proc, settings
    finally:
        proc.stop()


class Loop:
    """An event loop in a thread: the subscriber runs there as in the router, while the test waits
    on conditions with the project's wait_for and reads the index through the loop (never while
    the loop writes it)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, fn, *args):
        async def run():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=30)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=30)
        self.loop.close()


@pytest.fixture
def subscribe(vllm):
    """Start the router's subscriber on the worker: (subscriber, index, metrics, worker name)."""
    proc, settings = vllm
    loop, made = Loop(), []

    def start(replay: bool):
        ctx = zmq.asyncio.Context()
        index, metrics = PrefixIndex(), RouterMetrics()

        def make():
            sub = Subscriber(ctx, index, TOPIC, metrics.kv_event_batches.inc, BLOCK, metrics.kv_resynced)
            sub.watch(proc.url, f"tcp://127.0.0.1:{settings.kv_events_port}",
                      f"tcp://127.0.0.1:{settings.kv_replay_port}" if replay else None)
            return sub

        sub = loop.call(make)
        made.append((sub, ctx))
        return sub, index, metrics

    yield loop, start
    for sub, ctx in made:
        asyncio.run_coroutine_threadsafe(sub.close(), loop.loop).result(timeout=30)
        ctx.term()
    loop.close()


def _prompt(seed: int, blocks: int = 4) -> list[int]:
    """Token ids (the tiny model's vocabulary is larger), a partial block past the full ones."""
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(blocks * BLOCK + 3)]


def _send(url: str, prompt: list[int]) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


def _resyncs(metrics: RouterMetrics, reason: str, outcome: str) -> float:
    return metrics.registry.get_sample_value(m.ROUTER_KV_INDEX_RESYNCS, {"reason": reason, "outcome": outcome}) or 0


def test_lost_batches_are_replayed_and_the_index_is_what_the_worker_holds(vllm, subscribe):
    proc, _ = vllm
    loop, start = subscribe
    a, b, c = _prompt(1), _prompt(2), _prompt(3)
    keys = {name: set(block_keys(p, BLOCK)) for name, p in (("a", a), ("b", b), ("c", c))}
    assert all(len(k) == 4 for k in keys.values())

    # A is stored before the router subscribes: only the replay can tell it
    _send(proc.url, a)
    sub, index, metrics = start(replay=True)
    wait_for(lambda: loop.call(index.keys, proc.url) == keys["a"] and _resyncs(metrics, m.RESYNC_JOIN,
                                                                              m.RESYNC_REPLAYED) == 1,
             60, "the router to catch up on A from the worker's replay socket")

    # B's batch is lost on the way; C's arrival shows the gap, and the replay fills it
    loop.call(sub.discard, proc.url, 1)
    _send(proc.url, b)
    wait_for(lambda: loop.call(sub.discarding, proc.url) == 0, 60, "B's batch to be thrown away")
    _send(proc.url, c)
    want = keys["a"] | keys["b"] | keys["c"]
    wait_for(lambda: loop.call(index.keys, proc.url) == want, 60, "the index to hold A, B and C again")
    assert _resyncs(metrics, m.RESYNC_GAP, m.RESYNC_REPLAYED) == 1
    assert metrics.registry.get_sample_value(m.ROUTER_KV_EVENT_BATCHES_MISSED) >= 2   # A's (join) and B's
    assert _resyncs(metrics, m.RESYNC_GAP, m.RESYNC_DROPPED) == 0

    # and that is what the worker holds: each prompt again is a prefix-cache hit on all its full blocks
    for prompt in (a, b, c):
        before = metric_sum(scrape(proc.url), m.VLLM_PREFIX_CACHE_HITS + "_total")
        _send(proc.url, prompt)
        assert metric_sum(scrape(proc.url), m.VLLM_PREFIX_CACHE_HITS + "_total") - before == 4 * BLOCK


def test_without_a_replay_a_gap_drops_the_workers_entries_and_they_rebuild(vllm, subscribe):
    proc, _ = vllm
    loop, start = subscribe
    sub, index, metrics = start(replay=False)
    # no replay to join from, and a SUB socket connects in the background: fresh prompts until
    # one's batch arrives (those published before the connection are lost, as in production)
    seen: set[int] = set()
    for seed in range(100, 110):
        probe = _prompt(seed)
        _send(proc.url, probe)
        try:
            wait_for(lambda: loop.call(index.keys, proc.url) >= set(block_keys(probe, BLOCK)), 10,
                     "a probe's blocks in the index")
            seen = set(block_keys(probe, BLOCK))
            break
        except AssertionError:
            continue
    assert seen, "the subscriber never received a batch"

    loop.call(sub.discard, proc.url, 1)
    b, c = _prompt(20), _prompt(21)
    _send(proc.url, b)
    wait_for(lambda: loop.call(sub.discarding, proc.url) == 0, 60, "B's batch to be thrown away")
    _send(proc.url, c)
    wait_for(lambda: loop.call(index.keys, proc.url) >= set(block_keys(c, BLOCK)), 60, "C's blocks in the index")
    # what the index held before the gap could be stale (an eviction in the lost batch): dropped
    held = loop.call(index.keys, proc.url)
    assert not held & seen, "entries from before the gap survived it"
    assert _resyncs(metrics, m.RESYNC_GAP, m.RESYNC_DROPPED) == 1
    assert _resyncs(metrics, m.RESYNC_GAP, m.RESYNC_REPLAYED) == 0


def test_a_restarted_worker_replaces_its_entries(vllm, subscribe):
    """The worker dies (SIGKILL: its cache is gone) and comes back on the same address; its
    numbering starts over, which the router sees as a restart: the old engine's entries go, the
    new engine's history comes from its replay socket."""
    proc, _ = vllm
    loop, start = subscribe
    sub, index, metrics = start(replay=True)
    old = _prompt(30)
    _send(proc.url, old)
    wait_for(lambda: loop.call(index.keys, proc.url) >= set(block_keys(old, BLOCK)), 60, "the old engine's blocks")

    proc.kill()
    proc.start().wait_ready()
    # SUB reconnects in the background; the replay covers whatever it missed once a batch arrives
    sent: set[int] = set()
    for seed in range(40, 50):
        prompt = _prompt(seed)
        _send(proc.url, prompt)
        sent |= set(block_keys(prompt, BLOCK))
        try:
            wait_for(lambda: loop.call(index.keys, proc.url) >= set(block_keys(prompt, BLOCK)), 10,
                     "a new engine's batch in the index")
            break
        except AssertionError:
            continue
    assert loop.call(index.keys, proc.url) == sent, "the index is exactly what the new engine stored"
    assert _resyncs(metrics, m.RESYNC_RESTART, m.RESYNC_REPLAYED) == 1
