"""Multi-node terms of the performance model: one replica spread over several GPUs, pods and nodes.

:mod:`.model` prices one engine of ``tp`` GPUs inside one NVLink domain. A replica larger than that
(``disagg.api.parallelism.Layout``: tensor x pipeline x data, expert parallel, pods) adds:

* **the fabric** (:class:`Fabric`): GPUs per node, GPUs per NVLink domain, the network between domains;
  point-to-point transfers (:meth:`.model.PerfModel.p2p_time`, NCCL's send/recv measured on a DGX H100
  inside it and between two of them where calibrated) and tensor-parallel all-reduces that leave a domain
  (a ring over the network);
* **pipeline parallel** (:meth:`ReplicaModel.pipeline_prefill`, :meth:`ReplicaModel.pipeline_decode_step`):
  each stage runs ``layers / pipeline`` layers, so a stage takes the engine's time over ``pipeline``; a
  prompt passes every stage in turn plus a stage-to-stage activation transfer (``tokens x hidden`` 16-bit
  values, each tensor rank its share) at every boundary; a decode step keeps ``min(batch, pipeline)``
  micro-batches in flight, so below ``pipeline`` requests the pipeline idles (**the bubble**,
  ``1 - micro-batches / stages``);
* **data-parallel attention and expert parallel** for mixture-of-experts models (:meth:`ReplicaModel.moe_step`):
  attention, the dense layers and the shared experts on each GPU for its own requests; routed experts
  spread over every GPU of the replica (plus redundant copies), each GPU's expert GEMMs at the
  **per-expert batch** (its tokens x experts per token / experts, times the load imbalance), the
  **dispatch and combine all-to-all** (each routed token's hidden state out and back, FP8 out and BF16 back
  as DeepEP does) over NVLink to GPUs of the same domain and over the network to the others; with two
  micro-batches overlapped (DeepSeek's dual-batch overlap, SGLang's two-batch overlap) a step takes the
  longer of compute and communication, else their sum;
* **expert load imbalance** (:func:`expert_imbalance`): the busiest GPU's share of routed tokens over the
  mean, from the number of GPUs and the tokens each receives;
* **KV transfer between heterogeneous layouts** (:func:`kv_transfer_seconds`): charged per rank, each
  decode rank reading the KV heads it owns from the prefill ranks holding them (prefill TP 2 -> decode TP 1:
  one decode rank reads both shards over its one link; TP 1 -> TP 2: the one prefill rank's link sends
  both halves), a latency per read.

Every published figure this is checked against, with its assumptions, is in ``perf/README.md``
(``tests/test_perf_parallel.py``). vLLM 0.32 cannot hand a pipeline-parallel prefill's KV to a decode
(README, "Why no pipeline parallel"): the configurator reports layouts that would need pipeline parallel
and never emits them, but the model prices them, which is how it says what they would give.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

from disagg.api.parallelism import Layout

from .model import Interconnect, ModelShape, PerfModel, Profile, gpu, interconnect

# DeepEP moves a routed token's hidden state out in FP8 (1 byte a value, plus a scale per 128 values) and
# back in BF16 (DeepSeek's inference system overview: "dispatch ... FP8 ... combine ... BF16").
DISPATCH_BYTES = 1.0 + 4.0 / 128
COMBINE_BYTES = 2.0
# The busiest GPU's routed tokens over the mean, beyond sampling noise, after expert placement balanced
# the experts' popularity (EPLB with redundant experts). SGLang's large-scale EP blog: default placement
# 50.3k vs simulated perfect balance 59.3k tokens/s per node in prefill, a ~1.18x slower MoE step.
EXPERT_SKEW = 1.10
# Share of the shorter of compute and communication that two overlapped micro-batches hide. Fitted to
# SGLang's two-batch-overlap ablation (large-scale EP blog): TBO sped decode up 25.5% at 256 requests per
# GPU and prefill 27-35%; with this model's compute and all-to-all times for those setups, hiding half of
# the shorter gives those speed-ups (hiding all of it: 60-75%).
OVERLAP_HIDDEN = 0.5
# DeepSeek-V3 routes each token to experts on at most 4 nodes; DeepEP's normal (prefill) kernels send a
# token once to each destination node over the network and forward it over NVLink there. Its low-latency
# (decode) kernels send every (token, expert) pair straight over the network.
MAX_NODES_PER_TOKEN = 4


@dataclass(frozen=True)
class Fabric:
    """How GPUs are joined: ``gpus_per_node`` per node (a pod takes whole nodes' GPUs or fewer), NVLink
    between the ``domain_gpus`` GPUs of one domain (one node of 8 H100s; 72 in an NVL72 rack), ``network``
    (one NIC per GPU) between domains."""

    gpus_per_node: int = 8
    domain_gpus: int = 8
    network: Interconnect = field(default_factory=lambda: interconnect("infiniband-ndr"))

    def __post_init__(self) -> None:
        if self.gpus_per_node < 1 or self.domain_gpus < self.gpus_per_node:
            raise ValueError(f"a fabric needs at least one GPU per node and NVLink domains of whole nodes "
                             f"({self.gpus_per_node} per node, {self.domain_gpus} per domain)")


def expert_imbalance(rows_per_gpu: float, gpus: int, skew: float = EXPERT_SKEW) -> float:
    """Routed tokens on the busiest of ``gpus`` GPUs over the mean, when each receives ``rows_per_gpu``
    (token, expert) pairs on average: the placement's residual ``skew`` times the largest of ``gpus``
    Poisson loads (mean + sqrt(2 ln gpus) standard deviations). 1 on one GPU."""
    if gpus <= 1 or rows_per_gpu <= 0:
        return 1.0
    return skew * (1.0 + math.sqrt(2.0 * math.log(gpus) / rows_per_gpu))


def kv_transfer_seconds(shape: ModelShape, tokens: float, prefill_tp: int, decode_tp: int,
                        link: Interconnect, data_parallel: bool = False) -> float:
    """Seconds to move one prompt's KV cache from a prefill engine of TP ``prefill_tp`` to a decode engine of
    TP ``decode_tp``, charged per rank: every rank has its own link; the slowest rank's bytes over its link
    plus a latency for each read it makes (NIXL reads each remote shard apart).

    K/V heads are split over TP ranks (replicated when TP exceeds them); a decode rank reads the heads it
    owns from the prefill ranks that hold them, a prefill rank's link sends each of its heads once. MLA's
    latent (``kv_latent``) is not split by heads: every decode rank needs all of it, read from a different
    prefill rank each; with data-parallel attention (``data_parallel``) a request's KV lives on one rank
    (TP 1) on either side."""
    if tokens <= 0:
        return 0.0
    total = shape.kv_bytes_per_token * tokens
    bw = link.bandwidth * link.efficiency
    if data_parallel or shape.kv_latent:
        # the whole latent (or a DP rank's request) reaches each decode rank from one prefill rank
        return link.latency_seconds + total / bw
    heads = max(shape.kv_heads, 1)
    held_p, held_d = min(prefill_tp, heads), min(decode_tp, heads)   # distinct shards on each side
    per_head = total / heads
    recv = per_head * heads / held_d                                  # each decode rank's heads
    send = per_head * heads / held_p                                  # each prefill rank's heads, once
    reads = max(held_p // held_d, 1)                                  # prefill shards one decode rank reads
    return reads * link.latency_seconds + max(recv, send) / bw


@dataclass(frozen=True)
class MoEStep:
    """One engine step of a data-parallel-attention, expert-parallel replica, per GPU (seconds), and what it
    assumed: ``tokens`` per GPU, ``rows`` (token, expert) pairs per GPU after imbalance, ``per_expert`` the
    per-expert batch of one local expert."""

    dense: float
    attention: float
    experts: float
    dispatch: float
    combine: float
    overhead: float
    overlap: bool
    tokens: float
    rows: float
    per_expert: float
    imbalance: float

    @property
    def compute(self) -> float:
        return self.dense + self.attention + self.experts

    @property
    def communication(self) -> float:
        return self.dispatch + self.combine

    @property
    def total(self) -> float:
        """Compute plus communication, less the share of the shorter that two overlapped micro-batches hide
        (:data:`OVERLAP_HIDDEN`), plus the step's fixed overhead."""
        hidden = OVERLAP_HIDDEN * min(self.compute, self.communication) if self.overlap else 0.0
        return self.compute + self.communication - hidden + self.overhead


@dataclass(frozen=True)
class ReplicaModel:
    """One replica of ``layout`` on ``fabric``. ``engine`` prices one engine (``tp`` = ``layout.tensor``,
    the whole model's weights) inside one NVLink domain; this adds what crossing GPUs, nodes and domains
    costs. ``attention_flops``: the FLOP/s attention's core runs at (BF16 while FP8 weights run GEMMs at
    the FP8 rate; 0: the engine's). ``mtp_tokens``: tokens a decode step emits per request (multi-token
    prediction: 1 + the draft's acceptance). ``redundant_experts``: extra expert copies for balance (EPLB)."""

    engine: PerfModel
    layout: Layout = Layout()
    fabric: Fabric = Fabric()
    overlap: bool = True
    attention_flops: float = 0.0
    mtp_tokens: float = 1.0
    redundant_experts: int = 0
    skew: float = EXPERT_SKEW

    @classmethod
    def of(cls, model_name: str, gpu_name: str, layout: Layout, fabric: Fabric | None = None,
           precision: str = "bf16", **kwargs: Any) -> ReplicaModel:
        """From the data files, at ``precision`` (``fp8``: FP8 weights and GEMMs, attention at BF16)."""
        from .model import model as shape_of

        shape = shape_of(model_name)
        if precision == "fp8":
            shape = replace(shape, dtype_bytes=1, kv_dtype_bytes=shape.kv_dtype_bytes or 2)
        engine = PerfModel.analytic(model_name, gpu_name, layout.tensor)
        engine = replace(engine, shape=shape, hw=gpu(gpu_name, precision),
                         calibration=engine.calibration if precision == "bf16" else None)
        if precision != "bf16":
            from .model import default_efficiency
            engine = replace(engine, eff=default_efficiency())
        return cls(engine, layout, fabric or Fabric(), attention_flops=gpu(gpu_name).flops, **kwargs)

    @property
    def shape(self) -> ModelShape:
        return self.engine.shape

    @property
    def gpus(self) -> int:
        return self.layout.gpus_per_replica

    @property
    def in_one_domain(self) -> bool:
        return self.gpus <= self.fabric.domain_gpus

    # -- memory ------------------------------------------------------------
    def weight_bytes_per_gpu(self) -> float:
        """Each GPU's weights: the dense part split over tensor x pipeline, routed experts over every GPU
        of an expert-parallel replica (with their redundant copies), else over tensor x pipeline as well."""
        s, lay = self.shape, self.layout
        b = s.dtype_bytes
        if s.moe and lay.expert:
            dense = (s.params - s.routed_params) * b / lay.ranks_per_engine
            experts = s.moe_layers * (s.experts + self.redundant_experts) * s.expert_params * b / self.gpus
            return dense + experts
        return s.weight_bytes / lay.ranks_per_engine

    def kv_capacity_tokens(self) -> float:
        """Tokens of KV cache the replica holds (every GPU's free memory; MLA's latent is replicated over a
        tensor group, so a DP rank of TP t holds its own requests' only once per t GPUs)."""
        e = self.engine
        free = self.engine.hw.memory_bytes * e.eff.memory_utilization - self.weight_bytes_per_gpu()
        per_gpu = max(free, 0.0) / self.shape.kv_bytes_per_token
        if self.shape.kv_latent:
            return per_gpu * self.gpus / self.layout.tensor
        return per_gpu * self.gpus

    # -- communication -----------------------------------------------------
    def allreduce_time(self, nbytes: float, workers: int) -> float:
        """One all-reduce across ``workers`` tensor ranks: the engine's (measured up to 8, else a ring over
        NVLink) inside one domain; a ring over the network when the group leaves the domain."""
        if workers <= 1 or nbytes <= 0:
            return 0.0
        if workers <= self.fabric.domain_gpus:
            return self.engine.allreduce_time(nbytes, workers)
        net = self.fabric.network
        return 2 * (workers - 1) * net.latency_seconds + 2.0 * (workers - 1) / workers * nbytes / (
            net.bandwidth * net.efficiency)

    def tp_comm_time(self, tokens: float) -> float:
        """Two all-reduces per layer of a tensor group (see :meth:`.model.PerfModel.tp_comm_time`); over the
        network when the group is wider than a domain."""
        t = self.layout.tensor
        if t <= self.fabric.domain_gpus:
            return self.engine.tp_comm_time(tokens)
        return 2 * self.shape.layers * self.allreduce_time(tokens * self.shape.hidden * 2, t)

    def stage_transfer_time(self, tokens: float) -> float:
        """One pipeline boundary: ``tokens`` x hidden 16-bit activations, each tensor rank sending its share
        to its peer in the next stage at once; over NVLink when the replica fits a node, else between nodes
        (measured send/recv where calibrated)."""
        if self.layout.pipeline <= 1 or tokens <= 0:
            return 0.0
        per_rank = tokens * self.shape.hidden * 2 / self.layout.tensor
        cross = self.layout.ranks_per_engine > self.fabric.gpus_per_node
        if cross and not self.in_one_domain:
            return self.engine.p2p_time(per_rank, cross_node=True)
        # within one NVLink domain (a node, or a multi-node NVLink domain) the boundary is NVLink
        return self.engine.p2p_time(per_rank, cross_node=False)

    # -- dense models: tensor and pipeline parallel --------------------------------
    def _engine_no_comm(self) -> PerfModel:
        return replace(self.engine, tp_comm=False)

    def prefill_stage_time(self, batch: list[tuple[float, float]]) -> float:
        """One pipeline stage's share of prefilling ``batch`` (the engine's time over the stages, its
        tensor all-reduces included)."""
        n = sum(t for t, _ in batch)
        body = self._engine_no_comm().prefill_time(batch) + self.tp_comm_time(n)
        return body / self.layout.pipeline

    def pipeline_prefill(self, batch: list[tuple[float, float]]) -> tuple[float, float]:
        """``(latency, interval)`` of prefilling ``batch`` on a pipeline of ``pipeline`` stages: it passes every
        stage and every boundary in turn; with the pipeline full a new batch can start every ``interval``
        (a stage, or a boundary if slower). Both equal the engine's time without pipeline parallel."""
        p = self.layout.pipeline
        stage = self.prefill_stage_time(batch)
        xfer = self.stage_transfer_time(sum(t for t, _ in batch))
        return p * stage + (p - 1) * xfer, max(stage, xfer)

    def prefill_time(self, batch: list[tuple[float, float]]) -> float:
        """The latency of one prefill of ``batch`` on this replica (one engine: data parallel is for MoE)."""
        return self.pipeline_prefill(batch)[0]

    def pipeline_decode_step(self, concurrency: float, context_total: float) -> tuple[float, float]:
        """``(ITL, bubble)`` of a decode step of ``concurrency`` requests on ``pipeline`` stages: vLLM keeps
        up to ``pipeline`` micro-batches in flight; with ``m = min(concurrency, pipeline)`` of them, each of
        ``concurrency / m`` requests, a request's token passes every stage and boundary, and each stage is
        busy ``m`` of every ``pipeline`` slots (the bubble is the rest)."""
        if concurrency <= 0:
            return 0.0, 0.0
        p = self.layout.pipeline
        m = max(min(concurrency, p), 1.0)
        b = concurrency / m
        engine = self._engine_no_comm()
        stage = (engine.decode_step_time(b, context_total / m) + self.tp_comm_time(b)) / p
        itl = p * stage + (p - 1) * self.stage_transfer_time(b) if p > 1 else stage
        return itl, 1.0 - m / p

    def itl(self, concurrency: float, context_tokens: float) -> float:
        return self.pipeline_decode_step(concurrency, concurrency * context_tokens)[0]

    # -- mixture of experts: data-parallel attention and expert parallel ------------
    def moe_step(self, tokens: float, context: float, phase: str = "decode") -> MoEStep:
        """One step of every GPU of a DP-attention, expert-parallel replica holding ``tokens`` tokens per GPU
        (prefill: new prompt tokens, each attending to ``context`` tokens on average, causal prefix included;
        decode: requests, each with ``context`` tokens of KV). Each DP rank runs ``tensor`` GPUs."""
        s, e, lay, fab = self.shape, self.engine, self.layout, self.fabric
        if not (s.moe and lay.expert):
            raise ValueError(f"{s.name}: moe_step needs a mixture-of-experts model with expert parallel")
        hw, eff = e.hw, e.eff
        t = lay.tensor
        gpus = self.gpus
        b = s.dtype_bytes
        # dense part on each GPU: attention projections, shared experts, dense layers, the LM head
        dense_params = max((s.active_params or s.params) - s.moe_layers * s.experts_active * s.expert_params
                           - s.vocab * s.hidden, 0.0)
        dense_flops = 2.0 * tokens * dense_params / t
        dense_bytes = (s.params - s.routed_params - s.vocab * s.hidden) * b / t
        dense = max(dense_flops / (hw.flops * eff.prefill_mfu), dense_bytes / (hw.hbm_bandwidth * eff.decode_mbu))
        dense += self.tp_comm_time(tokens) if t > 1 else 0.0
        # attention's core at BF16
        att_rate = (self.attention_flops or hw.flops) * eff.prefill_mfu
        kv = s.kv_bytes_per_token
        if phase == "prefill":
            att = 4.0 * s.layers * s.q_dim * tokens * context / t / att_rate
        else:
            width = 2 * s.kv_latent if s.kv_latent else 2 * s.head_dim   # absorbed MLA: QK over the latent, AV
            flops = 2.0 * s.layers * s.heads * width * tokens * context / t
            att = max(flops / att_rate, tokens * context * kv / (hw.hbm_bandwidth * eff.decode_mbu))
        # routed experts at the per-expert batch
        rows = tokens * s.experts_active                       # (token, expert) pairs a GPU sends and receives
        imb = expert_imbalance(rows, gpus, self.skew)
        local = (s.experts + self.redundant_experts) / gpus    # experts per GPU
        per_expert = rows * imb / max(local, 1e-9)
        one = (e.gemm_time(per_expert, s.hidden, 2 * s.expert_intermediate)
               + e.gemm_time(per_expert, s.expert_intermediate, s.hidden))
        experts = s.moe_layers * local * one
        # dispatch and combine: the rows leaving this GPU, over NVLink inside the domain, network beyond
        in_domain = min(gpus, fab.domain_gpus)
        nvl = rows * (in_domain - 1) / gpus
        net = rows * (gpus - in_domain) / gpus
        domains = gpus / in_domain
        if phase == "prefill" and domains > 1:
            # normal kernels: once per remote destination domain (node-limited routing), then NVLink
            reach = min(domains, MAX_NODES_PER_TOKEN)
            distinct = reach * (1.0 - (1.0 - 1.0 / reach) ** s.experts_active)
            net = tokens * distinct * (domains - 1) / domains
        nvl_bw = hw.nvlink_bandwidth * 0.8
        net_bw = fab.network.bandwidth * fab.network.efficiency
        lat = fab.network.latency_seconds if gpus > in_domain else eff.tp_allreduce_latency_seconds

        def a2a(width: float) -> float:
            bytes_per_row = s.hidden * width * imb
            return lat + max(nvl * bytes_per_row / nvl_bw, net * bytes_per_row / net_bw)

        dispatch = s.moe_layers * a2a(DISPATCH_BYTES)
        combine = s.moe_layers * a2a(COMBINE_BYTES)
        return MoEStep(dense, att, experts, dispatch, combine, eff.step_overhead_seconds, self.overlap,
                       tokens, rows * imb, per_expert, imb)

    def moe_prefill_throughput(self, tokens_per_gpu: float, prompt: float, cached: float = 0.0) -> float:
        """New prompt tokens/s per GPU with ``tokens_per_gpu`` prompt tokens a step, prompts of ``prompt``
        tokens of which ``cached`` were cached (each new token attends to the cached part and, on average,
        half of the new part)."""
        new = max(prompt - cached, 1.0)
        step = self.moe_step(tokens_per_gpu, cached + (new + 1) / 2.0, "prefill")
        return tokens_per_gpu / step.total

    def moe_decode_step(self, batch_per_gpu: float, context: float) -> MoEStep:
        """A decode step of ``batch_per_gpu`` requests: with multi-token prediction (``mtp_tokens`` > 1) every
        request runs two tokens through the model (its next and the draft's guess to verify)."""
        per_request = 2.0 if self.mtp_tokens > 1.0 else 1.0
        return self.moe_step(batch_per_gpu * per_request, context, "decode")

    def moe_decode_throughput(self, batch_per_gpu: float, context: float) -> float:
        """Output tokens/s per GPU with ``batch_per_gpu`` requests of ``context`` tokens each."""
        return batch_per_gpu * self.mtp_tokens / self.moe_decode_step(batch_per_gpu, context).total

    def moe_decode_speed(self, batch_per_gpu: float, context: float) -> float:
        """Output tokens/s each request sees."""
        return self.mtp_tokens / self.moe_decode_step(batch_per_gpu, context).total


# GPU Feature Discovery's label naming one NVLink domain (a multi-node NVLink system's clique): a topology
# constraint on it keeps a replica's all-to-all on NVLink. The configurator writes it; the planner reads it.
NVLINK_DOMAIN_KEY = "nvidia.com/gpu.clique"


@dataclass(frozen=True)
class DataParallelEngine(PerfModel):
    """A data-parallel-attention, expert-parallel replica (``layout.data`` ranks of ``layout.tensor`` GPUs,
    ``layout.expert``) as the serving model (:mod:`.serving`), the planner and the simulator see a replica:
    a :class:`.model.PerfModel` whose prefill, decode step and KV capacity are :class:`ReplicaModel`'s MoE
    terms, so the queueing, Little's law, caps and corrections above it apply unchanged.

    * **prefill**: each rank prefills its own prompts; the replica is :attr:`servers` = ``data`` servers of
      one queue. A batch's prompts go to the least loaded rank, largest first, and the step is
      :meth:`ReplicaModel.moe_step` at the busiest rank's tokens on every GPU: a prompt's time is the
      step's with every rank as busy as it (the loaded step, what the queue's service time must be: the
      expert layers run every rank in lock step);
    * **decode**: ``concurrency`` requests spread over the ranks (at least one on the busiest); a step is
      :meth:`ReplicaModel.moe_decode_step` at ``concurrency / data`` requests per rank;
    * **KV capacity**: every GPU's memory less its dense weights and its share of the experts; a request's
      KV lives on one rank (:attr:`data_parallel`), so a rank holds ``capacity / data``.

    ``tp`` is a rank's tensor size (the KV transfer's per-rank charge reads it), :attr:`gpus` the replica's.
    ``prefill_scale`` / ``decode_scale`` (the planner's corrections) scale the whole step."""

    layout: Layout = Layout(data=2, expert=True)
    fabric: Fabric = Fabric()
    attention_flops: float = 0.0
    redundant_experts: int = 0
    overlap: bool = True
    skew: float = EXPERT_SKEW

    def __post_init__(self) -> None:
        if not (self.shape.moe and self.layout.expert and self.layout.data > 1):
            raise ValueError(f"{self.shape.name}: a data-parallel engine needs a mixture-of-experts model with "
                             f"data > 1 and expert parallel ({self.layout})")
        if self.tp != self.layout.tensor:
            object.__setattr__(self, "tp", self.layout.tensor)

    @property
    def replica(self) -> ReplicaModel:
        return ReplicaModel(self, self.layout, self.fabric, overlap=self.overlap,
                            attention_flops=self.attention_flops, redundant_experts=self.redundant_experts,
                            skew=self.skew)

    @property
    def gpus(self) -> int:
        return self.layout.gpus_per_replica

    @property
    def servers(self) -> int:
        return self.layout.data

    @property
    def data_parallel(self) -> bool:
        return True

    def prefill_time(self, batch: Sequence[tuple[float, float]]) -> float:
        """One prefill step of ``batch`` ``(new, cached)`` prompts spread over the ranks (see the class)."""
        if not batch or sum(n for n, _ in batch) <= 0:
            return 0.0
        ranks = self.layout.data
        tokens, attended = [0.0] * ranks, [0.0] * ranks
        for n, c in sorted(batch, reverse=True):
            i = min(range(ranks), key=tokens.__getitem__)
            tokens[i] += n
            attended[i] += n * (c + (n + 1) / 2.0)   # each new token: the cached part and half the new one
        busiest = max(range(ranks), key=tokens.__getitem__)
        context = attended[busiest] / tokens[busiest]
        return self.replica.moe_step(tokens[busiest], context, "prefill").total * self.prefill_scale

    def decode_step_time(self, concurrency: float, context_total: float) -> float:
        if concurrency <= 0:
            return 0.0
        per_rank = max(concurrency / self.layout.data, 1.0)
        step = self.replica.moe_decode_step(per_rank, context_total / concurrency)
        return step.total * self.decode_scale

    def mixed_step_time(self, concurrency: float, context_total: float,
                        prefill: Sequence[tuple[float, float]] = (), prefill_fraction: float = 1.0) -> float:
        raise NotImplementedError("a data-parallel engine is priced for disaggregated prefill and decode only")

    def kv_capacity_tokens(self) -> float:
        return self.replica.kv_capacity_tokens()

    def max_concurrency(self, context_tokens: float) -> int:
        """Requests whose KV fits: whole requests on each rank, ``data`` ranks."""
        per_rank = self.kv_capacity_tokens() / self.layout.data
        return max(int(per_rank // max(context_tokens, 1.0)), 0) * self.layout.data

    def max_concurrency_for_itl(self, itl_target: float, context_tokens: float, limit: int = 4096) -> int:
        return super().max_concurrency_for_itl(itl_target, context_tokens, limit * self.layout.data)


def role_engine(model_name: str, gpu_name: str, layout: Layout, link: str = "infiniband-ndr",
                profile: Profile | None = None, nvlink_domain: int = 0, fabric: Fabric | None = None,
                **kwargs: Any) -> PerfModel:
    """The performance model of one replica of ``layout``: the planner's and the simulator's one way to
    build it. A data-parallel expert-parallel layout of a mixture-of-experts model gets a
    :class:`DataParallelEngine` (GEMMs at the weights' width: FP8 weights at the FP8 rate, attention at
    BF16; its ``fabric`` by default: each pod a node, NVLink across ``nvlink_domain`` GPUs when a topology
    constraint keeps the replica in one NVLink domain, else within a pod, the network between); any other
    layout the one-engine :meth:`.model.PerfModel.analytic` at its tensor size, as before."""
    from .model import model as shape_of

    shape = shape_of(model_name)
    if not (shape.moe and layout.expert and layout.data > 1):
        return PerfModel.analytic(model_name, gpu_name, layout.tensor, link, profile=profile)
    precision = "fp8" if shape.dtype_bytes == 1 else "bf16"
    base = PerfModel.analytic(model_name, gpu_name, layout.tensor, link, profile=profile)
    if precision == "fp8":
        from .model import default_efficiency
        base = replace(base, hw=gpu(gpu_name, "fp8"), calibration=None, eff=default_efficiency())
    if fabric is None:
        pod = layout.gpus_per_pod
        domain = max(nvlink_domain, pod)
        fabric = Fabric(pod, domain - domain % pod)
    fields = {f: getattr(base, f) for f in ("shape", "hw", "tp", "link", "eff", "profile", "calibration")}
    return DataParallelEngine(**fields, layout=layout, fabric=fabric, attention_flops=gpu(gpu_name).flops, **kwargs)


def group_startup(pod_startups: list[float] | tuple[float, ...]) -> float:
    """A multi-pod replica serves once its slowest pod has: the leader waits for every rank to join
    (``workers/leader.py``, vLLM's torch.distributed group), so a group's start-up is the largest of its
    pods'."""
    return max(pod_startups) if pod_startups else 0.0


# ---------------------------------------------------------------- published large-scale results

@dataclass(frozen=True)
class Published:
    """A published throughput per node, the setup it was measured on, and the model's figure for it."""

    name: str
    source: str
    published: float          # tokens/s per node
    model: float              # the model's tokens/s per node for the same setup
    assumptions: tuple[str, ...]

    @property
    def ratio(self) -> float:
        return self.model / self.published


DEEPSEEK = "deepseek-ai/DeepSeek-V3"
# DeepSeek's day-6 overview, 24 h of production: 608B input tokens (56.3% cache hits), 168B output tokens,
# average KV length per output token 4,989, average output speed 20-22 tokens/s, peak 278 nodes, mean 226.75
DS_CACHE_HIT = 0.563
DS_PROMPT = 4384          # I + O/2 = 4,989 with I/O = 608/168: I = 4,384, O = 1,211
DS_SPEED = 21.0           # tokens/s per request, the middle of 20-22
DS_MTP = 1.8              # tokens per decode step: 1 + the second token's acceptance (V3 report: 85-90%)
DS_LOAD = 0.9 * 226.75 / 278   # prefill node-average busy share (see published_checks)


def _deepseek(gpu_name: str, ranks: int, mtp: float = 1.0) -> ReplicaModel:
    lay = Layout(tensor=1, data=ranks, expert=True, pods=ranks // 8)
    return ReplicaModel.of(DEEPSEEK, gpu_name, lay, Fabric(8, 8, interconnect("infiniband-ndr")), precision="fp8",
                           redundant_experts=32, mtp_tokens=mtp)


def decode_batch_at_speed(m: ReplicaModel, context: float, speed: float) -> float:
    """The requests per GPU at which each request sees ``speed`` tokens/s (bisection; speed falls with batch)."""
    lo, hi = 1.0, 4096.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if m.moe_decode_speed(mid, context) > speed else (lo, mid)
    return lo


def published_checks() -> list[Published]:
    """The two published large-scale deployments of DeepSeek-V3 (four figures), each with the setup as its
    source gives it and every assumption the model adds."""
    common = ("DeepSeek-V3 671B (37B active), FP8 GEMMs and dispatch, BF16 attention and combine",
              "data-sheet efficiencies (MFU 0.5, MBU 0.7, 3 ms a step), no calibration (FP8)",
              "32 redundant experts (EPLB), residual expert skew 1.10 x the Poisson maximum",
              "two micro-batches overlapped, hiding half of the shorter of compute and all-to-all",
              "one 400 Gb/s InfiniBand NIC per GPU at 85%, NVLink inside each 8-GPU node")
    out = []
    m = _deepseek("H800-SXM", 32)
    cached = DS_PROMPT * DS_CACHE_HIT
    computed = m.moe_prefill_throughput(16384, DS_PROMPT, cached) * 8
    out.append(Published(
        "DeepSeek prefill, input tokens/s per H800 node (cache hits included)",
        "DeepSeek open-source week day 6, 'DeepSeek-V3/R1 Inference System Overview' (2025-03-01)",
        73.7e3, computed / (1 - DS_CACHE_HIT) * DS_LOAD,
        common + ("EP32 / DP32 attention, 4 nodes per prefill unit (as published)",
                  f"prompt {DS_PROMPT} tokens, {DS_CACHE_HIT:.1%} of them cached (published 608B input, 168B "
                  "output, 4,989 KV tokens per output token: I + O/2 = 4,989, I/O = 3.62)",
                  "16,384 prompt tokens per GPU a step (DeepSeek's profile-data batch)",
                  f"nodes busy {DS_LOAD:.2f} of the day on average: the serving model's prefill cap 0.9 x "
                  "226.75 / 278 (mean over peak nodes); at full load the model gives "
                  f"{computed / (1 - DS_CACHE_HIT) / 1e3:.0f}k (the weakest assumption)")))
    m = _deepseek("H800-SXM", 144, DS_MTP)
    batch = decode_batch_at_speed(m, 4989, DS_SPEED)
    out.append(Published(
        "DeepSeek decode, output tokens/s per H800 node",
        "DeepSeek open-source week day 6, 'DeepSeek-V3/R1 Inference System Overview' (2025-03-01)",
        14.8e3, m.moe_decode_throughput(batch, 4989) * 8,
        common + ("EP144 / DP144 attention, 18 nodes per decode unit (as published)",
                  "context 4,989 tokens (published average KV length per output token)",
                  f"MTP: 2 tokens through the model per request a step, {DS_MTP} emitted",
                  f"batch {batch:.0f} requests per GPU: where the model's per-request speed is the published "
                  f"20-22 tokens/s ({DS_SPEED:g})")))
    m = _deepseek("H100-SXM", 32)
    out.append(Published(
        "SGLang prefill, input tokens/s per H100 node, 2,000-token prompts",
        "LMSYS blog 'Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 H100 "
        "GPUs' (2025-05-05)",
        52.3e3, m.moe_prefill_throughput(16384, 2000) * 8,
        common + ("4 nodes x 8 H100, EP32 / DP32 attention (as published), no cache hits",
                  "16,384 prompt tokens per GPU a step (the blog's prefill batch)",
                  "the headline 52.3k (the blog's 2K bar reads 54.5k)")))
    m = _deepseek("H100-SXM", 72)
    out.append(Published(
        "SGLang decode, output tokens/s per H100 node, 2,000-token inputs",
        "LMSYS blog 'Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 H100 "
        "GPUs' (2025-05-05)",
        22.3e3, m.moe_decode_throughput(256, 2000) * 8,
        common + ("9 nodes x 8 H100, EP72 / DP72 attention (as published)",
                  "256 requests per GPU, 2,000 tokens of KV each (as published), no MTP")))
    return out


if __name__ == "__main__":   # python -m disagg.perf.parallel: the table perf/README.md carries
    print("| published | figure | model | model / published | assumptions |")
    print("|---|---|---|---|---|")
    for p in published_checks():
        print(f"| {p.name} ({p.source}) | {p.published / 1e3:.1f}k | {p.model / 1e3:.1f}k | {p.ratio:.2f} | "
              + "; ".join(p.assumptions) + " |")
