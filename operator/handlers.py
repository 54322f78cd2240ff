"""kopf handlers: thin. Create, resume and update all call one level-based
reconcile(); a daemon per DisaggDeployment recomputes status whenever one of its
pods or Deployments changes (from kopf indexes, no list calls) and writes it
only when it changed."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError

from disagg.api import inferencepool as pools
from disagg.api import kube
from disagg.api.contract import KV_REVISION_GENERATION_LABEL, KV_REVISION_LABEL
from disagg.api.names import (GROUP, LABEL_DEPLOYMENT, LABEL_GANG, LABEL_GROUP, LABEL_GROUP_POD, LABEL_HEADLESS,
                               LABEL_MANAGED_BY, LABEL_ROLE, LABEL_SERVING_ROLE, MANAGED_BY,
                               ANNOTATION_OBSERVED_SERVING_ROLE, ROLE_DECODE, ROLE_FLEX, ROLE_PREFILL)
from disagg.api.v1alpha1 import GPU_RESOURCE, KIND, PLURAL, VERSION, ConditionType, DisaggDeployment

from . import capacity, children, flex, groups, render
from . import gang as gangs
from . import memory, metrics, revisions
from . import status as statuses
from .essence import LeanDiffBaseStorage
from .fleet import PAGE, Fleet, counts_all_namespaces

log = logging.getLogger("disagg.operator")
# A gang unplaced for this long gets its capacity explained (free GPUs per domain).
CAPACITY_AFTER_SECONDS = 5
TRIM_SECONDS = 60
# How often the status loop tries again to create a picker-mode deployment's InferencePool whose API was
# missing (its CRD installed later): one request each time.
POOL_RETRY_SECONDS = 30


# kopf's own HTTP connections (watches, its patches, events): at most this many besides the watches.
# kopf's default pool is unbounded: 300 DisaggDeployments created at once opened ~300 TLS connections,
# each with asyncio's 128 KiB read buffer, and the freed buffers stayed in the heap as fragments. Not
# much fewer, either: each new deployment waits for two of kopf's patches (its finalizer, then its
# handler's progress) before and after its reconcile, and on a saturated API server the operator's
# share of the server's concurrency is about as many requests as it keeps in flight.
API_CONNECTIONS = 64
WATCHED_KINDS = 4   # DisaggDeployments, pods, Deployments, NetworkPolicies: one watch each per namespace


@kopf.on.login()
async def login(**kwargs: Any) -> kopf.AiohttpSession | None:
    # In a pod: its ServiceAccount; elsewhere: $KUBECONFIG, read when the operator starts.
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    return None if info is None else bounded_session(info, WATCHED_KINDS * max(1, len(NAMESPACES)) + API_CONNECTIONS)


# the namespaces `python -m disagg.operator --namespace` restricts the watches to (empty: cluster-wide)
NAMESPACES: list[str] = []


def bounded_session(info: kopf.ConnectionInfo, limit: int) -> kopf.AiohttpSession:
    """kopf's session for these credentials, with at most `limit` connections. The limit must stay
    above the number of watches, which each hold one connection for as long as they stream; the rest
    is what requests wait for in turn instead of opening more."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, ssl=info.as_ssl_context()),
        headers=info.as_http_headers(), proxy=info.proxy_url, trust_env=info.trust_env)
    return kopf.AiohttpSession(server=info.server, default_namespace=info.default_namespace,
                               priority=info.priority, expiration=info.expiration, aiohttp_session=session)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf's own per-handler events are noise; the operator posts its decisions itself.
    settings.posting.level = logging.WARNING
    # An event is a record, best effort: kopf posts them one after another and by default retries a failed
    # post for 54 s (8 backoffs), so posts into a namespace being deleted (403 NamespaceTerminating) held
    # every later event, and the operator's shutdown, for a minute each. Three quick retries ride out an
    # API server blip.
    settings.posting.default_backoffs = (1, 2, 4)
    settings.persistence.finalizer = "serving.disagg.dev/operator"
    settings.persistence.diffbase_storage = LeanDiffBaseStorage()   # kopf's, without its deep copies
    settings.watching.server_timeout = 300
    # kopf's own calls (patches, events, the watches' connects) get a bound too: its default is none. The
    # watches' streams are bounded by server_timeout above (the API server closes them), then by this.
    settings.networking.request_timeout = settings.watching.server_timeout + kube.KUBE_REQUEST_TIMEOUT[1]
    settings.networking.connect_timeout = kube.KUBE_REQUEST_TIMEOUT[0]
    # No CRD or Namespace watches: the resources it serves are found once at start-up through discovery
    # (the CRD is installed before the operator), namespaces are the ones it is told; so its role needs
    # no cluster-wide read of CRDs or Namespaces (operator/rbac.yaml).
    settings.scanning.disabled = True
    # reconciles are sync (the kubernetes client) and mostly wait on the API server: more threads
    # than cores lets a burst of new deployments overlap those waits
    settings.execution.max_workers = 16
    # ...and the status loops' asyncio.to_thread calls share that pool, instead of a second one of
    # asyncio's own: fewer threads, so fewer of glibc's per-thread malloc arenas (MALLOC_ARENA_MAX in the
    # chart caps them too), each holding on to what it once held
    asyncio.get_running_loop().set_default_executor(settings.execution.executor)
    watch_only_owned(settings)
    memo.clients = children.Clients.create(pool=settings.execution.max_workers)
    # the pods of the namespaces it serves, unless told to count every namespace's (fleet.py)
    memo.fleet = Fleet(memo.clients, namespaces=() if counts_all_namespaces() else tuple(NAMESPACES))
    memo.triggers = {}
    memo.applied = {}  # (namespace, name) -> (last applied generation, error applying the next one)
    # (namespace, name) -> (KV revision generation, rollout hold) of its last apply (revisions.py)
    memo.revisions = {}
    memo.drift_seen = {}  # (kind, namespace, child) -> its generation (uid once deleted) last restored
    # (namespace, name) -> gang of a deployment created while this operator runs: nothing older to prune
    memo.created_gangs = {}
    memo.pools = {}  # (namespace, name) -> statuses.PoolState of a picker-mode deployment
    metrics.serve()
    memory.start_tracing()  # opt-in (operator/memory.py)
    # freed heap pages back to the system once a minute: bursts (fleet lists, many deployments created
    # at once) otherwise leave RSS at their peak for good
    memory.trim_every(TRIM_SECONDS)


