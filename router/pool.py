"""The workers the router knows, their loads, and how they are discovered.

Discovery is a static list (local runs, tests) or, in Kubernetes, the
EndpointSlices of the deployment's prefill and decode Services.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from disagg.api.names import ROLE_DECODE, ROLE_PREFILL

from .config import RouterConfig, WorkerEndpoint

if TYPE_CHECKING:       # imported where a stream first connects: the routing decision loads no HTTP client
    from .upstream import Target


@dataclass(eq=False)
class Hold:
    """KV blocks a prefill holds for one hand-off until its decode pulls them. ``deadline`` (monotonic) is
    when NixlConnector's lease frees them; None while a decode waits for them, whose heartbeats extend the
    lease."""
    deadline: float | None


@dataclass
class Worker:
    name: str           # its base URL: unique, and what metrics label it with
    role: str
    url: str
    kv_events: str | None = None
    kv_replay: str | None = None
    active: int = 0
    healthy: bool = True
    revision: str | None = None            # KV revision: paired with the other role's of the same only
    revision_generation: int | None = None  # orders revisions (the newest complete one takes new requests)
    # a flex worker (spec.flex) serves ``role`` until its serving role changes; then ``switching_to`` names
    # the new one while it drains, taking no new work of either role (Fleet.update_flex)
    flex: bool = False
    switching_to: str | None = None
    holds: set[Hold] = field(default_factory=set, repr=False, compare=False)
    # set on every change a drain waits for (a request ended, a hold released), while one waits
    settled: asyncio.Event | None = field(default=None, repr=False, compare=False)
    # LoRA adapters it holds, as the router loaded them or saw them on its /v1/models (router/adapters.py);
    # a request for an adapter goes only to a worker holding it
    adapters: set[str] = field(default_factory=set)
    adapter_errors: dict[str, str] = field(default_factory=dict)   # adapter -> why its load failed here
    # the adapters with requests running, and waiting for an adapter slot, on it, as its engine last reported
    # them (vllm:lora_requests_info, read with each adapter sync): lora_affinity's input beside the router's own
    # decisions, which miss the other router replicas' requests and the queue
    lora_running: set[str] = field(default_factory=set)
    lora_waiting: set[str] = field(default_factory=set)
    _target: Target | None = field(default=None, repr=False, compare=False)

    @property
    def target(self) -> Target:
        """Where its streams connect (router/upstream.py), parsed once."""
        if self._target is None:
            from .upstream import Target
            self._target = Target.parse(self.url)
        return self._target


@dataclass
class Pool:
    workers: dict[str, dict[str, Worker]] = field(
        default_factory=lambda: {ROLE_PREFILL: {}, ROLE_DECODE: {}})
    # the flex workers by name, each also in workers[its serving role]
    flex: dict[str, Worker] = field(default_factory=dict)

    @classmethod
    def static(cls, config: RouterConfig) -> Pool:
        pool = cls()
        pool.set(ROLE_PREFILL, config.prefill)
        pool.set(ROLE_DECODE, config.decode)
        return pool

    def set(self, role: str, endpoints: list[WorkerEndpoint]) -> tuple[list[Worker], list[Worker]]:
        """Replace a role's dedicated workers, keeping the state of those that stay; returns (added, removed).
        The flex workers serving it stay (Fleet.update_flex keeps them)."""
        current = self.workers[role]
        wanted = {e.url.rstrip("/"): e for e in endpoints}
        removed = [current.pop(name) for name in list(current) if name not in wanted and not current[name].flex]
        added = []
        for name, e in wanted.items():
            if name in self.flex:       # one engine, two listings (a pod relabelled between polls): flex wins
                continue
            if name not in current:
                current[name] = Worker(name=name, role=role, url=name, kv_events=e.kv_events,
                                       kv_replay=e.kv_replay)
                added.append(current[name])
            # a revision learned late (its pod listed after its endpoint) is taken as it comes
            current[name].revision, current[name].revision_generation = e.revision, e.revision_generation
        return added, removed

    def healthy(self, role: str, exclude: set[str] = frozenset()) -> list[Worker]:
        """Who may take new work of ``role``: a flex worker that is switching takes none (its drain)."""
        return [w for w in self.workers[role].values()
                if w.healthy and w.switching_to is None and w.name not in exclude]

    def all(self) -> list[Worker]:
        return [w for role in self.workers.values() for w in role.values()]
