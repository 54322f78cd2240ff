"""The executor: applies rendered children with server-side apply, writing
nothing when a child already carries the desired content hash, and deletes gang
objects no pod needs any more. Children are only touched when this
DisaggDeployment controls them."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from disagg.api import inferencepool as pools
from disagg.api import kube
from disagg.api.names import LABEL_DEPLOYMENT, LABEL_GANG, LABEL_GROUP

from . import gang as gangs
from .render import HASH_ANNOTATION

FIELD_MANAGER = "disagg-operator"
APPLY = "application/apply-patch+yaml"
# Every kind the operator writes, with its plural: a fixed table instead of API
# discovery, whose cache goes stale when CRDs (say, Volcano's) appear later.
PLURALS = {
    ("v1", "Service"): "services", ("v1", "ServiceAccount"): "serviceaccounts",
    ("apps/v1", "Deployment"): "deployments",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles", ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("networking.k8s.io/v1", "NetworkPolicy"): "networkpolicies",
    (gangs.WORKLOAD_API, "Workload"): "workloads", (gangs.WORKLOAD_API, "PodGroup"): "podgroups",
    (gangs.COMPOSITE_API, "CompositePodGroup"): "compositepodgroups",
    (gangs.COSCHEDULING_API, "PodGroup"): "podgroups", (gangs.VOLCANO_API, "PodGroup"): "podgroups",
    (pools.API_VERSION, pools.KIND): pools.PLURAL,
}
# Kinds whose API a cluster may lack (a CRD nobody installed) or the operator's role may lack (an older
# chart's): applying one then fails nothing else; apply() reports it instead (the status says so).
OPTIONAL_KINDS = {(pools.API_VERSION, pools.KIND)}
GANG_KINDS = [(gangs.WORKLOAD_API, "PodGroup"), (gangs.COMPOSITE_API, "CompositePodGroup"),
              (gangs.WORKLOAD_API, "Workload"), (gangs.COSCHEDULING_API, "PodGroup"),
              (gangs.VOLCANO_API, "PodGroup")]


class ChildConflict(Exception):
    """A child's name is taken by an object this DisaggDeployment does not control."""


class PredecessorChild(Exception):
    """A child's name is still held by a child of a deleted DisaggDeployment of the same name (names are
    unique in a namespace, so that owner is gone): the garbage collector is about to delete it."""


@dataclass
class Clients:
    api: client.ApiClient
    core: client.CoreV1Api
    custom: client.CustomObjectsApi

    @classmethod
    def create(cls, pool: int = 16) -> Clients:
        """In a pod: its ServiceAccount; elsewhere: $KUBECONFIG. `pool`: connections kept for reuse, one
        per thread that calls the API (the client's default, 5 per CPU, is 10 on 2 cores: with 16 threads,
        the ones beyond it opened a TLS connection per request and threw it away)."""
        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=cfg,
                                    persist_config=False)
        cfg.connection_pool_maxsize = pool
        api = kube.api_client(cfg)   # every call with a timeout: a hung API server fails a call, never a thread
        return cls(api=api, core=client.CoreV1Api(api), custom=client.CustomObjectsApi(api))

    # Uniform get/apply/list/delete over the kinds in PLURALS (core kinds through CoreV1Api).
    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            if api_version == "v1":
                read = getattr(self.core, f"read_namespaced_{_snake(kind)}")
                # raw JSON, as the custom-object calls return it: no model classes built and thrown away
                return json.loads(read(name, namespace, _preload_content=False).data)
            group, version = api_version.split("/")
            return self.custom.get_namespaced_custom_object(group, version, namespace, PLURALS[(api_version, kind)],
                                                            name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def apply(self, manifest: dict[str, Any]) -> None:
        api_version, kind, meta = manifest["apiVersion"], manifest["kind"], manifest["metadata"]
        # the response (the whole object as written) is read off the connection but never parsed: nobody
        # uses it, and 300 deployments' children parsed into dicts or model classes were CPU the reconciles
        # need at fleet scale
        opts = {"field_manager": FIELD_MANAGER, "force": True, "_content_type": APPLY, "_preload_content": False}
        if api_version == "v1":
            patch = getattr(self.core, f"patch_namespaced_{_snake(kind)}")
            patch(meta["name"], meta["namespace"], manifest, **opts).data
            return
        group, version = api_version.split("/")
        self.custom.patch_namespaced_custom_object(group, version, meta["namespace"], PLURALS[(api_version, kind)],
                                                   meta["name"], manifest, **opts).data

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]] | None:
        """Objects of that kind matching the selector; None when the API is not installed, or when the
        operator may not list it (the Helm chart grants an optional gang backend's PodGroups only when
        that backend is switched on: objects the operator may not list, it cannot have created)."""
        group, version = api_version.split("/")
        try:
            return self.custom.list_namespaced_custom_object(group, version, namespace, PLURALS[(api_version, kind)],
                                                             label_selector=selector)["items"]
        except ApiException as e:
            if e.status in (403, 404):
                return None
            raise

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        group, version = api_version.split("/")
        self.custom.delete_namespaced_custom_object(group, version, namespace, PLURALS[(api_version, kind)], name)


def _snake(kind: str) -> str:
    return "".join(f"_{c.lower()}" if c.isupper() else c for c in kind).lstrip("_")