# What the operator made carries both labels; the label filters on the handlers below only act after
# kopf has received and parsed an object.
OWNED = f"{LABEL_DEPLOYMENT},{LABEL_MANAGED_BY}={MANAGED_BY}"


def watch_only_owned(settings: kopf.OperatorSettings) -> None:
    """Have the API server filter the pod and Deployment watches (and their initial lists) to the
    operator's children: otherwise every pod in the cluster is streamed to it and dropped on arrival,
    and its memory and the API server's load grow with the cluster, not with what it owns. Initial
    lists come in pages. (Namespaces: `python -m disagg.operator --namespace` restricts every watch.)"""
    settings.watching.label_selectors["v1", "pods"] = OWNED
    settings.watching.label_selectors["apps", "deployments"] = OWNED
    settings.watching.label_selectors["networking.k8s.io", "networkpolicies"] = OWNED
    settings.watching.chunk_size = PAGE


def _parse(body: kopf.Body) -> DisaggDeployment:
    return DisaggDeployment.model_validate({"apiVersion": body["apiVersion"], "kind": body["kind"],
                                            "metadata": dict(body["metadata"]), "spec": dict(body["spec"])})


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
def reconcile(body: kopf.Body, uid: str, name: str, namespace: str, memo: kopf.Memo,
              pods_by_deployment: kopf.Index, deployments_by_deployment: kopf.Index, reason: str = "",
              **_: Any) -> None:
    try:
        dd = _parse(body)
    except ValidationError as e:
        # Admission should have refused it; never crash-loop on it either.
        metrics.reconciles.labels("invalid").inc()
        kopf.warn(body, reason="InvalidSpec", message=str(e).splitlines()[0])
        raise kopf.PermanentError(f"invalid spec: {e}") from e
    clients: children.Clients = memo.clients
    key = (namespace, name)
    unrendered = render.unrendered_layout(dd)
    if unrendered:
        # what admission let through but this version cannot run: said in status and an event, nothing
        # applied (what already runs keeps running), no retry until the spec changes
        metrics.reconciles.labels("unsupported").inc()
        memo.applied[key] = (body["metadata"].get("generation", 0) - 1, unrendered)
        kopf.warn(body, reason="LayoutNotRendered", message=unrendered)
        _wake(memo, namespace, name)
        raise kopf.PermanentError(unrendered)
    manifests, gang = _render(dd, uid, list(pods_by_deployment.get(key, [])),
                              list(deployments_by_deployment.get(key, [])), memo)
    generation = body["metadata"].get("generation", 0)
    unavailable: dict[str, int] = {}
    try:
        written = children.apply(clients, manifests, uid, unavailable)
    except children.PredecessorChild as e:
        # deleted and created again under the same name: the old children go within seconds, and
        # waiting the 30 s of a real conflict made a re-creation 10x slower than for plain Deployments
        metrics.reconciles.labels("blocked").inc()
        _wake(memo, namespace, name)
        raise kopf.TemporaryError(str(e), delay=1) from e
    except children.ChildConflict as e:
        metrics.reconciles.labels("conflict").inc()
        memo.applied[(namespace, name)] = (generation - 1, str(e))
        kopf.warn(body, reason="ChildConflict", message=str(e))
        _wake(memo, namespace, name)
        raise kopf.TemporaryError(str(e), delay=30) from e
    except ApiException as e:
        metrics.reconciles.labels("error").inc()
        memo.applied[(namespace, name)] = (generation - 1, f"{e.status} {e.reason}")
        _wake(memo, namespace, name)
        raise
    memo.applied[(namespace, name)] = (generation, None)
    if reason == kopf.Reason.CREATE:
        # its only gang objects are the ones just applied: the status loop's prune (four list calls, for
        # objects of an older gang or an older operator's naming) has nothing to find
        memo.created_gangs[key] = gang.name
    for role in (ROLE_PREFILL, ROLE_DECODE):
        if render.multi_pod(dd, role) and children.delete_owned(clients, "apps/v1", "Deployment", namespace,
                                                                 render.names(name)[role], uid):
            kopf.info(body, reason="DeploymentDeleted", message=f"deleted the {role} Deployment: its replicas now "
                                                                "span several pods, run as groups")
    was_picker = key in memo.pools or any(c.get("type") == ConditionType.INFERENCE_POOL_APPLIED
                                          for c in (body.get("status") or {}).get("conditions") or [])
    if dd.spec.router.picker_settings():
        memo.pools[key] = pool_state(dd, unavailable.get(pools.KIND))
    else:
        memo.pools.pop(key, None)
    _prune(clients, body, dd, uid, manifests, was_picker)
    metrics.reconciles.labels("applied" if written else "unchanged").inc()
    for kind in written:
        metrics.child_writes.labels(kind).inc()
    if written:
        kopf.info(body, reason="Applied", message=f"applied {len(written)} of {len(manifests)} child objects "
                                                 f"(gang {gang.name or 'none'})")
    if written and memo.revisions.get(key, (None, False))[1]:
        # kopf.event, not kopf.info: info events fall under the posting level (WARNING, startup())
        kopf.event(body, type="Normal", reason="RolloutHeld",
                   message=f"KV revision {render.kv_revision(dd)} has no ready prefill and decode yet: the old "
                           "revision's pods stay until it has")
    if generation > 1:
        # A first generation has only had this gang, so there is nothing to prune: six list calls saved
        # for each new deployment, 1,800 when 300 are created at once. (The status loop also prunes, once
        # per gang after the deployment settles, so objects of an older operator's gang naming go too.)
        keep = {m["metadata"]["name"] for m in manifests}
        for gone in children.prune_gangs(clients, namespace, name, keep, gang.name) or []:
            kopf.info(body, reason="GangObjectDeleted", message=f"deleted {gone}: no pod of it remains")
    _wake(memo, namespace, name)


