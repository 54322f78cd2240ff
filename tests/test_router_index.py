"""The router's prefix index, KV-event decoding and routing policies, without vLLM."""

from __future__ import annotations

import msgspec
import pytest

from disagg.api.v1alpha1 import RouterSpec, RoutingPolicy
from disagg.router import policies
from disagg.router.events import apply
from disagg.router.index import PrefixIndex, block_keys
from disagg.router.policies import Candidate, Request


def test_block_keys_chain_and_ignore_partial_blocks():
    a = block_keys(list(range(40)), 16)
    assert len(a) == 2
    b = block_keys(list(range(32)) + [99] * 8, 16)
    assert a == b                                   # same first 32 tokens, partial tail ignored
    c = block_keys([1000] + list(range(1, 40)), 16)
    assert c[0] != a[0] and c[1] != a[1]            # a change in block 0 changes every later key
    assert block_keys(list(range(16, 32)), 16) != a[1:]   # a key depends on the whole prefix


def test_match_counts_leading_blocks_per_worker():
    idx = PrefixIndex()
    keys = block_keys(list(range(64)), 16)          # 4 blocks
    idx.add_keys("w1", keys[:3])
    idx.add_keys("w2", keys[:1])
    idx.add_keys("w3", keys[1:])                    # no first block: no usable prefix
    assert idx.match(keys) == {"w1": 3, "w2": 1}
    assert idx.match(block_keys(list(range(100, 164)), 16)) == {}


def test_engine_hash_events_store_chain_remove_and_clear():
    idx = PrefixIndex()
    toks = list(range(48))
    assert idx.stored("w", ["e0", "e1"], None, toks[:32], 16) == 2
    assert idx.stored("w", ["e2"], "e1", toks[32:48], 16) == 1       # chained from the parent's key
    assert idx.stored("w", ["x"], "unknown-parent", toks[:16], 16) == 0
    keys = block_keys(toks, 16)
    assert idx.match(keys) == {"w": 3}
    idx.removed("w", ["e1"])
    assert idx.match(keys) == {"w": 1}
    idx.cleared("w")
    assert idx.match(keys) == {} and idx.blocks() == 0


def _batch(*events) -> bytes:
    # vLLM's wire shape: [ts, [events...], dp_rank]; events are maps tagged by "type".
    return msgspec.msgpack.encode([1.0, list(events), 0])


def test_vllm_event_batches_feed_the_index():
    idx = PrefixIndex()
    toks = list(range(32))
    stored = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
              "token_ids": toks, "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    assert apply(idx, "w", _batch(stored)) == 2
    assert idx.match(block_keys(toks, 16)) == {"w": 2}
    cpu_copy = dict(stored, medium="CPU", block_hashes=[21, 22])
    assert apply(idx, "w", _batch(cpu_copy)) == 0                    # offloaded copies are not indexed
    apply(idx, "w", _batch({"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"}))
    assert idx.match(block_keys(toks, 16)) == {"w": 1}
    apply(idx, "w", _batch({"type": "AllBlocksCleared"}))
    assert idx.blocks() == 0
    with pytest.raises(msgspec.DecodeError):
        apply(idx, "w", b"\x93garbage")


def test_blocks_of_another_size_than_the_routers_are_not_indexed_and_said_so(caplog):
    idx = PrefixIndex()
    toks = list(range(32))
    stored = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
              "token_ids": toks, "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    with caplog.at_level("ERROR", logger="disagg.router.events"):
        assert apply(idx, "w-16", _batch(stored), block_size=32) == 0
        assert apply(idx, "w-16", _batch(stored), block_size=32) == 0
    assert idx.blocks() == 0
    assert [r.getMessage() for r in caplog.records if "w-16" in r.getMessage()] == [
        "w-16 stores KV blocks of 16 tokens but the router hashes blocks of 32: its prefixes are not indexed "
        "(set the same --block-size in spec.engine.args for both)"]   # once, not per batch
    assert apply(idx, "w-16", _batch(stored), block_size=16) == 2


def test_registry_refuses_duplicates_and_unknown_names():
    assert policies.names() == sorted(p.value for p in RoutingPolicy)
    assert policies.DEFAULT == RouterSpec().policy == "kv-aware"
    with pytest.raises(ValueError, match="already registered"):
        policies.register("round-robin")(object)
    with pytest.raises(ValueError, match="unknown routing policy 'fastest'"):
        policies.create("fastest")


