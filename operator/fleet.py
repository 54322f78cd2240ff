"""One cluster-wide view of free GPUs for the capacity messages of every waiting gang.

Listing every node and bound pod per waiting gang per status refresh, through the
kubernetes client's model classes, kept two cores busy at fleet scale (100 gangs
waiting on a 1,000-node pool in bench/operator_scale.py: 3.3x the plain-Deployment
baseline and 570 MiB). One raw-JSON list at most every ``max_age`` seconds (longer when
lists are expensive) serves them all; a message may be that much behind the cluster,
which the next refresh corrects.

Free GPUs depend on every pod bound to a GPU node, the operator's or not. Reading every
tenant's pods means reading every tenant's pod specs (their plain environment values
among them), so an operator that serves only some namespaces (the chart's
operator.watchNamespaces) counts the pods of those namespaces alone by default, and its
messages say that other namespaces' pods are not counted; the chart's
operator.capacity.countAllNamespaces grants the cluster-wide list and counts them all
(DISAGG_CAPACITY_ALL_NAMESPACES). An operator serving every namespace can read every pod
anyway, and counts them all. The lists are kept small: the API server filters out unbound
and finished pods (field selectors), and both lists come in pages of ``page`` items that
are folded into per-node counts as they arrive, so memory holds one page, never the cluster.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from kubernetes.client.exceptions import ApiException

from . import capacity, memory
from .children import Clients

# Pods that hold GPUs: bound to a node and not finished.
BOUND_PODS = "spec.nodeName!=,status.phase!=Succeeded,status.phase!=Failed"
PAGE = 500
ALL_NAMESPACES_ENV = "DISAGG_CAPACITY_ALL_NAMESPACES"


def counts_all_namespaces() -> bool:
    return os.environ.get(ALL_NAMESPACES_ENV, "false").strip().lower() in ("true", "1", "yes", "on")


class Fleet:
    """Free GPUs per node, listed at most every ``max_age`` seconds, and less often when a list is
    expensive: its CPU time is kept under ``max_share`` of the time between lists (a 3,000-node fleet
    costs ~1-2 CPU-seconds a list; listed every 5 s while hundreds of gangs wait to be scheduled, that
    was a third of a core, taken from the reconciles and the status loops that make the gangs Ready).

    One thread lists at a time. The others get the last counts meanwhile instead of waiting: they are
    status refreshes sharing kopf's thread pool, and blocking them on the lock stalled every reconcile
    queued behind them. Only the very first list is waited for."""

    def __init__(self, clients: Clients, max_age: float = 5.0, page: int = PAGE, max_share: float = 0.1,
                 namespaces: tuple[str, ...] = ()):
        """``namespaces``: count only the pods of these (empty: every namespace's)."""
        self._clients = clients
        self.namespaces = tuple(namespaces)
        self._max_age = max_age
        self._max_share = max_share
        self._page = page
        self._listing = threading.Lock()
        self._free: list[capacity.NodeFree] | None = None
        # the explanations computed on one list of free GPUs, by what the gang asks for (see explain)
        self._explained: tuple[list[capacity.NodeFree] | None, dict[tuple, tuple[bool, str]]] = (None, {})
        self._taken = 0.0
        self._cost = 0.0   # CPU seconds the last list took

    @property
    def age_limit(self) -> float:
        """How old the counts may get before the next caller lists again."""
        return max(self._max_age, self._cost / self._max_share)

    def free_gpus(self) -> list[capacity.NodeFree]:
        free = self._free
        if free is not None and time.monotonic() - self._taken <= self.age_limit:
            return free
        if not self._listing.acquire(blocking=free is None):
            return free   # another thread is listing: the last counts serve until it is done
        try:
            if self._free is not None and time.monotonic() - self._taken <= self.age_limit:
                return self._free   # listed while this thread waited for the first list
            started = time.thread_time()
            try:
                free = self._list()
            except ApiException as e:
                if e.status != 410:
                    raise
                # a continue token expired mid-list (the API server's snapshot is gone): the
                # counts folded so far are of another moment, so count again from the start
                free = self._list()
            self._cost = time.thread_time() - started
            self._free, self._taken = free, time.monotonic()
            return free
        finally:
            self._listing.release()

    def explain(self, roles: list[capacity.RoleNeed], key: str | None) -> tuple[bool, str]:
        """capacity.explain on the current counts, computed once per list and gang shape: every waiting
        gang's refresh asked for it, and at fleet scale most gangs ask the same (300 gangs waiting on 3,000
        nodes: a sixth of the operator's time went to recomputing one answer, bench/operator_scale.py
        --profile)."""
        free = self.free_gpus()
        seen, answers = self._explained
        if seen is not free:
            answers = {}
            self._explained = (free, answers)
        shape = (key, tuple((r.role, r.replicas, r.gpus, tuple(sorted(r.node_selector.items())),
                             tuple((t.key, t.operator, t.value, t.effect) for t in r.tolerations)) for r in roles))
        answer = answers.get(shape)
        if answer is None:
            fits, message = capacity.explain(free, roles, key)
            if self.namespaces and not fits:
                message += (f" (GPUs held by pods outside {', '.join(self.namespaces)} are not counted: the "
                            "operator does not read other namespaces' pods; the chart's "
                            "operator.capacity.countAllNamespaces counts them)")
            answer = answers[shape] = (fits, message)
        return answer

    def _list(self) -> list[capacity.NodeFree]:
        core = self._clients.core
        if self.namespaces:
            bound = (p for ns in self.namespaces
                     for p in pages(core.list_namespaced_pod, self._page, namespace=ns, field_selector=BOUND_PODS))
        else:
            bound = pages(core.list_pod_for_all_namespaces, self._page, field_selector=BOUND_PODS)
        used = capacity.used_gpus(bound)
        free = capacity.free_gpus(pages(core.list_node, self._page), used)
        memory.trim()  # the pages' text and objects are freed now: return that heap to the system at once
        return free


def pages(list_call: Callable[..., Any], limit: int, **kwargs: Any) -> Iterator[dict]:
    """Every item of a list call, fetched `limit` at a time (limit/continue), as raw JSON dicts
    (the client's model classes cost more than the counting they would feed)."""
    token = None
    while True:
        extra = {"_continue": token} if token else {}
        body = json.loads(list_call(limit=limit, _preload_content=False, **extra, **kwargs).data)
        yield from body.get("items") or []
        token = (body.get("metadata") or {}).get("continue")
        if not token:
            return
