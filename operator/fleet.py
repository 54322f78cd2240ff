"""One cluster-wide view of free GPUs for the capacity messages of every waiting gang.

Listing every node and bound pod per waiting gang per status refresh, through the
kubernetes client's model classes, kept two cores busy at fleet scale (100 gangs
waiting on a 1,000-node pool in bench/operator_scale.py: 3.3x the plain-Deployment
baseline and 570 MiB). One raw-JSON list at most every ``max_age`` seconds serves
them all; a message may be that much behind the cluster, which the next refresh
corrects.
"""

from __future__ import annotations

import json
import threading
import time

from . import capacity
from .children import Clients


class Fleet:
    def __init__(self, clients: Clients, max_age: float = 5.0):
        self._clients = clients
        self._max_age = max_age
        self._lock = threading.Lock()       # one list at a time; the other waiters reuse its result
        self._free: list[capacity.NodeFree] | None = None
        self._taken = 0.0

    def free_gpus(self) -> list[capacity.NodeFree]:
        with self._lock:
            if self._free is None or time.monotonic() - self._taken > self._max_age:
                core = self._clients.core
                nodes = _items(core.list_node(_preload_content=False))
                pods = _items(core.list_pod_for_all_namespaces(field_selector="spec.nodeName!=",
                                                               _preload_content=False))
                self._free, self._taken = capacity.free_gpus(nodes, pods), time.monotonic()
            return self._free


def _items(response) -> list[dict]:
    return json.loads(response.data)["items"]