def test_kv_aware_prefers_overlap_then_load():
    p = policies.create("kv-aware", RouterSpec(overlap_weight=1.0, max_load_skew=2.0))
    cands = [Candidate("a", 1), Candidate("b", 0)]
    # a holds 8 of 10 blocks: cost 2 + 1 = 3; b: 10 + 0 = 10
    assert p.choose(cands, Request(blocks=10, overlap={"a": 8})).worker == "a"
    # no overlap anywhere: the less loaded one
    assert p.choose(cands, Request(blocks=10)).worker == "b"


def test_kv_aware_ties_take_turns_per_set_of_candidates():
    """Each request picks its decode (one worker) and then its prefill (two idle ones): the prefill picks
    alternate. One counter for both picks sent every request's prefill to the same worker
    (bench/sim_vs_real.py --flex saw all lone requests on one prefill)."""
    p = policies.create("kv-aware")
    prefills = [Candidate("prefill-a", 0), Candidate("prefill-b", 0)]
    picked = []
    for _ in range(4):
        assert p.choose([Candidate("decode", 0)], Request(blocks=4)).worker == "decode"
        picked.append(p.choose(prefills, Request(blocks=4)).worker)
    assert picked == ["prefill-a", "prefill-b", "prefill-a", "prefill-b"]


def test_kv_aware_skew_bound_stops_a_shared_prefix_from_piling_up():
    p = policies.create("kv-aware", RouterSpec(overlap_weight=1.0, max_load_skew=2.0))
    load = {"a": 0, "b": 0}
    for _ in range(200):                            # every request shares the same long prefix on "a"
        d = p.choose([Candidate(n, l) for n, l in load.items()], Request(blocks=100, overlap={"a": 100}))
        load[d.worker] += 1
    assert load["b"] > 0
    assert max(load.values()) <= 2.0 * (min(load.values()) + 1) + 1


def test_round_robin_and_least_loaded():
    rr = policies.create("round-robin")
    cands = [Candidate("a", 5), Candidate("b", 0), Candidate("c", 9)]
    assert [rr.choose(cands, Request(blocks=1)).worker for _ in range(4)] == ["a", "b", "c", "a"]
    ll = policies.create("least-loaded")
    assert ll.choose(cands, Request(blocks=1, overlap={"c": 1})).worker == "b"
    with pytest.raises(LookupError):
        ll.choose([], Request(blocks=1))


# ---- the event sequence: gaps, restarts, late joins (router/events.py Stream), with synthetic batches

def _stored(hashes, parent, tokens, block_size=16):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None}


def _removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


def _engine(tag: int, n: int) -> list[tuple[int, bytes]]:
    """An engine's first n batches: batch i stores a two-block prompt of its own, and every third
    batch also evicts the prompt stored two batches earlier (so a lost batch can hide a removal)."""
    out = []
    for i in range(n):
        toks = [tag * 100_000 + i * 32 + j for j in range(32)]
        events = [_stored([tag * 10**6 + i * 10, tag * 10**6 + i * 10 + 1], None, toks)]
        if i % 3 == 2:
            events.append(_removed([tag * 10**6 + (i - 2) * 10, tag * 10**6 + (i - 2) * 10 + 1]))
        out.append((i, msgspec.msgpack.encode([float(tag * 1000 + i), events, 0])))
    return out


def _truth(batches) -> set[int]:
    idx = PrefixIndex()
    for _, payload in batches:
        apply(idx, "w", payload)
    return idx.keys("w")


def _feed(stream, batches, replay_buffer=None) -> list[tuple[str, str]]:
    """Each batch as the Subscriber hands it over from the live socket, with ``replay_buffer`` (the
    worker's buffered batches; None: no replay endpoint) answering replays; returns the resyncs."""
    import asyncio

    async def fetch(start):
        return [b for b in replay_buffer if b[0] >= start]

    async def run():
        out = []
        for seq, payload in batches:
            resync = await stream.receive(seq, payload, None if replay_buffer is None else fetch)
            if resync is not None:
                out.append(resync[:2])
        return out

    return asyncio.run(run())


def _stream():
    from disagg.router.events import Stream
    idx = PrefixIndex()
    return idx, Stream(idx, "w")


def test_in_order_batches_need_no_resync():
    idx, stream = _stream()
    batches = _engine(1, 9)
    assert _feed(stream, batches, replay_buffer=batches) == []
    assert idx.keys("w") == _truth(batches) and stream.next == 9


