"""One cluster-wide view of free GPUs for the capacity messages of every waiting gang.

Listing every node and bound pod per waiting gang per status refresh, through the
kubernetes client's model classes, kept two cores busy at fleet scale (100 gangs
waiting on a 1,000-node pool in bench/operator_scale.py: 3.3x the plain-Deployment
baseline and 570 MiB). One raw-JSON list at most every ``max_age`` seconds serves
them all; a message may be that much behind the cluster, which the next refresh
corrects.

Free GPUs depend on every pod bound to a GPU node, the operator's or not, so this is
the one list that cannot be scoped to what the operator owns. It is kept small
instead: the API server filters out unbound and finished pods (field selectors), and
both lists come in pages of ``page`` items that are folded into per-node counts as
they arrive, so memory holds one page, never the cluster.
"""

from __future__ import annotations

import json
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


class Fleet:
    def __init__(self, clients: Clients, max_age: float = 5.0, page: int = PAGE):
        self._clients = clients
        self._max_age = max_age
        self._page = page
        self._lock = threading.Lock()       # one list at a time; the other waiters reuse its result
        self._free: list[capacity.NodeFree] | None = None
        self._taken = 0.0

    def free_gpus(self) -> list[capacity.NodeFree]:
        with self._lock:
            if self._free is None or time.monotonic() - self._taken > self._max_age:
                try:
                    free = self._list()
                except ApiException as e:
                    if e.status != 410:
                        raise
                    # a continue token expired mid-list (the API server's snapshot is gone): the
                    # counts folded so far are of another moment, so count again from the start
                    free = self._list()
                self._free, self._taken = free, time.monotonic()
            return self._free

    def _list(self) -> list[capacity.NodeFree]:
        core = self._clients.core
        used = capacity.used_gpus(pages(core.list_pod_for_all_namespaces, self._page, field_selector=BOUND_PODS))
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
