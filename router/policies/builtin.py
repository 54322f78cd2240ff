"""The built-in policies: kv-aware (default), least-loaded, round-robin."""

from __future__ import annotations

from itertools import count

from disagg.api.v1alpha1 import RouterSpec, RoutingPolicy

from . import Candidate, Decision, Request, register


def _require(candidates: list[Candidate]) -> None:
    if not candidates:
        raise LookupError("no candidate workers")


class _Turns:
    """A turn counter per set of candidates. One counter for all would be shared by a request's two picks
    (its decode's, then its prefill's): with two workers of each role every request got the same decode
    worker, the counter having moved by two in between."""

    def __init__(self) -> None:
        self._turns: dict[tuple[str, ...], count] = {}

    def next(self, ordered: list[Candidate]) -> int:
        return self.next_of(tuple(c.name for c in ordered))

    def next_of(self, key: tuple[str, ...]) -> int:
        turn = self._turns.get(key)
        if turn is None:
            if len(self._turns) > 1024:     # workers come and go: sets seen long ago are dropped
                self._turns.clear()
            turn = self._turns[key] = count()
        return next(turn)


@register(RoutingPolicy.ROUND_ROBIN.value)
class RoundRobin:
    def __init__(self, spec: RouterSpec):
        self._turns = _Turns()

    def choose(self, candidates: list[Candidate], request: Request) -> Decision:
        _require(candidates)
        ordered = sorted(candidates, key=lambda c: c.name)
        c = ordered[self._turns.next(ordered) % len(ordered)]
        return Decision(c.name, request.overlap.get(c.name, 0), c.load)


@register(RoutingPolicy.LEAST_LOADED.value)
class LeastLoaded:
    def __init__(self, spec: RouterSpec):
        self._turns = _Turns()

    def choose(self, candidates: list[Candidate], request: Request) -> Decision:
        _require(candidates)
        low = min(c.load for c in candidates)
        tied = sorted((c for c in candidates if c.load == low), key=lambda c: c.name)
        c = tied[self._turns.next(tied) % len(tied)]
        return Decision(c.name, request.overlap.get(c.name, 0), c.load)


@register(RoutingPolicy.KV_AWARE.value)
class KVAware:
    """cost = overlap_weight x uncached prompt blocks + load, among workers whose load is within
    ``max_load_skew x (least load + 1)``; ties go to the less loaded, then in turn."""

    def __init__(self, spec: RouterSpec):
        self.overlap_weight = spec.overlap_weight
        self.max_load_skew = spec.max_load_skew
        self._turns = _Turns()

    def choose(self, candidates: list[Candidate], request: Request) -> Decision:
        _require(candidates)
        bound = self.max_load_skew * (min(c.load for c in candidates) + 1)
        weight, blocks, overlap = self.overlap_weight, request.blocks, request.overlap
        best: tuple[float, float] | None = None
        best_over: tuple[float, float] | None = None    # the cheapest among those over the bound
        tied: list[str] = []
        for c in candidates:                 # one pass: this runs for every request
            key = (weight * (blocks - overlap.get(c.name, 0)) + c.load, c.load)
            if c.load > bound:
                if best_over is None or key < best_over:
                    best_over = key
                continue
            if best is None or key < best:
                best, tied = key, [c.name]
            elif key == best:
                tied.append(c.name)
        # a turn per tied set, as round-robin's: with one counter, a request's decode pick moved it between
        # its prefill picks, and two idle prefill workers beside one decode always tied to the same prefill
        name = tied[0] if len(tied) == 1 else tied[self._turns.next_of(tuple(tied)) % len(tied)]
        return Decision(name, overlap.get(name, 0), best[0], load_bounded=best_over is not None and best_over < best)
