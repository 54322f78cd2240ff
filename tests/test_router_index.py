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
