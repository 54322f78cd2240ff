"""Worker discovery in Kubernetes: the EndpointSlices of the deployment's prefill and decode Services.

Ready endpoints become workers (``http`` port -> base URL, ``kv-events`` and ``kv-replay`` ports -> ZMQ
endpoints);
endpoints that leave (scale-down, a failed pod, a terminating one) leave the pool and the index.
Each endpoint's pod (its ``targetRef``) gives the worker's KV revision and that revision's generation,
from the labels the operator renders (``disagg.api.contract.KV_REVISION_LABEL``): the router pairs
prefill and decode of one revision only (:mod:`.pairing`).
Polls with the Kubernetes client (slices are few and small; a watch would add little here).
"""

from __future__ import annotations

import asyncio
import logging

from disagg.api import contract
from disagg.api.contract import KV_REVISION_GENERATION_LABEL, KV_REVISION_LABEL

from .config import WorkerEndpoint

log = logging.getLogger("disagg.router.discovery")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def revisions_from_pods(pods: list) -> dict[str, tuple[str, int | None]]:
    """Pod name -> (KV revision, its generation) of the pods (V1Pod objects) that carry one."""
    out = {}
    for p in pods:
        labels = p.metadata.labels or {}
        if KV_REVISION_LABEL in labels:
            gen = labels.get(KV_REVISION_GENERATION_LABEL, "")
            out[p.metadata.name] = (labels[KV_REVISION_LABEL], int(gen) if gen.isdigit() else None)
    return out


def endpoints_from_slices(slices: list, revisions: dict[str, tuple[str, int | None]] | None = None
                          ) -> list[WorkerEndpoint]:
    """WorkerEndpoints of the ready, not terminating endpoints in ``slices`` (V1EndpointSlice objects);
    ``revisions`` (:func:`revisions_from_pods`) gives each its pod's KV revision."""
    revisions = revisions or {}
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
                ref = ep.target_ref
                pod = ref.name if ref is not None and ref.kind == "Pod" else None
                if revisions and pod not in revisions:
                    # its pod was created after the pod list of this poll: without its revision it could
                    # be paired with anything; it joins at the next poll
                    continue
                revision, generation = revisions.get(pod, (None, None))
                out[url] = WorkerEndpoint(url=url, kv_events=events, kv_replay=replay, revision=revision,
                                          revision_generation=generation)
    return [out[k] for k in sorted(out)]


class EndpointSliceDiscovery:
    def __init__(self, api_client, namespace: str, services: dict[str, str],
                 interval_s: float = contract.DISCOVERY_INTERVAL_SECONDS):
        from kubernetes import client

        self._api = client.DiscoveryV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self.namespace, self.services, self.interval_s = namespace, services, interval_s

    def list(self, role: str, revisions: dict[str, tuple[str, int | None]] | None = None) -> list[WorkerEndpoint]:
        slices = self._api.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"{SERVICE_NAME_LABEL}={self.services[role]}").items
        return endpoints_from_slices(slices, self.revisions() if revisions is None else revisions)

    def revisions(self) -> dict[str, tuple[str, int | None]]:
        """The namespace's worker pods' KV revisions (one list, of the pods that carry the label)."""
        return revisions_from_pods(self._core.list_namespaced_pod(self.namespace,
                                                                  label_selector=KV_REVISION_LABEL).items)

    async def run(self, update) -> None:
        """Calls ``update(role, endpoints)`` now and after every poll, until cancelled."""
        while True:
            try:
                revisions = await asyncio.to_thread(self.revisions)
            except Exception as e:  # keep the workers; without revisions they cannot be paired safely
                log.warning("listing worker pods failed: %s", e)
                await asyncio.sleep(self.interval_s)
                continue
            for role in self.services:
                try:
                    update(role, await asyncio.to_thread(self.list, role, revisions))
                except Exception as e:  # the API server being away keeps the last known workers
                    log.warning("listing EndpointSlices of %s failed: %s", self.services[role], e)
            await asyncio.sleep(self.interval_s)