def apply(clients: Clients, manifests: list[dict[str, Any]], owner_uid: str,
          unavailable: dict[str, int] | None = None) -> list[str]:
    """Apply each manifest unless the live object already has its hash and nobody else has changed
    its spec since. Returns the kinds written, one entry per write. A manifest of an OPTIONAL_KINDS kind
    the API server does not serve (404) or the operator may not write (403) is skipped, its kind and the
    status code put in ``unavailable``."""
    written = []
    for m in manifests:
        try:
            if _apply_one(clients, m, owner_uid):
                written.append(m["kind"])
        except ApiException as e:
            if (m["apiVersion"], m["kind"]) not in OPTIONAL_KINDS or e.status not in (403, 404):
                raise
            if unavailable is not None:
                unavailable[m["kind"]] = e.status
    return written


def _apply_one(clients: Clients, m: dict[str, Any], owner_uid: str) -> bool:
    """Apply one manifest (see apply); True when it was written."""
    meta = m["metadata"]
    live = clients.get(m["apiVersion"], m["kind"], meta["namespace"], meta["name"])
    if live is not None:
        owners = [o for o in live["metadata"].get("ownerReferences") or [] if o.get("controller")]
        if owners and owners[0]["uid"] != owner_uid:
            mine = (meta.get("ownerReferences") or [{}])[0]
            if (owners[0].get("kind"), owners[0].get("name")) == (mine.get("kind"), mine.get("name")):
                raise PredecessorChild(f"{m['kind']} {meta['name']} still belongs to the deleted "
                                       f"{owners[0]['kind']} of this name; waiting for its garbage collection")
            raise ChildConflict(f"{m['kind']} {meta['name']} is controlled by {owners[0]['kind']} "
                                f"{owners[0]['name']}, not by this DisaggDeployment")
        same = (live["metadata"].get("annotations") or {}).get(HASH_ANNOTATION) == meta["annotations"][HASH_ANNOTATION]
        if same and not drifted_by(live["metadata"]):
            return False
    clients.apply(m)
    return True


def drifted_by(meta: dict[str, Any]) -> str | None:
    """The field manager that changed this object's spec after the operator last applied it (a
    ``kubectl edit``, ``kubectl scale``, another controller), or None. Read from managedFields, so it
    needs no memory across restarts; status writers (subresource status) do not count."""
    ours, theirs = "", None
    latest = ""
    for e in meta.get("managedFields") or []:
        t = e.get("time") or "9999"     # writes through the scale subresource carry no time
        if e.get("manager") == FIELD_MANAGER and e.get("operation") == "Apply":
            ours = max(ours, t)
        elif e.get("subresource") != "status" and "f:spec" in (e.get("fieldsV1") or {}) and t >= latest:
            latest, theirs = t, e.get("manager") or "unknown"
    # times have one-second resolution: the same second counts as later (callers restore once per
    # generation, so a foreign entry that survives our apply, with fields we do not set, cannot loop)
    return theirs if theirs and latest >= ours else None


def delete_owned(clients: Clients, api_version: str, kind: str, namespace: str, name: str, owner_uid: str) -> bool:
    """Delete a child this DisaggDeployment controls and no longer renders (its NetworkPolicy once the
    operator's networkPolicy option is off, its InferencePool back in proxy mode); True when one was deleted.
    A kind whose API the cluster does not serve has nothing to delete (the get answers 404: None)."""
    try:
        live = clients.get(api_version, kind, namespace, name)
    except ApiException as e:
        if e.status == 403 and (api_version, kind) in OPTIONAL_KINDS:
            return False   # an optional API the operator may not read: it cannot have made one
        raise
    owners = [o for o in (live or {}).get("metadata", {}).get("ownerReferences") or [] if o.get("controller")]
    if not owners or owners[0]["uid"] != owner_uid:
        return False
    try:
        clients.delete(api_version, kind, namespace, name)
    except ApiException as e:
        if e.status == 404:
            return False
        raise
    return True


def prune_gangs(clients: Clients, namespace: str, dd_name: str, keep: set[str], current_gang: str) -> list[str] | None:
    """Delete this deployment's gang objects that are no longer desired, once no pod of an old gang remains.
    Returns what it deleted, or None while a pod of an old gang remains (nothing was checked: ask again)."""
    # one pod is answer enough, and as raw JSON (the client's pod models are costly to build)
    old_pods = clients.core.list_namespaced_pod(
        namespace, label_selector=f"{LABEL_DEPLOYMENT}={dd_name},{LABEL_GANG},{LABEL_GANG}!={current_gang}",
        limit=1, _preload_content=False)
    if json.loads(old_pods.data).get("items"):
        return None
    deleted = []
    for api_version, kind in GANG_KINDS:
        for obj in clients.list(api_version, kind, namespace, f"{LABEL_DEPLOYMENT}={dd_name}") or []:
            labels = obj["metadata"].get("labels") or {}
            if labels.get(LABEL_GROUP) and labels.get(LABEL_GANG) == current_gang:
                continue   # a multi-pod replica's own PodGroup (operator/groups.py): goes with its group
            if obj["metadata"]["name"] not in keep:
                clients.delete(api_version, kind, namespace, obj["metadata"]["name"])
                deleted.append(f"{kind}/{obj['metadata']['name']}")
    return deleted
