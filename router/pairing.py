"""Revision-safe pairing: which decode and prefill workers a new request may use.

Every worker carries a KV revision (:func:`disagg.api.contract.kv_revision`: what decides whether a
decode can use a prefill's KV) and that revision's generation (the DisaggDeployment generation that
introduced it). A prefill is only ever paired with a decode of the same revision; workers without a
revision (a static configuration that names none) form one revision of their own.

The rule, for each new request:
* of the revisions with both a healthy decode and a healthy prefill, the newest (highest generation;
  ties by revision, so that every router decides the same) takes it;
* if no revision has both, the decode comes from the newest revision that has a healthy decode, and the
  request runs decode-only (the decode prefills locally, no KV is pulled); when healthy prefills of
  other revisions exist, that is a pairing refusal, counted
  (``disagg_router_pairing_refusals_total``).
So during a rollout new requests stay on the old revision's pairs until the new revision has a pair,
then all move to it; none is ever served by a prefill and a decode of different revisions.

A request already under way keeps its revision (``choose(..., revision=)``): a decode retried before its
first token, or a stream continued after its decode failed (migration.py), goes to workers of the revision
it started on, since the tokens it carries are that model's; with none left it ends with an error that
says so, never on another model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disagg.api.names import ROLE_DECODE, ROLE_PREFILL

from .errors import NoWorkers
from .pool import Pool, Worker


class Unset:
    """No revision asked for (a new request); None is a revision of its own (workers that name none)."""


UNSET = Unset()


@dataclass
class Pairing:
    revision: str | None                                  # the revision the request runs on
    decodes: list[Worker]                                 # its healthy decode workers (never empty)
    prefills: list[Worker] = field(default_factory=list)  # its healthy prefill workers (may be empty)
    refused: bool = False                                 # healthy prefills of other revisions were passed over


def _order(workers: list[Worker]) -> int:
    gens = [w.revision_generation for w in workers if w.revision_generation is not None]
    return max(gens) if gens else -1


def _newest(groups: dict[str | None, list[Worker]], revisions) -> str | None:
    return max(revisions, key=lambda rev: (_order(groups[rev]), rev or ""))


def choose(pool: Pool, exclude: set[str] = frozenset(), revision: str | None | Unset = UNSET) -> Pairing:
    """The revision and workers a new request may use (NoWorkers when no decode is healthy); with
    ``revision``, the workers of that revision only (a request under way: NoWorkers when it has no
    healthy decode left)."""
    decodes, prefills = pool.healthy(ROLE_DECODE, exclude), pool.healthy(ROLE_PREFILL)
    if not isinstance(revision, Unset):
        decodes = [w for w in decodes if w.revision == revision]
        if not decodes:
            raise NoWorkers(f"no healthy {ROLE_DECODE} worker of the request's KV revision {revision} is left "
                            "(its tokens are that revision's model's)")
        return Pairing(revision, decodes, [w for w in prefills if w.revision == revision])
    if not decodes:
        raise NoWorkers(f"no healthy {ROLE_DECODE} workers are available")
    by_rev: dict[str | None, dict[str, list[Worker]]] = {}
    for w in decodes + prefills:
        by_rev.setdefault(w.revision, {ROLE_DECODE: [], ROLE_PREFILL: []})[w.role].append(w)
    groups = {rev: roles[ROLE_DECODE] + roles[ROLE_PREFILL] for rev, roles in by_rev.items()}
    complete = [rev for rev, roles in by_rev.items() if roles[ROLE_DECODE] and roles[ROLE_PREFILL]]
    if complete:
        rev = _newest(groups, complete)
        return Pairing(rev, by_rev[rev][ROLE_DECODE], by_rev[rev][ROLE_PREFILL])
    rev = _newest(groups, [r for r, roles in by_rev.items() if roles[ROLE_DECODE]])
    return Pairing(rev, by_rev[rev][ROLE_DECODE], [], refused=bool(prefills))