def pool_state(dd: DisaggDeployment, unavailable: int | None) -> statuses.PoolState:
    """A picker-mode deployment's InferencePool after an apply: ``unavailable``, the API server's answer
    when its kind could not be written (404: the API is not served; 403: the operator may not)."""
    name = render.names(dd.metadata.name)["inference-pool"]
    meanwhile = (f"meanwhile the deployment serves on its Service (its routers in picker mode), and the operator "
                 f"creates InferencePool {name} once it can")
    if unavailable == 404:
        return statuses.PoolState(None, "InferencePoolCRDMissing", f"the InferencePool API ({pools.API_VERSION}) is "
                                  f"not installed on this cluster: install its CRD (the disagg chart's "
                                  f"inferencePool.installCRD=true, or the Gateway API Inference Extension's own); "
                                  f"{meanwhile}", time.monotonic() + POOL_RETRY_SECONDS)
    if unavailable is not None:
        return statuses.PoolState(None, "InferencePoolForbidden", f"the API server forbade the operator to write "
                                  f"InferencePool {name} (HTTP {unavailable}): its role lacks the rule on "
                                  f"inferencepools ({pools.GROUP}) the disagg chart's RBAC grants, or an admission "
                                  f"policy refused it; {meanwhile}", time.monotonic() + POOL_RETRY_SECONDS)
    return statuses.PoolState(name)


