"""The arithmetic of one replica's parallel layout: how many pods it spans, how many GPUs each pod
gets, and the flags that make the pods of one replica act as one vLLM server. One home for it: the API's
validation, the operator's rendering and the planner's GPU counting all import this module.

A replica is a group of ``pods`` pods; pod 0 is the leader (it serves HTTP, metrics and the NIXL side
channel), the others run headless. Two ways to spread a replica over pods, both without Ray, as vLLM
0.32 takes them:

* **Tensor and pipeline parallel across pods** (``data == 1``): one engine whose torch.distributed
  world of ``tensor x pipeline`` ranks is cut into ``pods`` equal slices, one per pod:
  ``--nnodes N --node-rank R --master-addr <leader> --master-port`` :data:`MASTER_PORT`. vLLM
  requires ``world_size % nnodes == 0`` and puts ranks ``R * world/N ...`` on node ``R``.
* **Data parallel with expert parallel** (``data > 1``, MoE models): ``data`` engines of
  ``tensor x pipeline`` GPUs each, ``dataLocal`` of them on every pod (LWS/llm-d style):
  ``--data-parallel-size data --data-parallel-size-local dataLocal --data-parallel-address <leader>
  --data-parallel-rpc-port`` :data:`DP_RPC_PORT`, and on pod ``i > 0``
  ``--data-parallel-start-rank i * dataLocal``. Each engine stays inside one pod, as in llm-d's
  wide-EP groups (start rank = worker index x DP_LOCAL): admission refuses layouts that would cut an
  engine across pods while it runs data parallel, so these two cases are all a pod can be.

The functions are pure: they take numbers (or a role spec) and return numbers and argument lists,
so the same answer reaches admission, rendering and planning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

# vLLM 0.32's own defaults (ParallelConfig.master_port, data_parallel_rpc_port), written out rather
# than left implicit: every pod of a group must pass the same value, and the NetworkPolicy that lets a
# group's pods reach their leader must open the same port.
MASTER_PORT = 29501
DP_RPC_PORT = 29550

# Bounds of the API fields (disagg/api/v1alpha1.py uses them; names.py sizes pod names by the last).
MAX_TENSOR = 64
MAX_PIPELINE = 64
MAX_DATA = 1024
MAX_DATA_LOCAL = 64
MAX_PODS_PER_REPLICA = 64

# Admission messages: the CEL rules (x-kubernetes-validations) and the pydantic validators say the
# same words, so a Python caller and `kubectl apply` see one explanation.
TENSOR_CONFLICT = ("parallelism.tensor and tensorParallelSize must be equal when both are set "
                   "(tensorParallelSize is the older spelling of parallelism.tensor)")
DATA_NEEDS_EXPERT = ("parallelism.data above 1 needs parallelism.expert: true: vLLM runs several "
                     "data-parallel ranks as one replica only for mixture-of-experts models with expert "
                     "parallel; dense models scale with replicas instead")
PODS_DIVIDE_RANKS = ("podsPerReplica must divide parallelism.tensor x parallelism.pipeline: every pod of a "
                     "replica runs an equal share of its ranks (vLLM --nnodes)")
PODS_DIVIDE_DATA = ("podsPerReplica must divide parallelism.data: every pod of a replica runs whole "
                    "data-parallel ranks, parallelism.dataLocal of them")
DATA_LOCAL_MISMATCH = ("parallelism.dataLocal must equal parallelism.data / podsPerReplica, the data-parallel "
                       "ranks each pod runs (1 without data parallel); leave it unset to have it derived")
# vLLM 0.32, measured on its CPU build (tests/test_nixl_progress.py has the engine fix that got PP serving):
# a decode (pipeline 1) refuses the KV of a pipeline-parallel prefill at the NIXL handshake ("Number of KV
# layers must match between prefill and decode": each stage registers only its layers, and only the push
# connector slices a remote's layers, which left every transfer waiting here), and a decode with pipeline
# parallel is refused outright. A pipeline-parallel prefill would silently recompute every prompt on the
# decode, so neither role may have one; a replica spans nodes with tensor (or data + expert) parallel.
PIPELINE = ("parallelism.pipeline must be 1 on prefill and decode: vLLM's NIXL connector moves KV cache only "
            "between engines that each hold every layer (a decode refuses a pipeline-parallel prefill's KV, and "
            "cannot receive into pipeline stages); span nodes with parallelism.tensor instead")


class _RoleLike(Protocol):
    """What :func:`layout` reads from a role (``disagg.api.v1alpha1.RoleSpec``), without importing it:
    the API module imports this one to validate, so this one must not import the API module."""

    tensor_parallel_size: int | None
    pods_per_replica: int
    parallelism: Any


@dataclass(frozen=True)
class Layout:
    """One replica's parallel layout. ``data_local`` of 0 means "derive it": ``data // pods``."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    expert: bool = False
    pods: int = 1
    data_local: int = 0

    def __post_init__(self) -> None:
        if not self.data_local:
            object.__setattr__(self, "data_local", max(self.data // self.pods, 1))

    @property
    def ranks_per_engine(self) -> int:
        """GPUs of one engine (one data-parallel rank): tensor x pipeline."""
        return self.tensor * self.pipeline

    @property
    def world_size(self) -> int:
        """Ranks, hence GPUs, of the whole replica across its data-parallel engines: what vLLM calls
        the world size across DP, and what a replica costs."""
        return self.ranks_per_engine * self.data

    @property
    def gpus_per_replica(self) -> int:
        return self.world_size

    @property
    def gpus_per_pod(self) -> int:
        """GPUs each pod requests. Exact only for a valid layout (:func:`problems` is empty)."""
        return self.world_size // self.pods

    @property
    def multi_node(self) -> bool:
        """One engine's torch.distributed world spans pods (tensor or pipeline parallel across them)."""
        return self.pods > 1 and self.data == 1

    @property
    def data_parallel_across_pods(self) -> bool:
        """Data-parallel engines spread over pods, each engine inside one pod."""
        return self.pods > 1 and self.data > 1


def layout(role: _RoleLike) -> Layout:
    """The layout a role spec asks for. ``parallelism.tensor`` wins over ``tensorParallelSize``
    (admission refuses them different); either unset falls back to the other, both unset to 1."""
    p = role.parallelism
    tensor = p.tensor if p.tensor is not None else (role.tensor_parallel_size or 1)
    return Layout(tensor=tensor, pipeline=p.pipeline, data=p.data, expert=bool(p.expert),
                  pods=role.pods_per_replica, data_local=p.data_local or 0)


def problems(lay: Layout, data_local_set: bool = False) -> list[str]:
    """What admission refuses about one role's layout, as the messages the CEL rules give, each with
    the numbers involved. ``data_local_set``: the spec set dataLocal (else it is derived and cannot
    disagree)."""
    out = []
    if lay.data > 1 and not lay.expert:
        out.append(f"{DATA_NEEDS_EXPERT} (data {lay.data})")
    if lay.data == 1 and lay.ranks_per_engine % lay.pods:
        out.append(f"{PODS_DIVIDE_RANKS} (tensor {lay.tensor} x pipeline {lay.pipeline} over {lay.pods} pods)")
    if lay.data > 1 and lay.data % lay.pods:
        out.append(f"{PODS_DIVIDE_DATA} (data {lay.data} over {lay.pods} pods)")
    if data_local_set and not (lay.data_local == 1 if lay.data == 1 else lay.data_local * lay.pods == lay.data):
        out.append(f"{DATA_LOCAL_MISMATCH} (dataLocal {lay.data_local}, data {lay.data}, {lay.pods} pods)")
    return out


def parallel_flags(lay: Layout) -> list[str]:
    """vLLM flags that are the same on every pod of a replica: the sizes of its parallel dimensions.
    Sizes of 1 are left out, as vLLM's defaults, so a one-pod tensor-parallel replica gets exactly
    the one flag it always got."""
    flags = ["--tensor-parallel-size", str(lay.tensor)]
    if lay.pipeline > 1:
        flags += ["--pipeline-parallel-size", str(lay.pipeline)]
    if lay.data > 1:
        flags += ["--data-parallel-size", str(lay.data)]
    if lay.expert:
        flags.append("--enable-expert-parallel")
    return flags


def rank_flags(lay: Layout, index: int, leader_address: str) -> list[str]:
    """vLLM flags that place pod ``index`` (0 = leader) of a replica in its group.

    ``leader_address`` is where the other pods reach the leader. vLLM binds and connects ZMQ sockets
    with it, and ZMQ does not resolve names, so it must be an IP by the time vLLM starts: pass the IP,
    or a ``$(VAR)`` the launcher replaces with the resolved leader IP.

    The leader of a data-parallel group gets no ``--data-parallel-start-rank``: vLLM takes that flag on
    a serving (non-headless) process as a request for hybrid load balancing, where each pod's API server
    feeds only its own engines, and our workers have none. Without it the leader's API server feeds
    every engine of the group, which is what routing to the leader alone needs.
    """
    if not 0 <= index < lay.pods:
        raise ValueError(f"pod index {index} is outside a replica of {lay.pods} pods")
    if lay.pods == 1:
        return []
    if lay.multi_node:
        # mp, not Ray: --nnodes needs it, and an image that happens to have Ray installed and a
        # placement group in scope would otherwise make vLLM pick Ray.
        flags = ["--distributed-executor-backend", "mp", "--nnodes", str(lay.pods), "--node-rank", str(index),
                 "--master-addr", leader_address, "--master-port", str(MASTER_PORT)]
    else:
        flags = ["--data-parallel-size-local", str(lay.data_local), "--data-parallel-address", leader_address,
                 "--data-parallel-rpc-port", str(DP_RPC_PORT)]
        if index > 0:
            flags += ["--data-parallel-start-rank", str(index * lay.data_local)]
    if index > 0:
        flags.append("--headless")
    return flags


def engine_flags(lay: Layout, index: int, leader_address: str) -> list[str]:
    """Every parallel flag pod ``index`` of a replica passes to vLLM."""
    return parallel_flags(lay) + rank_flags(lay, index, leader_address)


@dataclass(frozen=True)
class PodRank:
    """One pod of a replica as the engine sees it."""

    index: int
    leader: bool
    headless: bool
    first_rank: int            # its first global rank (data-parallel rank when data > 1)
    gpus: int
    flags: tuple[str, ...]


def group(lay: Layout, leader_address: str) -> list[PodRank]:
    """The pods of one replica, leader first."""
    out = []
    for i in range(lay.pods):
        first = i * lay.data_local if lay.data > 1 else i * (lay.world_size // lay.pods)
        out.append(PodRank(index=i, leader=i == 0, headless=i > 0, first_rank=first, gpus=lay.gpus_per_pod,
                           flags=tuple(engine_flags(lay, i, leader_address))))
    return out
