"""Rollouts between KV revisions (:func:`disagg.api.contract.kv_revision`).

The router pairs prefill and decode of one revision only, so a rollout that changes the revision must
never leave the old revision without a ready pair before the new one has one: else requests run
decode-only (no remote prefill) for a while, or, with a single role rolled, find no pair at all.
Each role's Deployment already keeps its old pods until new ones are *available* (maxUnavailable 0),
but the two roles roll independently: the prefill's rollout can finish (old prefills gone) while the
new decode is still loading its model. So while the new revision has no ready prefill and decode and
an older one has both, the operator renders the worker Deployments with a long minReadySeconds
(contract.ROLLOUT_HOLD_SECONDS): the new pods become Ready (they are in the EndpointSlices, and the
router sees them) but not available, so neither Deployment removes an old pod; once a prefill and a
decode of the new revision are both ready, the hold is lifted and the Deployments finish as usual.
"""

from __future__ import annotations

from disagg.api.names import ROLE_DECODE, ROLE_PREFILL

from .status import DeploymentView, PodView


def _paired(pods: list[PodView]) -> set[str | None]:
    """Revisions with at least one ready, not terminating prefill and decode."""
    ready = {(p.revision, p.role) for p in pods if p.ready and not p.terminating}
    return {rev for rev, role in ready if role == ROLE_PREFILL and (rev, ROLE_DECODE) in ready}


def hold(pods: list[PodView], revision: str) -> bool:
    """Whether the rollout to ``revision`` must hold the old pods: it has no ready pair yet, and
    another revision has one."""
    paired = _paired(pods)
    return revision not in paired and bool(paired - {revision})


def live(deployments: list[DeploymentView]) -> tuple[str | None, int | None]:
    """(revision, its generation) on the worker Deployments' current pod templates; (None, None)
    when they are not there yet or disagree (a previous apply wrote one and failed on the other)."""
    seen = {(d.revision, d.revision_generation) for d in deployments if d.revision}
    return next(iter(seen)) if len(seen) == 1 else (None, None)