def _prune(clients: children.Clients, body: kopf.Body, dd: DisaggDeployment, uid: str,
           manifests: list[dict[str, Any]], was_picker: bool) -> None:
    """Delete what the deployment had rendered and no longer renders (render.PRUNABLE): its NetworkPolicies
    once the operator's networkPolicy option is off, its InferencePool and picker policies back in proxy
    mode. The picker's are only looked for where the deployment was in picker mode (memo, or its status
    says so), so a proxy deployment's reconcile costs no extra request."""
    name, namespace = dd.metadata.name, dd.metadata.namespace
    rendered = {(m["kind"], m["metadata"]["name"]) for m in manifests}
    policy_off = not render.network_policy_enabled()
    for api_version, kind, which in render.PRUNABLE:
        child = render.names(name)[which]
        if (kind, child) in rendered or (which in render.PICKER_ONLY and not was_picker):
            continue
        if not children.delete_owned(clients, api_version, kind, namespace, child, uid):
            continue
        if kind == pools.KIND:
            why = f"deleted InferencePool {child}: spec.router.mode is proxy"
        elif which == "network-policy":
            why = "deleted the workers' NetworkPolicy: the operator's networkPolicy option is off"
        else:
            why = (f"deleted NetworkPolicy {child}, which admitted the gateway's pods: "
                   + ("the operator's networkPolicy option is off" if policy_off else "spec.router.mode is proxy"))
        # kopf.event, not kopf.info: info events fall under the posting level (WARNING, startup())
        kopf.event(body, type="Normal", reason=f"{kind}Deleted", message=why)


def retry_pool(clients: children.Clients, dd: DisaggDeployment, uid: str, pool: statuses.PoolState) -> None:
    """Try again to create a picker-mode deployment's missing InferencePool (its CRD may have been installed
    since), at most every POOL_RETRY_SECONDS; updates ``pool`` (InferencePoolApplied turning True is the
    event that says so)."""
    if pool.name or time.monotonic() < pool.retry_at:
        return
    manifest = render.stamp(render.inference_pool(dd, uid))
    unavailable: dict[str, int] = {}
    children.apply(clients, [manifest], uid, unavailable)
    fresh = pool_state(dd, unavailable.get(pools.KIND))
    pool.name, pool.reason, pool.message, pool.retry_at = fresh.name, fresh.reason, fresh.message, fresh.retry_at


def _render(dd: DisaggDeployment, uid: str, pods: list[statuses.PodView],
            deps: list[tuple[str, statuses.DeploymentView]], memo: kopf.Memo) -> tuple[list[dict[str, Any]], gangs.Gang]:
    """render.children with the KV revision's generation and rollout hold (:mod:`.revisions`) read from
    what runs; the hold is remembered so the status loop re-applies when it should be lifted."""
    generation = render.revision_generation(dd, revisions.live([v for _, v in deps]))
    hold = revisions.hold([p for p in pods if not p.headless], render.kv_revision(dd))
    memo.revisions[(dd.metadata.namespace, dd.metadata.name)] = (generation, hold)
    return render.children(dd, uid, generation, hold)


def _lift_hold(memo: kopf.Memo, namespace: str, name: str, pods: list[statuses.PodView]) -> bool:
    """Lift a KV revision rollout's hold once the new revision has a ready pair (or no older revision
    has one left to protect); True when it re-applied the children."""
    key = (namespace, name)
    generation, held = memo.revisions.get(key, (None, False))
    if not held:
        return False
    obj = memo.clients.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    try:
        dd = _parse(obj)
    except ValidationError:
        return False
    if revisions.hold([p for p in pods if not p.headless], render.kv_revision(dd)):
        return False
    memo.revisions[key] = (generation, False)
    manifests, _ = render.children(dd, obj["metadata"]["uid"], generation, False)
    for kind in children.apply(memo.clients, manifests, obj["metadata"]["uid"]):
        metrics.child_writes.labels(kind).inc()
    return True


def _wake(memo: kopf.Memo, namespace: str, name: str) -> None:
    event = memo.triggers.get((namespace, name))
    if event is not None:
        event.set()


# ---------------------------------------------------------------- indexes of what the children do

