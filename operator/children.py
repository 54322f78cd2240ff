"""The executor: applies rendered children with server-side apply, writing
nothing when a child already carries the desired content hash, and deletes gang
objects no pod needs any more. Children are only touched when this
DisaggDeployment controls them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError, ResourceNotFoundError

from disagg.api.names import LABEL_DEPLOYMENT, LABEL_GANG

from . import gang as gangs
from .render import HASH_ANNOTATION

FIELD_MANAGER = "disagg-operator"
GANG_KINDS = [(gangs.WORKLOAD_API, "PodGroup"), (gangs.COMPOSITE_API, "CompositePodGroup"),
              (gangs.WORKLOAD_API, "Workload"), (gangs.COSCHEDULING_API, "PodGroup"),
              (gangs.VOLCANO_API, "PodGroup")]


class ChildConflict(Exception):
    """A child's name is taken by an object this DisaggDeployment does not control."""


@dataclass
class Clients:
    api: client.ApiClient
    dyn: DynamicClient
    core: client.CoreV1Api
    custom: client.CustomObjectsApi

    @classmethod
    def create(cls) -> Clients:
        try:
            config.load_incluster_config()
            api = client.ApiClient()
        except config.ConfigException:
            api = config.new_client_from_config(config_file=os.environ.get("KUBECONFIG"))
        return cls(api=api, dyn=DynamicClient(api), core=client.CoreV1Api(api), custom=client.CustomObjectsApi(api))

    def resource(self, api_version: str, kind: str):
        return self.dyn.resources.get(api_version=api_version, kind=kind)


def apply(clients: Clients, manifests: list[dict[str, Any]], owner_uid: str) -> int:
    """Apply each manifest unless the live object already has its hash. Returns the number of writes."""
    writes = 0
    for m in manifests:
        res = clients.resource(m["apiVersion"], m["kind"])
        meta = m["metadata"]
        try:
            live = res.get(name=meta["name"], namespace=meta.get("namespace"))
        except NotFoundError:
            live = None
        if live is not None:
            owners = [o for o in (live.metadata.ownerReferences or []) if o.get("controller")]
            if owners and owners[0]["uid"] != owner_uid:
                raise ChildConflict(f"{m['kind']} {meta['name']} is controlled by {owners[0]['kind']} "
                                    f"{owners[0]['name']}, not by this DisaggDeployment")
            if (live.metadata.annotations or {}).get(HASH_ANNOTATION) == meta["annotations"][HASH_ANNOTATION]:
                continue
        res.server_side_apply(body=m, name=meta["name"], namespace=meta.get("namespace"),
                              field_manager=FIELD_MANAGER, force_conflicts=True)
        writes += 1
    return writes


def prune_gangs(clients: Clients, namespace: str, dd_name: str, keep: set[str], current_gang: str) -> list[str]:
    """Delete this deployment's gang objects that are no longer desired, once no pod of an old gang remains."""
    old_pods = clients.core.list_namespaced_pod(
        namespace, label_selector=f"{LABEL_DEPLOYMENT}={dd_name},{LABEL_GANG},{LABEL_GANG}!={current_gang}").items
    if old_pods:
        return []
    deleted = []
    for api_version, kind in GANG_KINDS:
        try:
            res = clients.resource(api_version, kind)
        except ResourceNotFoundError:
            continue  # that scheduler's API is not installed
        for obj in res.get(namespace=namespace, label_selector=f"{LABEL_DEPLOYMENT}={dd_name}").items:
            if obj.metadata.name not in keep:
                res.delete(name=obj.metadata.name, namespace=namespace)
                deleted.append(f"{kind}/{obj.metadata.name}")
    return deleted