def test_a_gap_is_replayed_and_the_index_is_exact_again():
    idx, stream = _stream()
    batches = _engine(1, 12)
    lost = {4, 5, 6}                                  # batch 5 evicts batch 3's blocks: only the replay says so
    assert _truth(batches[:4]) - _truth(batches)
    arrived = [b for b in batches if b[0] not in lost]
    # SUB may still deliver batches the replay already applied: they are skipped, not re-applied
    arrived.insert(5, batches[7])
    assert _feed(stream, arrived, replay_buffer=batches) == [("gap", "replayed")]
    assert idx.keys("w") == _truth(batches) and stream.next == 12


def test_a_gap_the_replay_cannot_cover_drops_the_workers_entries():
    idx, stream = _stream()
    batches = _engine(1, 12)
    arrived = [b for b in batches if b[0] not in {3, 4, 5}]
    # the buffer kept only batches 6.. (vLLM's buffer_steps): the anchor (batch 2) is gone, so what
    # the index holds cannot be proven current; it is dropped and rebuilt from what remains
    assert _feed(stream, arrived, replay_buffer=batches[6:]) == [("gap", "dropped")]
    assert idx.keys("w") == _truth(batches[6:]) <= _truth(batches)
    # without a replay endpoint: the same, rebuilt from the batch that showed the gap
    idx, stream = _stream()
    assert _feed(stream, arrived, replay_buffer=None) == [("gap", "dropped")]
    assert idx.keys("w") == _truth(batches[6:])
    # what it holds is a subset of the truth: batch 3's blocks (evicted by the lost batch 5) are not claimed
    assert not idx.keys("w") - _truth(batches)


def test_a_restarted_engine_replaces_the_old_ones_entries():
    idx, stream = _stream()
    old, new = _engine(1, 8), _engine(2, 5)
    # the new engine's numbering starts over; the router saw its batches from seq 2 on
    assert _feed(stream, old + new[2:], replay_buffer=new) == [("restart", "replayed")]
    assert idx.keys("w") == _truth(new)
    # a new engine that had published more than the old one by the time the router saw it looks
    # like a gap; the replay's anchor shows another engine's batch, so all of it is taken instead
    idx, stream = _stream()
    old, new = _engine(1, 3), _engine(2, 8)
    assert _feed(stream, old + new[6:], replay_buffer=new) == [("restart", "replayed")]
    assert idx.keys("w") == _truth(new)
    assert not idx.keys("w") & _truth(old)


def test_a_late_joiner_catches_up_from_the_replay():
    import asyncio

    idx, stream = _stream()
    batches = _engine(1, 7)
    assert _feed(stream, batches[4:], replay_buffer=batches) == [("join", "replayed")]
    assert idx.keys("w") == _truth(batches)
    # the Subscriber asks at once when it has the replay endpoint; SUB's copies are then duplicates
    idx, stream = _stream()

    async def fetch(start):
        return batches[start:5]

    assert asyncio.run(stream.join(fetch)) == ("join", "replayed", 5)
    assert _feed(stream, batches[3:], replay_buffer=batches) == []
    assert idx.keys("w") == _truth(batches)
    idx, stream = _stream()                          # no replay: only what it saw
    assert _feed(stream, batches[4:], replay_buffer=None) == [("join", "dropped")]
    assert idx.keys("w") == _truth(batches[4:])


def test_closing_the_subscribers_lets_the_zmq_context_end():
    """Router.close ends the ZMQ context after closing the subscribers: every socket (a SUB, a replay
    request waiting for an answer) must be closed by then, or zmq_ctx_term blocks for ever."""
    import asyncio
    import threading

    import zmq.asyncio

    from disagg.router.events import Subscriber

    async def run():
        ctx = zmq.asyncio.Context()
        sub = Subscriber(ctx, PrefixIndex(), "kv-events")
        # nothing listens on port 9 (discard) of loopback: the join replay waits for an answer
        sub.watch("w", "tcp://127.0.0.1:9", "tcp://127.0.0.1:9")
        await asyncio.sleep(0)          # the task starts and opens its sockets
        await sub.close()
        ctx.term()

    done = threading.Event()
    thread = threading.Thread(target=lambda: (asyncio.run(run()), done.set()), daemon=True)
    thread.start()
    thread.join(timeout=30)
    assert done.is_set(), "the ZMQ context did not terminate after Subscriber.close()"
