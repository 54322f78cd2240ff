"""Worker discovery in Kubernetes: the EndpointSlices of the deployment's prefill and decode Services (and
its flex Service, with spec.flex: each flex worker's serving role is its pod's LABEL_SERVING_ROLE, read from
the same pod list; a flex pod without one yet serves nothing).

Ready endpoints become workers (``http`` port -> base URL, ``kv-events`` and ``kv-replay`` ports -> ZMQ
endpoints);
endpoints that leave (scale-down, a failed pod, a terminating one) leave the pool and the index.
Each endpoint's pod (its ``targetRef``) gives the worker's KV revision and that revision's generation,
from the labels the operator renders (``disagg.api.contract.KV_REVISION_LABEL``): the router pairs
prefill and decode of one revision only (:mod:`.pairing`).
Polls with the Kubernetes client (slices are few and small; a watch would add little here). A poll is two
calls, both in the router's namespace and both selected by label, so their cost does not grow with the
other deployments there: ``list`` of the EndpointSlices of the deployment's two role Services, and ``list``
of the deployment's worker pods as metadata only (PartialObjectMetadataList: names and labels, none of the
pods' specs). Each call has a timeout (disagg.api.kube.KUBE_REQUEST_TIMEOUT): a hung API server delays
discovery, never stops it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterable

from disagg.api import contract
from disagg.api.contract import KV_REVISION_GENERATION_LABEL, KV_REVISION_LABEL
from disagg.api.kube import KUBE_REQUEST_TIMEOUT
from disagg.api.names import (GROUP, LABEL_DEPLOYMENT, LABEL_HEADLESS, LABEL_ROLE, LABEL_SERVING_ROLE,
                              ROLE_DECODE, ROLE_FLEX, ROLE_PREFILL, SERVING_ROLES, child_name)
from disagg.api.v1alpha1 import API_VERSION, KIND, PLURAL, VERSION

from .config import FlexEndpoint, WorkerEndpoint

log = logging.getLogger("disagg.router.discovery")
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# the API server answers a list with the objects' metadata alone (meta.k8s.io/v1, Kubernetes >= 1.15)
PARTIAL_METADATA_LIST = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"
# the field manager of status.adapters (the operator's status fields are its own)
ROUTER_FIELD_MANAGER = "disagg-router"


def _revisions(pods: Iterable[tuple[str, dict | None]]) -> dict[str, tuple[str, int | None]]:
    out = {}
    for name, labels in pods:
        labels = labels or {}
        if KV_REVISION_LABEL in labels:
            gen = labels.get(KV_REVISION_GENERATION_LABEL, "")
            out[name] = (labels[KV_REVISION_LABEL], int(gen) if gen.isdigit() else None)
    return out


def revisions_from_pods(pods: list) -> dict[str, tuple[str, int | None]]:
    """Pod name -> (KV revision, its generation) of the pods (V1Pod objects) that carry one."""
    return _revisions((p.metadata.name, p.metadata.labels) for p in pods)


def revisions_from_metadata(items: list[dict]) -> dict[str, tuple[str, int | None]]:
    """The same, of a PartialObjectMetadataList's items (JSON)."""
    return _revisions((i["metadata"]["name"], i["metadata"].get("labels")) for i in items)


def serving_roles_from_metadata(items: list[dict]) -> dict[str, str]:
    """Pod name -> the role a flex pod serves now, of a PartialObjectMetadataList's items (JSON)."""
    out = {}
    for i in items:
        labels = i["metadata"].get("labels") or {}
        if labels.get(LABEL_ROLE) == ROLE_FLEX and labels.get(LABEL_SERVING_ROLE) in SERVING_ROLES:
            out[i["metadata"]["name"]] = labels[LABEL_SERVING_ROLE]
    return out


def flex_endpoints(endpoints: list[tuple[str | None, WorkerEndpoint]], roles: dict[str, str]) -> list[FlexEndpoint]:
    """The flex workers among (pod, endpoint) pairs, each in its pod's serving role; one whose pod has none
    yet (the operator labels new flex pods) is left out."""
    return [FlexEndpoint(**e.model_dump(), role=roles[pod]) for pod, e in endpoints if pod in roles]


def deployment_of(services: dict[str, str]) -> str | None:
    """The DisaggDeployment whose role Services these are, as the operator names them
    (``names.child_name(deployment, role)``), or None when they are not named so."""
    name = services[ROLE_PREFILL].removesuffix(f"-{ROLE_PREFILL}")
    if name and all(child_name(name, role) == svc for role, svc in services.items()):
        return name
    return None


def endpoints_from_slices(slices: list, revisions: dict[str, tuple[str, int | None]] | None = None
                          ) -> list[WorkerEndpoint]:
    """WorkerEndpoints of the ready, not terminating endpoints in ``slices`` (V1EndpointSlice objects);
    ``revisions`` (:func:`revisions_from_pods`) gives each its pod's KV revision."""
    return [e for _, e in pod_endpoints_from_slices(slices, revisions)]


def pod_endpoints_from_slices(slices: list, revisions: dict[str, tuple[str, int | None]] | None = None
                              ) -> list[tuple[str | None, WorkerEndpoint]]:
    """:func:`endpoints_from_slices`, each with its pod's name (None when the endpoint names no pod)."""
    revisions = revisions or {}
    out: dict[str, tuple[str | None, WorkerEndpoint]] = {}
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
                out[url] = (pod, WorkerEndpoint(url=url, kv_events=events, kv_replay=replay, revision=revision,
                                                revision_generation=generation))
    return [out[k] for k in sorted(out)]


