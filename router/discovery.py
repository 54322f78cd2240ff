"""Worker discovery in Kubernetes: the EndpointSlices of the deployment's prefill and decode Services.

Ready endpoints become workers (``http`` port -> base URL, ``kv-events`` and ``kv-replay`` ports -> ZMQ
endpoints);
endpoints that leave (scale-down, a failed pod, a terminating one) leave the pool and the index.
Polls with the Kubernetes client (slices are few and small; a watch would add little here).
"""

from __future__ import annotations

import asyncio
import logging

from .config import WorkerEndpoint

log = logging.getLogger("disagg.router.discovery")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def endpoints_from_slices(slices: list) -> list[WorkerEndpoint]:
    """WorkerEndpoints of the ready, not terminating endpoints in ``slices`` (V1EndpointSlice objects)."""
    out: dict[str, WorkerEndpoint] = {}
    for s in slices:
        ports = {p.name: p.port for p in (s.ports or [])}
        if "http" not in ports:
            continue
        for ep in s.endpoints or []:
            cond = ep.conditions
            if cond is not None and (cond.ready is False or cond.terminating):
                continue
            for ip in ep.addresses or []:
                host = f"[{ip}]" if ":" in ip else ip
                url = f"http://{host}:{ports['http']}"
                events = f"tcp://{host}:{ports['kv-events']}" if "kv-events" in ports else None
                replay = f"tcp://{host}:{ports['kv-replay']}" if "kv-replay" in ports else None
                out[url] = WorkerEndpoint(url=url, kv_events=events, kv_replay=replay)
    return [out[k] for k in sorted(out)]


class EndpointSliceDiscovery:
    def __init__(self, api_client, namespace: str, services: dict[str, str], interval_s: float = 5.0):
        from kubernetes import client

        self._api = client.DiscoveryV1Api(api_client)
        self.namespace, self.services, self.interval_s = namespace, services, interval_s

    def list(self, role: str) -> list[WorkerEndpoint]:
        slices = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"{SERVICE_NAME_LABEL}={self.services[role]}").items
        return endpoints_from_slices(slices)

    async def run(self, update) -> None:
        """Calls ``update(role, endpoints)`` now and after every poll, until cancelled."""
        while True:
            for role in self.services:
                try:
                    update(role, await asyncio.to_thread(self.list, role))
                except Exception as e:  # the API server being away keeps the last known workers
                    log.warning("listing EndpointSlices of %s failed: %s", self.services[role], e)
            await asyncio.sleep(self.interval_s)
