"""Names and label keys of everything derived from a DisaggDeployment.

One home for them: the operator, the router's discovery, the planner and the
tests all import these instead of formatting names themselves.
"""

from __future__ import annotations

import hashlib

from .parallelism import MAX_PODS_PER_REPLICA

GROUP = "serving.disagg.dev"

# A DisaggDeployment's name is a DNS-1035 label of at most this many characters.
# Children are "<name>-<suffix>" with suffixes up to MAX_SUFFIX_LENGTH long, so
# every child name and every label value that carries the name stays within the
# 63-character label limit without shortening. child_name() still shortens
# (stably, with a hash) should a longer name ever reach it.
MAX_NAME_LENGTH = 48
MAX_SUFFIX_LENGTH = 14
DNS1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# An object name most kinds take (Secrets, ConfigMaps): RFC 1123 subdomain.
DNS1123_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_LABEL_LIMIT = 63

# Label keys put on every child object and pod.
LABEL_DEPLOYMENT = f"{GROUP}/deployment"
LABEL_ROLE = f"{GROUP}/role"
LABEL_GANG = f"{GROUP}/gang"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
# On the pods of a replica that spans several pods (operator/groups.py): the group (group_name), the pod's
# index in it (0 = the leader), and, on every pod but the leader, LABEL_HEADLESS: such a pod serves no API,
# so the router's discovery leaves it out even though the role Service selects it.
LABEL_GROUP = f"{GROUP}/group"
LABEL_GROUP_POD = f"{GROUP}/group-pod"
LABEL_HEADLESS = f"{GROUP}/headless"
MANAGED_BY = "disagg-operator"

ROLE_PREFILL = "prefill"
ROLE_DECODE = "decode"
ROLE_ROUTER = "router"
ROLES = (ROLE_PREFILL, ROLE_DECODE, ROLE_ROUTER)
# The flex pool (spec.flex): its pods carry LABEL_ROLE=flex for their whole life (the Deployment's selector
# is immutable), and the role each serves now in LABEL_SERVING_ROLE, which changes at run time: the planner
# (or, with no planner, the operator's initial split) writes it, routers follow it after a drain.
ROLE_FLEX = "flex"
SERVING_ROLES = (ROLE_PREFILL, ROLE_DECODE)
LABEL_SERVING_ROLE = f"{GROUP}/serving-role"
# The serving role the operator last saw on a flex pod: a label that differs from it is a switch, which
# the operator reports (event RoleSwitched, metric) once, whoever wrote the label.
ANNOTATION_OBSERVED_SERVING_ROLE = f"{GROUP}/observed-serving-role"
# When the planner gave a flex pod its serving role (unix seconds, the planner's clock): a worker does not
# switch back within disagg.planner.flex.SWITCH_DWELL of it, across planner restarts too.
ANNOTATION_SERVING_ROLE_SINCE = f"{GROUP}/serving-role-since"
# Kubernetes' own: the ReplicaSet removes the pods of lowest cost first when it scales down, so the flex
# worker the planner chose to remove is the one that goes.
ANNOTATION_POD_DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"


def initial_serving_role(serving: list[str]) -> str:
    """The role a flex worker that has none yet takes, given the roles the others serve: the one fewer serve,
    decode on a tie (decode's KV memory is what a burst of long answers runs out of first)."""
    return ROLE_PREFILL if serving.count(ROLE_PREFILL) < serving.count(ROLE_DECODE) else ROLE_DECODE

# A pvc://<claim>/<path> model source is mounted read-only at MODEL_MOUNT_ROOT/<claim>.
MODEL_MOUNT_ROOT = "/models"


def model_claim(source: str | None) -> str | None:
    """The PersistentVolumeClaim a pvc:// source names, else None."""
    if not source or not source.startswith("pvc://"):
        return None
    return source.removeprefix("pvc://").split("/", 1)[0]


def local_model_path(source: str) -> str:
    """A model (or tokenizer) source as vLLM and the tokenizer take it: hf://org/name -> org/name,
    pvc://claim/path -> the mounted path, s3:// and absolute paths as they are."""
    if source.startswith("hf://"):
        return source.removeprefix("hf://")
    claim = model_claim(source)
    if claim is not None:
        return f"{MODEL_MOUNT_ROOT}/{source.removeprefix('pvc://')}"
    return source


# Where a worker keeps its disk KV tier (spec.kvCache.offload.diskGiB): the operator mounts a volume
# of that size there and the worker points vLLM's fs tier at it.
DISK_OFFLOAD_PATH = "/var/cache/disagg/kv-offload"

# spec.router.auth: the operator mounts the Secret's key as ROUTER_API_KEYS_FILE in this directory (the whole
# volume, never a subPath, so the kubelet's updates reach the router, which re-reads the file).
ROUTER_AUTH_DIR = "/etc/disagg/router-auth"
ROUTER_API_KEYS_FILE = f"{ROUTER_AUTH_DIR}/keys"


# A replica of several pods (spec.<role>.podsPerReplica > 1) is a group named <name>-<role>-<replica>, and
# its pods <name>-<role>-<replica>-<pod> (pod 0 the leader). Each pod name is a hostname under the group's
# headless Service, so a DNS label, and is never shortened with a hash: the leader's address must be
# derivable by every pod of the group. With names up to MAX_NAME_LENGTH and pod indices below
# MAX_PODS_PER_REPLICA, that leaves room for replica indices below MAX_GROUP_REPLICAS, a bound
# admission holds multi-pod roles to.
_LONGEST_ROLE = max(len(ROLE_PREFILL), len(ROLE_DECODE))
MAX_GROUP_REPLICAS = 10 ** (_LABEL_LIMIT - MAX_NAME_LENGTH - _LONGEST_ROLE - 3 - len(str(MAX_PODS_PER_REPLICA - 1)))


def group_name(name: str, role: str, replica: int) -> str:
    """The name of replica ``replica`` of ``role`` as a group of pods (its headless Service's, for one)."""
    return f"{name}-{role}-{replica}"


def group_pod_name(name: str, role: str, replica: int, pod: int) -> str:
    """The name (and hostname) of pod ``pod`` of a multi-pod replica; pod 0 is the leader."""
    return f"{group_name(name, role, replica)}-{pod}"


def ranks_service(name: str, role: str) -> str:
    """The headless Service under which a multi-pod replica's pods have host names (their ``subdomain``):
    it publishes pods that are not ready, since a leader is only ready once its other pods have joined."""
    return child_name(name, f"{role}-ranks")


def group_index(group: str) -> int | None:
    """The replica index at the end of a group's name (:func:`group_name`), or None."""
    tail = group.rpartition("-")[2]
    return int(tail) if tail.isdigit() else None


def child_name(name: str, suffix: str) -> str:
    """``<name>-<suffix>``, shortened with a stable hash when it would exceed 63."""
    if len(suffix) > MAX_SUFFIX_LENGTH:
        raise ValueError(f"suffix {suffix!r} is longer than {MAX_SUFFIX_LENGTH} characters")
    full = f"{name}-{suffix}"
    if len(full) <= _LABEL_LIMIT:
        return full
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    keep = _LABEL_LIMIT - len(suffix) - len(digest) - 2
    return f"{name[:keep].rstrip('-')}-{digest}-{suffix}"