class EndpointSliceDiscovery:
    """The workers of one DisaggDeployment: ``services`` maps each role to its Service; ``deployment`` (the
    DisaggDeployment's name, whose label its worker pods carry) defaults to the one the Services are
    named after."""

    def __init__(self, api_client, namespace: str, services: dict[str, str],
                 interval_s: float = contract.DISCOVERY_INTERVAL_SECONDS, deployment: str | None = None,
                 timeout_s: tuple[float, float] = KUBE_REQUEST_TIMEOUT):
        from kubernetes import client

        self._api = client.DiscoveryV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self.namespace, self.services, self.interval_s, self.timeout_s = namespace, services, interval_s, timeout_s
        deployment = deployment or deployment_of(services)
        if not deployment:
            raise ValueError(f"the DisaggDeployment of the Services {sorted(services.values())} is not known: "
                             "give it (--deployment)")
        self.deployment = deployment
        # this deployment's workers only: a namespace may hold many deployments (and other tenants' pods)
        # and of a replica that spans pods, its leader only: the others serve no API (an endpoint without a
        # pod here is left out, endpoints_from_slices)
        self.pod_selector = (f"{LABEL_DEPLOYMENT}={deployment},"
                             f"{LABEL_ROLE} in ({ROLE_PREFILL},{ROLE_DECODE},{ROLE_FLEX}),"
                             f"{KV_REVISION_LABEL},!{LABEL_HEADLESS}")
        self._role_of = {svc: role for role, svc in services.items()}
        self.slice_selector = f"{SERVICE_NAME_LABEL} in ({','.join(sorted(self._role_of))})"
        self._custom = client.CustomObjectsApi(api_client)
        # set by the fleet: told the deployment's LoRA adapters (spec.model.adapters, name -> source) at every
        # poll, so an adapter added or removed reaches the router with no restart (router/adapters.py)
        self.on_adapters = None
        # set by the fleet: status.adapters as the router sees it, written when it changes
        self.adapter_status = None
        self._reported: list | None = None

    def report_adapters(self, adapters: list[dict]) -> None:
        """status.adapters written (server-side apply, the routers' own field manager: the operator's status
        fields stay its own). Every router replica writes the same counts, seen from the same workers."""
        body = {"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": self.deployment},
                "status": {"adapters": adapters}}
        self._custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, self.namespace, PLURAL, self.deployment, body, field_manager=ROUTER_FIELD_MANAGER,
            force=True, _content_type="application/apply-patch+yaml", _request_timeout=self.timeout_s)

    def adapters(self) -> dict[str, str]:
        """The DisaggDeployment's LoRA adapters, name -> source (one ``get`` of that object alone)."""
        dd = self._custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, self.deployment,
                                                       _request_timeout=self.timeout_s)
        model = (dd.get("spec") or {}).get("model") or {}
        return {a["name"]: a["source"] for a in model.get("adapters") or []}

    def slices(self) -> dict[str, list]:
        """Role -> the EndpointSlices of its Service (one list for every role)."""
        out: dict[str, list] = {role: [] for role in self.services}
        for s in self._api.list_namespaced_endpoint_slice(self.namespace, label_selector=self.slice_selector,
                                                          _request_timeout=self.timeout_s).items:
            role = self._role_of.get((s.metadata.labels or {}).get(SERVICE_NAME_LABEL))
            if role is not None:
                out[role].append(s)
        return out

    def list(self, role: str, revisions: dict[str, tuple[str, int | None]] | None = None) -> list[WorkerEndpoint]:
        return endpoints_from_slices(self.slices()[role], self.revisions() if revisions is None else revisions)

    def worker_pods(self) -> dict:
        """The deployment's worker pods that carry a KV revision, as the API server's
        PartialObjectMetadataList (JSON)."""
        resp = self._core.list_namespaced_pod(self.namespace, label_selector=self.pod_selector,
                                              _headers={"Accept": PARTIAL_METADATA_LIST}, _preload_content=False,
                                              _request_timeout=self.timeout_s)
        try:
            return json.loads(resp.data)
        finally:
            resp.release_conn()

    def revisions(self) -> dict[str, tuple[str, int | None]]:
        """The deployment's worker pods' KV revisions."""
        return revisions_from_metadata(self.worker_pods().get("items") or [])

    def poll(self) -> dict[str, list[WorkerEndpoint]]:
        """Role -> its workers now (two API calls; raises what the API client raises); role "flex" (with a
        flex Service): FlexEndpoints, each in its serving role."""
        items = self.worker_pods().get("items") or []
        revisions = revisions_from_metadata(items)
        out: dict[str, list] = {}
        for role, slices in self.slices().items():
            pods = pod_endpoints_from_slices(slices, revisions)
            out[role] = (flex_endpoints(pods, serving_roles_from_metadata(items)) if role == ROLE_FLEX
                         else [e for _, e in pods])
        return out

    async def run(self, update) -> None:
        """Calls ``update(role, endpoints)`` now and after every poll, until cancelled."""
        while True:
            try:
                workers = await asyncio.to_thread(self.poll)
            except Exception as e:  # the API server away (or slow past the timeout): keep the last workers
                log.warning("listing the workers of %s failed: %s", self.deployment, e)
            else:
                for role, endpoints in workers.items():
                    update(role, endpoints)
            if self.on_adapters is not None:
                try:
                    sources = await asyncio.to_thread(self.adapters)
                except Exception as e:  # the last adapters stay
                    log.warning("reading the adapters of %s failed: %s", self.deployment, e)
                else:
                    self.on_adapters(sources)
            if self.adapter_status is not None:
                status = self.adapter_status()
                if status != self._reported:
                    try:
                        await asyncio.to_thread(self.report_adapters, status)
                    except Exception as e:  # tried again at the next poll
                        log.warning("writing the adapters' status of %s failed: %s", self.deployment, e)
                    else:
                        self._reported = status
            await asyncio.sleep(self.interval_s)