@kopf.index("pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT, LABEL_MANAGED_BY: MANAGED_BY})
def pods_by_deployment(namespace: str, name: str, labels: kopf.Labels, spec: kopf.Spec, status: kopf.Status,
                       meta: kopf.Meta, **_: Any) -> dict[Any, statuses.PodView]:
    waiting = message = None
    for cs in status.get("containerStatuses") or []:
        state = (cs.get("state") or {}).get("waiting") or {}
        if not waiting and state.get("reason"):
            waiting, message = state["reason"], state.get("message")
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    failure = None
    for cs in status.get("containerStatuses") or []:
        ended = (cs.get("state") or {}).get("terminated")
        if ended and not failure:
            failure = f"container {cs.get('name')} ended ({ended.get('reason') or 'exit'} {ended.get('exitCode')})"
    index = labels.get(LABEL_GROUP_POD, "")
    view = statuses.PodView(name=name, role=labels.get(LABEL_ROLE, ""), node=spec.get("nodeName"), ready=ready,
                            phase=status.get("phase", "Pending"), waiting_reason=waiting,
                            waiting_message=message,
                            terminating=bool(meta.get("deletionTimestamp")),
                            template_hash=labels.get("pod-template-hash"),
                            created=meta.get("creationTimestamp", ""), gang=labels.get(LABEL_GANG),
                            revision=labels.get(KV_REVISION_LABEL),
                            generation=labels.get(KV_REVISION_GENERATION_LABEL),
                            group=labels.get(LABEL_GROUP), group_pod=int(index) if index.isdigit() else None,
                            headless=LABEL_HEADLESS in labels, failure=failure,
                            serving_role=labels.get(LABEL_SERVING_ROLE),
                            observed_role=(meta.get("annotations") or {}).get(ANNOTATION_OBSERVED_SERVING_ROLE))
    return {(namespace, labels[LABEL_DEPLOYMENT]): view}


@kopf.index("deployments", labels={LABEL_DEPLOYMENT: kopf.PRESENT, LABEL_MANAGED_BY: MANAGED_BY})
def deployments_by_deployment(namespace: str, labels: kopf.Labels, spec: kopf.Spec, status: kopf.Status,
                              meta: kopf.Meta, **_: Any) -> dict[Any, tuple[str, statuses.DeploymentView]]:
    view = statuses.DeploymentView(desired=spec.get("replicas", 1), updated=status.get("updatedReplicas", 0),
                                   ready=status.get("readyReplicas", 0),
                                   observed_generation=status.get("observedGeneration", 0),
                                   generation=meta.get("generation", 0))
    template = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    view.revision = template.get(KV_REVISION_LABEL)
    if str(template.get(KV_REVISION_GENERATION_LABEL, "")).isdigit():
        view.revision_generation = int(template[KV_REVISION_GENERATION_LABEL])
    return {(namespace, labels[LABEL_DEPLOYMENT]): (labels.get(LABEL_ROLE, ""), view)}


@kopf.on.event("pods", labels={LABEL_DEPLOYMENT: kopf.PRESENT, LABEL_MANAGED_BY: MANAGED_BY})
async def child_changed(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    _wake(memo, namespace, labels[LABEL_DEPLOYMENT])


@kopf.on.event("deployments", labels={LABEL_DEPLOYMENT: kopf.PRESENT, LABEL_MANAGED_BY: MANAGED_BY})
async def deployment_changed(namespace: str, name: str, labels: kopf.Labels, meta: kopf.Meta, memo: kopf.Memo,
                             type: str | None = None, **_: Any) -> None:
    _wake(memo, namespace, labels[LABEL_DEPLOYMENT])
    await _revert_drift(memo, "Deployment", namespace, name, labels, meta, type)


@kopf.on.event("networking.k8s.io", "v1", "networkpolicies",
               labels={LABEL_DEPLOYMENT: kopf.PRESENT, LABEL_MANAGED_BY: MANAGED_BY})
async def network_policy_changed(namespace: str, name: str, labels: kopf.Labels, meta: kopf.Meta, memo: kopf.Memo,
                                 type: str | None = None, **_: Any) -> None:
    await _revert_drift(memo, "NetworkPolicy", namespace, name, labels, meta, type)


async def _revert_drift(memo: kopf.Memo, kind: str, namespace: str, name: str, labels: kopf.Labels, meta: kopf.Meta,
                        type: str | None) -> None:
    """Someone else changed a child's spec (kubectl edit/scale, another controller), or deleted the
    NetworkPolicy that guards the workers: the DisaggDeployment is the source of truth, so restore what
    it renders, once per change."""
    dd_name = labels[LABEL_DEPLOYMENT]
    if type == "DELETED":
        # a deleted Deployment is re-created by the next reconcile; a deleted policy leaves the workers
        # open until then, so it is restored at once (not while its DisaggDeployment is being deleted)
        manager = "delete" if kind == "NetworkPolicy" else None
    else:
        manager = children.drifted_by(dict(meta))
    generation = meta.get("generation") if type != "DELETED" else meta.get("uid")
    if manager is None or memo.drift_seen.get((kind, namespace, name)) == generation:
        return
    memo.drift_seen[(kind, namespace, name)] = generation
    try:
        restored = await asyncio.to_thread(_restore, memo.clients, namespace, dd_name,
                                           memo.revisions.get((namespace, dd_name), (None, False)))
    except ApiException as e:
        log.warning("restoring %s %s/%s after a change by %s failed: %s", kind, namespace, name, manager, e.reason)
        return
    except (children.ChildConflict, children.PredecessorChild) as e:
        log.info("not restoring %s/%s: %s", namespace, name, e)   # the reconcile reports and retries it
        return
    if restored is not None:
        metrics.drift_reverts.labels(kind, manager).inc()
        what = "was deleted" if manager == "delete" else f"was changed by {manager}"
        kopf.event(restored, type="Warning", reason="ChildDriftReverted",
                   message=f"{kind} {name} {what}; restored the spec this "
                           f"DisaggDeployment renders (change the DisaggDeployment instead)")


def _restore(clients: children.Clients, namespace: str, dd_name: str,
             revision: tuple[int | None, bool] = (None, False)) -> dict[str, Any] | None:
    """Re-apply a deployment's children; returns its body for the event, None if it is gone, being
    deleted, or invalid, or when nothing needed restoring (a policy the operator itself deleted)."""
    try:
        obj = clients.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, dd_name)
    except ApiException as e:
        if e.status == 404:
            return None
        raise
    if obj["metadata"].get("deletionTimestamp"):
        return None
    try:
        dd = _parse(obj)
    except ValidationError:
        return None
    manifests, _ = render.children(dd, obj["metadata"]["uid"], *revision)
    written = children.apply(clients, manifests, obj["metadata"]["uid"])
    for kind in written:
        metrics.child_writes.labels(kind).inc()
    return obj if written else None


# ---------------------------------------------------------------- status

@kopf.daemon(GROUP, VERSION, PLURAL, cancellation_timeout=5)
async def status_loop(name: str, namespace: str, body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                      pods_by_deployment: kopf.Index, deployments_by_deployment: kopf.Index, **_: Any) -> None:
    key = (namespace, name)
    trigger = memo.triggers[key] = asyncio.Event()
    state = LoopState()
    deleted = False
    try:
        while not stopped:
            trigger.clear()
            state.pruned_for = state.pruned_for or memo.created_gangs.pop(key, None)
            pods = list(pods_by_deployment.get(key, []))
            deps = list(deployments_by_deployment.get(key, []))
            try:
                if memo.revisions.get(key, (None, False))[1] and await asyncio.to_thread(
                        _lift_hold, memo, namespace, name, pods):
                    kopf.event(body, type="Normal", reason="RolloutHoldLifted",
                              message="the new KV revision has a ready prefill and decode: the old pods may go")
                applied = memo.applied.get(key)
                # kopf's live body (kept current by the DisaggDeployment watch) instead of a GET per refresh
                snapshot = {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec", "status")}
                settled, events = await asyncio.to_thread(refresh, memo.clients, namespace, name, pods, deps, applied,
                                                           memo.fleet, snapshot, state, memo.pools.get(key))
            except ApiException as e:
                if e.status == 404:
                    deleted = True
                    return
                log.warning("status refresh of %s/%s failed: %s", namespace, name, e.reason)
                settled, events = False, []
            except Exception:  # a transient fault must not stop status reporting for this deployment
                log.exception("status refresh of %s/%s failed", namespace, name)
                settled, events = False, []
            for etype, reason, message in events:
                kopf.event(body, type=etype, reason=reason, message=message)
            if await _woken(trigger, stopped, timeout=60 if settled else 5):
                await asyncio.sleep(0.2)  # let a burst of pod events settle into one refresh
    finally:
        # a DisaggDeployment deleted and created again under its name has a new daemon (and trigger) by now
        if memo.triggers.get(key) is trigger:
            memo.triggers.pop(key, None)
        if deleted or (stopped.reason and stopped.reason & kopf.DaemonStoppingReason.RESOURCE_DELETED):
            # nothing keyed by its name may outlive it (reconcile writes these again for a re-created one)
            memo.applied.pop(key, None)
            memo.revisions.pop(key, None)
            memo.created_gangs.pop(key, None)
            memo.pools.pop(key, None)
            for drift in [k for k in memo.drift_seen if k[1] == namespace and k[2].startswith(f"{name}-")]:
                memo.drift_seen.pop(drift, None)
        metrics.observe_status(namespace, name, None)
        flex.forget(namespace, name)


async def _woken(trigger: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float) -> bool:
    """Wait for a change, the daemon's stop (deletion, shutdown) or the timeout; True on a change."""

    async def until_stopped() -> None:
        await stopped.wait()

    waits = {asyncio.ensure_future(trigger.wait()), asyncio.ensure_future(until_stopped())}
    done, pending = await asyncio.wait(waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    for task in done:
        task.result()  # surface a failure here rather than spinning on it
    return trigger.is_set() and not stopped


@dataclass
class LoopState:
    """What one DisaggDeployment's status loop remembers between refreshes."""

    # the parsed spec and the resourceVersion it was parsed from (a spec is validated once, not per refresh)
    parsed: tuple[str, DisaggDeployment] | None = None
    # (resourceVersion of the body it was computed from, status written): until the watch delivers that
    # write, the live body still shows the status before it, and the write must not be repeated
    written: tuple[str, dict[str, Any]] | None = None
    pruned_for: str | None = None   # the gang whose predecessors' objects have been pruned
    # flex pod -> the serving role last written or recorded on it (operator/flex.py run)
    flex_written: dict[str, str] = field(default_factory=dict)


def refresh(clients: children.Clients, namespace: str, name: str, pods: list[statuses.PodView],
            deps: list[tuple[str, statuses.DeploymentView]],
            applied: tuple[int, str | None] | None, fleet: Fleet, obj: dict[str, Any] | None = None,
            state: LoopState | None = None, pool: statuses.PoolState | None = None,
            ) -> tuple[bool, list[tuple[str, str, str]]]:
    """Recompute and (if changed) write status. Returns (settled, events). `obj`: the DisaggDeployment as
    kopf last saw it (else it is read); `state`: the loop's memory across refreshes; `pool`: a picker-mode
    deployment's InferencePool as last applied (a missing one is tried again here)."""
    if obj is None or not obj.get("metadata"):
        obj = clients.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    state = state or LoopState()
    version = obj["metadata"].get("resourceVersion", "")
    if state.parsed and state.parsed[0] == version:
        dd = state.parsed[1]
    else:
        try:
            dd = DisaggDeployment.model_validate({k: obj[k] for k in ("apiVersion", "kind", "metadata", "spec")})
        except ValidationError:
            return True, []
        state.parsed = (version, dd)
    events: list[tuple[str, str, str]] = []
    restarts: dict[str, int] = {}
    scheduled = {r: sum(1 for p in pods if p.group and p.role == r and p.node and not p.terminating)
                 for r in (ROLE_PREFILL, ROLE_DECODE)}
    if any(render.multi_pod(dd, r) for r in (ROLE_PREFILL, ROLE_DECODE)) or any(p.group for p in pods):
        pods, deps, events, restarts = _run_groups(clients, dd, obj["metadata"].get("uid", ""), pods, deps, applied)
    if pool is not None and dd.spec.router.picker_settings() and obj["metadata"].get("uid"):
        retry_pool(clients, dd, obj["metadata"]["uid"], pool)
    switches = 0
    if any(p.role == ROLE_FLEX for p in pods):
        pods, flex_events, switches = flex.run(clients.core, namespace, name, pods, state.flex_written,
                                               flex.planned_split(obj, dd.spec.planner.enabled))
        events += flex_events
    obs = statuses.Observed(pods=pods, deployments={role: view for role, view in deps},
                            group_pods_scheduled=scheduled, group_restarts=restarts, inference_pool=pool,
                            flex_switches=switches)
    if applied:
        obs.applied_generation, obs.apply_error = applied
    gang = dd.spec.scheduling.gang
    bound = {r: sum(1 for p in pods if p.role == r and p.node and not p.terminating) for r in ("prefill", "decode")}
    waiting_since = statuses.gang_pending_since(obs, dd)
    if (bound["prefill"] < gang.min_prefill or bound["decode"] < gang.min_decode) and waiting_since \
            and statuses.age_seconds(waiting_since) >= CAPACITY_AFTER_SECONDS:
        # Only for a gang that has waited a while: listing every node and pod is not free at fleet scale.
        obs.gang_fits, obs.gang_message = _capacity(fleet, dd)
    previous = obj.get("status") or {}
    if state.written and state.written[0] == version:
        previous = state.written[1]   # the watch has not brought our last write back yet
    status, status_events = statuses.compute(dd, obj["metadata"]["generation"], previous, obs, render.endpoint(dd))
    events += status_events
    if statuses.changed(previous, status):
        # server-side apply of the operator's own fields only: conditions are a map keyed by type, so
        # the planner's PlannerActive (its own apply) can never be overwritten by a stale read here
        mine = {**status, "conditions": [c for c in status["conditions"] if c["type"] in statuses.OWNED]}
        clients.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name,
            {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name, "namespace": namespace},
             "status": mine}, field_manager=children.FIELD_MANAGER, force=True, _content_type=children.APPLY,
            _preload_content=False).data   # read, not parsed: the watch brings the object back
        metrics.status_writes.inc()
        state.written = (version, {**previous, **status})
        _observe_gang_wait(previous, status)
    metrics.observe_status(namespace, name, status)
    settled = status["phase"] == "Ready" and all(
        c["status"] == "False" for c in status["conditions"] if c["type"] in ("Progressing", "Degraded"))
    current = gangs.render(name, dd.spec)
    if settled and current.objects and state.pruned_for != current.name \
            and not any(p.gang and p.gang != current.name for p in pods):
        # a rollout onto a new gang has finished: delete the old gang's objects (once per gang, not per
        # settled refresh: these are four list calls)
        keep = {o["metadata"]["name"] for o in current.objects}
        pruned = children.prune_gangs(clients, namespace, name, keep, current.name)
        for gone in pruned or []:
            events.append(("Normal", "GangObjectDeleted", f"deleted {gone}: no pod of it remains"))
        if pruned is not None:
            state.pruned_for = current.name
    return settled, events


def _run_groups(clients: children.Clients, dd: DisaggDeployment, uid: str, pods: list[statuses.PodView],
                deps: list[tuple[str, statuses.DeploymentView]], applied: tuple[int, str | None] | None,
                ) -> tuple[list[statuses.PodView], list[tuple[str, statuses.DeploymentView]], list[tuple[str, str, str]],
                           dict[str, int]]:
    """Run the multi-pod roles' groups (operator/groups.py) once the children they need (the ranks Service,
    the gang) are applied for this generation; then what the status sees: each group as one replica (its
    leader, as the router sees it) and each multi-pod role as if a Deployment ran it."""
    revision = render.kv_revision(dd)
    serving = [p for p in pods if not p.headless]
    generation = groups.live_generation(dd, pods, deps)
    gang = gangs.render(dd.metadata.name, dd.spec)
    events: list[tuple[str, str, str]] = []
    restarts: dict[str, int] = {}
    if uid and applied and applied[1] is None and applied[0] >= (dd.metadata.model_extra or {}).get("generation", 0):
        outcome = groups.run(clients, dd, uid, pods, gang, generation, revisions.hold(serving, revision))
        events, restarts = outcome.events, outcome.restarts
        for role, n in outcome.restarts.items():
            metrics.group_restarts.labels(dd.metadata.namespace, dd.metadata.name, role).inc(n)
    views = [(role, groups.deployment_view(dd, role, pods, revision, generation,
                                           gang.name if gang.objects else None))
             for role in (ROLE_PREFILL, ROLE_DECODE) if render.multi_pod(dd, role)]
    kept = [d for d in deps if d[0] not in (ROLE_PREFILL, ROLE_DECODE) or not render.multi_pod(dd, d[0])]
    return serving, [*kept, *views], events, restarts


def _observe_gang_wait(previous: dict[str, Any], status: dict[str, Any]) -> None:
    """A gang just placed: how long it waited (since GangScheduled last turned False)."""
    before = {c["type"]: c for c in previous.get("conditions") or []}.get("GangScheduled")
    now = {c["type"]: c for c in status.get("conditions") or []}.get("GangScheduled")
    if before and now and before["status"] == "False" and now["status"] == "True":
        metrics.gang_wait.observe(statuses.age_seconds(before["lastTransitionTime"]))


def _capacity(fleet: Fleet, dd: DisaggDeployment) -> tuple[bool, str]:
    spec = dd.spec
    gang = spec.scheduling.gang
    # a replica of several pods needs all of them placed: counted in pods, each with its own GPUs
    roles = []
    for role, minimum, part in ((ROLE_PREFILL, gang.min_prefill, spec.prefill), (ROLE_DECODE, gang.min_decode,
                                                                                  spec.decode)):
        pods = part.pods_per_replica
        if pods > 1:   # operator/gang.py: such a role always joins, at one replica or more
            minimum = max(minimum, 1)
            role = f"{role} ({minimum} replica{'s' if minimum > 1 else ''} of {pods} pods)"
        roles.append(capacity.RoleNeed(role, minimum * pods, part.gpus(), dict(part.node_selector),
                                       tuple(part.tolerations)))
    topo = spec.scheduling.topology
    key = topo.key if topo and topo.mode == "required" else None
    fits, message = fleet.explain(roles, key)
    return fits, message if not fits else f"{message}; waiting for the scheduler ({GPU_RESOURCE} fits)"
