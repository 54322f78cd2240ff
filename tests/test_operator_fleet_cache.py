"""The fleet view's caching (operator/fleet.py): how often it lists and who waits for a list.

The list itself runs against a real API server in tests/test_operator_mixed.py; here `_list` is
replaced by a counter so that the timing rules can be checked without a clock race."""

from __future__ import annotations

import threading
import time

from disagg.operator import capacity
from disagg.operator.fleet import Fleet


class CountingFleet(Fleet):
    def __init__(self, burn: float = 0.0, gate: threading.Event | None = None, **kw):
        super().__init__(clients=None, **kw)  # type: ignore[arg-type]
        self.lists = 0
        self.burn = burn
        self.gate = gate
        self.entered = threading.Event()

    def _list(self) -> list[capacity.NodeFree]:
        self.lists += 1
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        end = time.thread_time() + self.burn
        while time.thread_time() < end:   # CPU, as parsing a large fleet's pages costs
            pass
        return [capacity.NodeFree(name=f"n{self.lists}", labels={}, taints=(), free_gpus=self.lists)]


def test_an_expensive_list_is_repeated_less_often():
    fleet = CountingFleet(burn=0.05, max_age=0.0, max_share=0.01)
    first = fleet.free_gpus()
    # 0.05 CPU-seconds at a 1% share: at least 5 s before the next list
    assert fleet.age_limit >= 0.05 / 0.01
    assert fleet.free_gpus() is first and fleet.lists == 1


def test_a_cheap_list_keeps_the_configured_age():
    fleet = CountingFleet(max_age=3600.0)
    fleet.free_gpus()
    assert fleet.age_limit == 3600.0


def test_while_one_thread_lists_the_others_get_the_last_counts():
    gate = threading.Event()
    fleet = CountingFleet(max_age=0.0, max_share=1e9)   # always stale: every call wants a new list
    gate.set()
    old = fleet.free_gpus()
    gate.clear()
    fleet.gate, fleet.entered = gate, threading.Event()
    lister = threading.Thread(target=fleet.free_gpus)
    lister.start()
    assert fleet.entered.wait(30)
    # the second list is under way and blocked: another caller is answered at once, with the last counts
    assert fleet.free_gpus() is old
    gate.set()
    lister.join(30)
    assert fleet.lists == 2 and not lister.is_alive()


def test_the_first_list_is_waited_for():
    gate = threading.Event()
    fleet = CountingFleet(gate=gate)
    results = []
    first = threading.Thread(target=lambda: results.append(fleet.free_gpus()))
    first.start()
    assert fleet.entered.wait(30)
    second = threading.Thread(target=lambda: results.append(fleet.free_gpus()))
    second.start()
    gate.set()
    first.join(30)
    second.join(30)
    # no counts existed yet, so the second caller waited and reused the first list
    assert fleet.lists == 1 and len(results) == 2 and results[0] is results[1]


def test_an_explanation_is_computed_once_per_list_and_gang_shape(monkeypatch):
    calls = []
    real = capacity.explain

    def counting(nodes, roles, key):
        calls.append(key)
        return real(nodes, roles, key)

    monkeypatch.setattr(capacity, "explain", counting)
    # max_share: the lists' own (microseconds of) CPU must not stretch the age below (age_limit); with
    # the default share, a list that took 50 us kept its counts for 500 us, and a CI run's next call
    # came within that and got them back
    fleet = CountingFleet(max_age=3600.0, max_share=1e9)
    gang = [capacity.RoleNeed("prefill", 1, 1), capacity.RoleNeed("decode", 1, 1)]
    first = fleet.explain(gang, None)
    # another gang of the same shape (new objects, equal fields) gets the same answer, not a recount
    assert fleet.explain([capacity.RoleNeed("prefill", 1, 1), capacity.RoleNeed("decode", 1, 1)], None) == first
    assert len(calls) == 1
    # a different shape, or a topology key, is its own question
    bigger = fleet.explain([capacity.RoleNeed("prefill", 1, 1), capacity.RoleNeed("decode", 2, 1)], None)
    fleet.explain(gang, "zone")
    assert len(calls) == 3 and bigger != first
    # new counts: asked again, computed again, on them (the gang that does not fit: its message has the
    # counts; one that fits says so without them, operator/capacity.py)
    fleet._max_age, fleet._taken = 0.0, fleet._taken - 1.0   # counts a second old, kept for none
    again = fleet.explain([capacity.RoleNeed("prefill", 1, 1), capacity.RoleNeed("decode", 2, 1)], None)
    assert fleet.lists == 2 and len(calls) == 4 and again[1] != bigger[1]   # n2 has 2 free GPUs, n1 had 1
    assert "2 free" in again[1] and "2 free" not in bigger[1]
