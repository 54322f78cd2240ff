"""Flex workers: engines that serve either role, one role at a time, switched by the planner (issue 31).

A flex worker runs one vLLM engine with ``kv_role: kv_both``: NixlConnector decides the role per request
(``do_remote_decode``: it prefills and holds the blocks for a decode to pull; ``do_remote_prefill``: it pulls
and decodes), so a switch is a routing decision plus a drain, with no weight reload. Each worker has one
current role; the router sends it that role's work only.

Pure, like :mod:`disagg.planner.decide`: ``decide_flex(observation, target, memory, model, now)`` runs
:func:`~disagg.planner.decide.decide` unchanged on the role totals (dedicated replicas plus the flex
workers in that role), then splits what it asked for between the dedicated pools and the flex pool:

1. **Switch before scale.** A role that needs more takes flex workers from the other role, down to what the
   other role keeps (``RoleDecision.keep``: what the model asks for it, headroom included; its current size
   while its latency is above 80% of target), whatever that role's scale-down cooldown and hysteresis say:
   a switch serves in a drain's seconds and is undone as fast, a new replica takes a start-up's minute and
   a half. A worker still starting
   switches first (it drains nothing), then one switching the other way (the switch is cancelled), then
   the least loaded; a worker that took its role less than :data:`SWITCH_DWELL` ago does not switch back.
2. **Grow the flex pool** for what switching could not cover (neither role had a flex worker to spare:
   both are busy), up to ``flex_max``; the dedicated pools only past that.
3. **Shrink**, where ``decide`` let a role shrink: flex workers first when both roles shrink (both idle,
   down to ``flex_min``), otherwise the role's dedicated replicas first (down to their floor), then its
   flex workers.
4. **A pooled spare** (``FlexTarget.spare``, 0 by default): that many flex workers kept beyond what both
   roles need, in the role whose observed latency is the larger share of its target. It serves that role
   meanwhile and is the first to switch: one headroom for either role, where without flex workers each
   role would hold its own.

The fast path (:func:`react_flex`) does the same between decisions on a growing queue: a switch reaches
the queue a drain later, not a start-up later.

Every decision says why (``disagg.planner.reasons``): ``RoleSwitched``, ``FlexPoolGrown``,
``FlexPoolShrunk``, or decide's own reason when the flex pool is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from disagg.perf.model import PerfModel

from .decide import Decision, Memory, Observation, RoleModels, Target, decide, react
from .reasons import BUDGET_LIMITED, FLEX_GROWN, FLEX_SHRUNK, ROLE_SWITCHED, SCALED, STEADY

ROLES = ("prefill", "decode")
STARTING, SERVING, SWITCHING = "starting", "serving", "switching"
SWITCH_DWELL = 60.0    # seconds a flex worker stays in a role it took before it may switch back (no flapping)


def _other(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


@dataclass(frozen=True)
class FlexWorker:
    """One flex worker as the planner sees it."""

    name: str
    role: str                # the role it serves, or is switching to
    state: str = SERVING     # starting (not serving yet), serving, switching (draining its old role)
    since: float = 0.0       # when it took ``role`` (asked for, or its switch began)
    load: float = 0.0        # requests in flight on it and KV blocks it holds for decodes (its drain)


@dataclass(frozen=True)
class FlexTarget:
    """The deployment with a flex pool: the dedicated pools (``dedicated``: their sizes, bounds, SLO and the
    planner's settings) and the flex workers."""

    dedicated: Target
    workers: tuple[FlexWorker, ...] = ()
    flex_min: int = 0
    flex_max: int = 0
    # flex workers kept beyond what both roles need, in the role under more pressure: one pooled headroom
    # for either role to take in a drain's seconds (0: none; every spare is a role's own surplus)
    spare: int = 0

    def count(self, role: str) -> int:
        return sum(1 for w in self.workers if w.role == role)

    def combined(self) -> Target:
        """The role totals as :func:`decide` sizes them: dedicated replicas plus the flex workers in that
        role (those switching to it included: they serve it within a drain). A flex worker has a replica's
        shape (the spec refuses one that cannot serve both roles), so the budget counts it as one."""
        t = self.dedicated
        return replace(t, prefill=t.prefill + self.count("prefill"), decode=t.decode + self.count("decode"),
                       prefill_max=t.prefill_max + self.flex_max, decode_max=t.decode_max + self.flex_max)


@dataclass(frozen=True)
class FlexMemory:
    """The planner's memory plus what the fast path needs from the last decision: each role's keep size."""

    planner: Memory = field(default_factory=Memory)
    keep: tuple[int | None, int | None] = (None, None)   # (prefill, decode)
    removed_at: float | None = None                      # when a flex worker was last removed


@dataclass(frozen=True)
class FlexDecision:
    decision: Decision                       # decide's (or react's) ask for the role totals, its inputs and prediction
    prefill: int                             # dedicated prefill replicas
    decode: int                              # dedicated decode replicas
    roles: tuple[tuple[str, str], ...]       # each flex worker kept: (name, role after this decision)
    add: tuple[str, ...] = ()                # the role of each new flex worker
    remove: tuple[str, ...] = ()             # flex workers to drain and remove
    switches: tuple[tuple[str, str, str], ...] = ()   # (name, from, to)
    reason: str = ""
    message: str = ""

    @property
    def flex(self) -> int:
        return len(self.roles) + len(self.add)

    def total(self, role: str) -> int:
        """Replicas serving ``role`` once this decision is carried out (dedicated + flex)."""
        return ((self.prefill if role == "prefill" else self.decode) + sum(1 for _, r in self.roles if r == role)
                + sum(1 for r in self.add if r == role))

    def records(self, target: FlexTarget) -> list[tuple[str, str, str]]:
        """``(role, direction, reason)`` per change, the labels of ``disagg_planner_decisions_total``
        (role ``flex`` for the pool; a switch is one role up and the other down, reason ``RoleSwitched``)."""
        out = []
        for role, before, after in (("prefill", target.dedicated.prefill, self.prefill),
                                    ("decode", target.dedicated.decode, self.decode),
                                    ("flex", len(target.workers), self.flex)):
            if after != before:
                out.append((role, "up" if after > before else "down", self.reason))
        for _name, frm, to in self.switches:
            out += [(to, "up", ROLE_SWITCHED), (frm, "down", ROLE_SWITCHED)]
        return out


def allocate(target: FlexTarget, want: dict[str, int], keep: dict[str, int | None], now: float,
             decision: Decision, spare_role: str = "prefill", need: dict[str, int] | None = None,
             remake_spare: bool = True) -> FlexDecision:
    """Split role totals ``want`` between dedicated replicas and flex workers: switch, then grow, then
    shrink (see the module's docstring). ``keep``: the least each role keeps (None: give nothing away);
    ``spare_role``: where the pool's spare workers (``target.spare``) wait; ``need``: what each role needs
    before hysteresis and cooldown (``RoleDecision.needed``; default ``want``), the spare's baseline;
    ``remake_spare``: False within a cooldown of the pool's last removal (a need that moves by one between
    intervals otherwise removes a worker and starts a new one in turn)."""
    ded_t = target.dedicated
    ded = {"prefill": ded_t.prefill, "decode": ded_t.decode}
    floor = {"prefill": ded_t.floor_prefill, "decode": ded_t.floor_decode}
    ceiling = {"prefill": max(ded_t.prefill_max, ded_t.floor_prefill),
               "decode": max(ded_t.decode_max, ded_t.floor_decode)}
    workers = {w.name: w for w in target.workers}
    roles = {w.name: w.role for w in target.workers}
    want = dict(want)

    def total(role: str) -> int:
        return ded[role] + sum(1 for r in roles.values() if r == role)

    # 1. switch before scale
    switched: dict[str, tuple[str, str]] = {}
    for to in ROLES:
        frm = _other(to)
        short = want[to] - total(to)
        if short <= 0 or keep.get(frm) is None:
            continue
        spare = total(frm) - max(keep[frm], floor[frm])
        if spare <= 0:
            continue
        donors = [w for w in target.workers if roles[w.name] == frm and w.name not in switched and (
            w.state in (STARTING, SWITCHING) or now - w.since >= SWITCH_DWELL)]
        # a starting worker drains nothing; one switching towards ``frm`` goes back to serving ``to`` at once
        donors.sort(key=lambda w: ({SWITCHING: 0, STARTING: 1}.get(w.state, 2), w.load, w.since, w.name))
        for w in donors[:min(short, spare)]:
            roles[w.name] = to
            switched[w.name] = (frm, to)
        # the role switched from is left where it now stands (a further shrink only if decide asked for it)
        want[frm] = min(want[frm], total(frm))

    # 2. grow: the flex pool first (the other role had nothing to spare), then the dedicated pools
    add: list[str] = []
    room = max(target.flex_max - len(roles), 0)
    short = {role: max(want[role] - total(role), 0) for role in ROLES}
    while room > 0 and any(short.values()):   # the pool's room in turns, so neither role takes it all
        for role in ROLES:
            if short[role] and room:
                add.append(role)
                short[role] -= 1
                room -= 1
    for role in ROLES:
        ded[role] = min(ded[role] + short[role], max(ceiling[role], ded[role]))
    # the pooled spare: flex workers beyond both roles' need (what decide keeps for hysteresis or cooldown
    # counts), within the pool's room and the GPU budget
    need = {role: min(want[role], (need or want)[role]) for role in ROLES}
    surplus = sum(total(role) + add.count(role) - need[role] for role in ROLES)
    budget = ded_t.gpu_budget
    while remake_spare and surplus < target.spare and room > 0 and (budget is None or ded_t.gpus(
            total("prefill") + add.count("prefill") + (spare_role == "prefill"),
            total("decode") + add.count("decode") + (spare_role == "decode")) <= budget):
        add.append(spare_role)
        surplus += 1
        room -= 1

    # 3. shrink where decide let a role shrink (never below the pooled spare)
    remove: list[str] = []
    excess = {role: total(role) + add.count(role) - want[role] for role in ROLES}
    both_idle = all(excess[role] > 0 for role in ROLES)
    removable = min(sum(max(e, 0) for e in excess.values()), max(surplus - target.spare, 0))
    for role in sorted(ROLES, key=lambda r: r == spare_role):   # the spare's role last
        n = min(excess[role], removable)
        if n <= 0:
            continue
        removable -= n

        def drop_flex(n: int) -> int:
            cands = sorted((workers[name] for name, r in roles.items() if r == role and name not in remove
                            and name not in switched),
                           key=lambda w: (w.state != STARTING, w.load, -w.since, w.name))
            for w in cands:
                if n <= 0 or len(roles) - len(remove) + len(add) <= target.flex_min:
                    break
                remove.append(w.name)
                n -= 1
            return n

        def drop_dedicated(n: int) -> int:
            k = min(n, max(ded[role] - floor[role], 0))
            ded[role] -= k
            return n - k

        n = drop_dedicated(drop_flex(n)) if both_idle else drop_flex(drop_dedicated(n))

    kept = tuple((name, roles[name]) for name in sorted(roles) if name not in remove)
    switches = tuple((name, frm, to) for name, (frm, to) in sorted(switched.items()) if name not in remove)
    if decision.reason == BUDGET_LIMITED:
        reason = BUDGET_LIMITED
    elif switches:
        reason = ROLE_SWITCHED
    elif add:
        reason = FLEX_GROWN
    elif remove:
        reason = FLEX_SHRUNK
    elif decision.reason == SCALED and (ded["prefill"], ded["decode"]) == (ded_t.prefill, ded_t.decode):
        reason = STEADY    # decide's shrink was the pooled spare: nothing changes
    else:
        reason = decision.reason
    parts = []
    if switches:
        moved = {}
        for _, frm, to in switches:
            moved[(frm, to)] = moved.get((frm, to), 0) + 1
        parts.append(", ".join(f"{n} {frm}->{to}" for (frm, to), n in moved.items()) + " switched")
    if add:
        parts.append("new " + ", ".join(f"{add.count(r)} {r}" for r in ROLES if add.count(r)))
    if remove:
        parts.append(f"removing {len(remove)}")
    flex_n = len(kept) + len(add)
    message = (f"flex {len(target.workers)}->{flex_n} ({'; '.join(parts) or 'unchanged'}), dedicated prefill "
               f"{ded_t.prefill}->{ded['prefill']} decode {ded_t.decode}->{ded['decode']}; " + decision.message)
    return FlexDecision(decision, ded["prefill"], ded["decode"], kept, tuple(add), tuple(remove), switches,
                        reason, message)


def decide_flex(obs: Observation, target: FlexTarget, memory: FlexMemory, model: PerfModel | RoleModels,
                now: float, season_intervals: int = 0) -> tuple[FlexDecision, FlexMemory]:
    """The planner's decision with a flex pool: :func:`decide` on the role totals, then :func:`allocate`."""
    d, planner = decide(obs, target.combined(), memory.planner, model, now, season_intervals)
    keep = {"prefill": d.prefill.keep, "decode": d.decode.keep}
    if not d.metrics_ok:   # a hold: nothing switches, nothing is added or removed
        keep = {"prefill": None, "decode": None}
    fd = allocate(target, {"prefill": d.prefill.replicas, "decode": d.decode.replicas}, keep, now, d,
                  spare_role=_pressed(obs, target.dedicated),
                  need={"prefill": d.prefill.needed, "decode": d.decode.needed},
                  remake_spare=memory.removed_at is None or now - memory.removed_at >= target.dedicated.cooldown)
    return fd, FlexMemory(planner, (keep["prefill"], keep["decode"]), now if fd.remove else memory.removed_at)


def _pressed(obs: Observation, target: Target) -> str:
    """The role under more pressure: the larger observed latency as a share of its target (prefill on a tie)."""
    ttft = obs.ttft / target.ttft_target if obs.ttft is not None and target.ttft_target else 0.0
    itl = obs.itl / target.itl_target if obs.itl is not None and target.itl_target else 0.0
    return "decode" if itl > ttft else "prefill"


def react_flex(obs: Observation, target: FlexTarget, memory: FlexMemory, model: PerfModel | RoleModels,
               now: float) -> tuple[FlexDecision | None, FlexMemory]:
    """The fast path with a flex pool: :func:`react` on the role totals; what it asks is met by switching
    flex workers from the other role (down to what the last decision let it keep) before growing."""
    d, planner = react(obs, target.combined(), memory.planner, model, now)
    memory = replace(memory, planner=planner)
    if d is None:
        return None, memory
    keep = {"prefill": memory.keep[0], "decode": memory.keep[1]}
    return allocate(target, {"prefill": d.prefill.replicas, "decode": d.decode.replicas}, keep, now, d), memory
