"""Layouts, their estimates and the Pareto frontiers (aggregated and disaggregated).

Every latency comes from the shared performance model (:mod:`disagg.perf.model`) and the queueing,
KV transfer, batch margins and utilisation caps from the shared serving model (:mod:`disagg.perf.serving`),
the planner's and the simulator's too; this module adds the layouts: how many requests a layout carries at a
given decode batch (Little's law), the chunk budget of an aggregated engine, and the Pareto frontier of output
tokens/s per GPU against tokens/s per user.

Points (one per layout and decode batch):

* aggregated: ``workers`` replicas of TP ``t``, each running ``b`` requests with chunked prefill: every step
  decodes ``b`` requests and prefills ``b / OSL`` of a prompt in the same pass over the weights;
  ITL = that step; TTFT = the rest of the running step + the wait for chunk budget + the step(s) that
  prefill the prompt.
* disaggregated ``xPyD``: ``x`` prefill workers of TP ``tp_p``, ``y`` decode workers of TP ``tp_d``, ``b``
  requests per decode worker; ITL = a decode step at ``b``; the request rate follows from Little's law
  (``b = rate/y x OSL x ITL``) and the least ``x`` is taken whose TTFT at the SLO percentile (M/G/c wait +
  prefill + KV transfer over the interconnect + the first decode step) meets the target. The unit ``xPyD``
  is replicated to fill the GPU budget (per-GPU figures are those of one unit).

tokens/s/GPU counts output tokens per second per GPU used; tokens/s/user is 1 / mean ITL. The SLO
percentile applies to TTFT (queueing tail) and ITL (the decode batch one z-score above its mean).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from disagg.perf import model as pm
from disagg.perf import serving
from disagg.perf.serving import queue_wait

TP_SIZES = (1, 2, 4, 8, 16, 32, 64)
# data-parallel ranks of one DP-attention, expert-parallel replica of a mixture-of-experts model (tensor 1 a
# rank): within one node, then whole nodes (DeepSeek's EP32 prefill and EP144 decode, SGLang's EP32 and EP72)
DATA_SIZES = (2, 4, 8, 16, 24, 32, 40, 48, 64, 72, 96, 128, 144, 192, 256)
BATCHES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
CHUNKS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)   # aggregated prefill chunk budgets tried


@dataclass(frozen=True)
class Inputs:
    """What the user asks (CLI flags and the web form carry the same fields)."""

    model: str
    gpu: str
    gpus: int
    isl: int = 3000
    osl: int = 150
    ttft_ms: float = 500.0
    itl_ms: float = 50.0
    percentile: float = 90.0
    interconnect: str = "infiniband"
    prefix_reuse: float = 0.0
    precision: str = "bf16"
    max_batch: int = 512
    max_batched_tokens: int = 8192
    max_tp: int = 8
    calibration: str | None = None
    profile: str | None = None
    gpus_per_node: int = 8        # GPUs of one node: a pod takes at most these; a wider replica spans pods
    domain_gpus: int = 0          # GPUs of one NVLink domain (0: one node): tensor parallel never leaves it
    max_data: int = 256           # most data-parallel ranks (= expert-parallel GPUs) of one MoE replica

    @property
    def domain(self) -> int:
        return self.domain_gpus or self.gpus_per_node

    def __post_init__(self) -> None:
        problems = []
        if self.gpus < 1:
            problems.append("gpus must be at least 1")
        if self.isl < 1 or self.osl < 1:
            problems.append("isl and osl must be at least 1 token")
        if not (self.ttft_ms > 0 and self.itl_ms > 0):
            problems.append("ttft-ms and itl-ms must be positive")
        if not 50 <= self.percentile < 100:
            problems.append("percentile must be in [50, 100)")
        if not 0 <= self.prefix_reuse < 1:
            problems.append("prefix-reuse must be in [0, 1)")
        if self.max_batch < 1 or self.max_batched_tokens < 1 or self.max_tp < 1 or self.max_data < 1:
            problems.append("max-batch, max-batched-tokens, max-tp and max-data must be at least 1")
        if self.gpus_per_node < 1 or (self.domain_gpus and self.domain_gpus % self.gpus_per_node):
            problems.append("gpus-per-node must be at least 1 and domain-gpus whole nodes of them")
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def from_mapping(cls, d: dict[str, Any]) -> Inputs:
        """From a web form or JSON body (strings allowed; unknown keys refused)."""
        names = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown inputs: {', '.join(sorted(unknown))}")
        kinds = {"gpus": int, "isl": int, "osl": int, "ttft_ms": float, "itl_ms": float, "percentile": float,
                 "prefix_reuse": float, "max_batch": int, "max_batched_tokens": int, "max_tp": int,
                 "gpus_per_node": int, "domain_gpus": int, "max_data": int}
        out: dict[str, Any] = {}
        for k, v in d.items():
            if v is None or v == "":
                continue
            try:
                out[k] = kinds[k](v) if k in kinds else str(v)
            except (TypeError, ValueError):
                raise ValueError(f"{k}: not a number: {v!r}") from None
        return cls(**out)


# ---------------------------------------------------------------- resolving names

def resolve_model(spec: str) -> tuple[pm.ModelShape, str]:
    """A model shape and where its weights come from, by known name (any case, with or without the
    organisation) or from a config.json (file or directory)."""
    known = pm.known_models()
    low = spec.lower()
    for name in known:
        if low in (name.lower(), name.split("/")[-1].lower()):
            return pm.model(name), f"hf://{name}"
    path = Path(spec).expanduser()
    if path.exists():
        shape = pm.model_from_config(path)
        if "/" in shape.name and not Path(shape.name).is_absolute() and not shape.name.startswith("."):
            source = f"hf://{shape.name}"
        else:
            source = str((path if path.is_dir() else path.parent).resolve())
        return shape, source
    raise KeyError(f"unknown model {spec!r}: not a known name ({', '.join(known)}) nor a config.json")


@dataclass(frozen=True)
class Role:
    """One replica's layout for a role: ``tensor`` GPUs an engine; ``data`` > 1: that many data-parallel
    engines with expert parallel (a mixture-of-experts model's DP attention + EP)."""

    tensor: int
    data: int = 1

    @property
    def gpus(self) -> int:
        return self.tensor * self.data

    def pods(self, gpus_per_node: int) -> int:
        """Whole-node pods of one replica (one pod when it fits a node)."""
        return max(1, -(-self.gpus // gpus_per_node))

    def layout(self, gpus_per_node: int):  # -> disagg.api.parallelism.Layout
        from disagg.api.parallelism import Layout

        return Layout(tensor=self.tensor, data=self.data, expert=self.data > 1, pods=self.pods(gpus_per_node))

    def label(self, gpus_per_node: int) -> str:
        pods = self.pods(gpus_per_node)
        base = f"TP{self.tensor}" if self.data == 1 else f"DP{self.data}xEP{self.gpus}"
        return base if pods == 1 else f"{base}/{pods}pods"


@dataclass(frozen=True)
class Setup:
    """The resolved inputs: model shape, GPU, link and efficiencies, and a perf model per TP size."""

    inputs: Inputs
    shape: pm.ModelShape
    source: str
    hw: pm.GPUSpec
    link: pm.Interconnect
    eff: pm.Efficiency
    profile: pm.Profile | None = None
    calibration: pm.Calibration | None = None
    notes: tuple[str, ...] = ()
    scales: dict[int, tuple[float, float]] = field(default_factory=dict, compare=False)

    @classmethod
    def of(cls, inputs: Inputs) -> Setup:
        shape, source = resolve_model(inputs.model)
        if inputs.precision == "fp8":
            shape = replace(shape, dtype_bytes=1)
        # a checkpoint released in FP8 (DeepSeek-V3) runs its GEMMs at the FP8 rate whatever --precision says
        hw = pm.gpu(inputs.gpu, "fp8" if shape.dtype_bytes == 1 else inputs.precision)
        link = pm.interconnect(inputs.interconnect)
        if link.name == "nvlink":  # KV moves over this GPU's own NVLink generation
            link = replace(link, bandwidth=hw.nvlink_bandwidth)
        notes = []
        if shape.dtype_bytes == 1 and inputs.precision != "fp8":
            notes.append(f"{shape.name} ships FP8 weights: GEMMs at {hw.name}'s FP8 rate")
        eff = pm.default_efficiency()
        # the planner's and the simulator's choice (perfmodel.planning_calibration): a file given, else the
        # measurements shipped for this GPU at this weight width, else the data sheet
        calibration = pm.planning_calibration(hw, shape.dtype_bytes, inputs.calibration or None)
        if calibration is not None:
            eff = calibration.efficiency(hw, eff)
            shipped = "" if inputs.calibration else " (the calibration shipped for this GPU)"
            notes.append(f"calibrated on {calibration.device or calibration.gpu} at {calibration.measured_at}"
                         f"{shipped}: prefill MFU {eff.prefill_mfu:.2f}, decode MBU {eff.decode_mbu:.2f}")
        profile = None
        if inputs.profile:
            profile = _load_profile(inputs.profile)
            if profile.gpu not in ("", "unknown"):
                try:
                    same = pm.gpu(profile.gpu).name == hw.name
                except KeyError:
                    same = False
                if not same:
                    raise ValueError(f"profile was measured on {profile.gpu}, not {hw.name}")
            if profile.model.lower().split("/")[-1] != shape.name.lower().split("/")[-1]:
                notes.append(f"profile is for model {profile.model!r}; planning {shape.name} with it")
            notes.append(f"measured profile at TP {profile.tensor_parallel_size} replaces the analytic estimate; "
                         "other TP sizes are scaled by its ratio to the analytic one")
        setup = cls(inputs, shape, source, hw, link, eff, profile, calibration, tuple(notes))
        return setup

    def model(self, tp: int) -> pm.PerfModel:
        base = pm.PerfModel(self.shape, self.hw, tp, self.link, self.eff, calibration=self.calibration)
        p = self.profile
        if p is None:
            return base
        if tp == p.tensor_parallel_size:
            return replace(base, profile=p)
        if tp not in self.scales:  # measured / analytic at the profile's TP, applied to this TP
            at = pm.PerfModel(self.shape, self.hw, p.tensor_parallel_size, self.link, self.eff,
                              calibration=self.calibration)
            measured = replace(at, profile=p)
            isl, ctx = self.inputs.isl, self.inputs.isl + self.inputs.osl / 2
            self.scales[tp] = (measured.ttft(isl) / at.ttft(isl), measured.itl(16, ctx) / at.itl(16, ctx))
        ps, ds = self.scales[tp]
        return base.corrected(ps, ds)

    def engine(self, role: Role) -> pm.PerfModel:
        """The performance model of one replica of ``role``: one engine of its tensor size, or a
        data-parallel, expert-parallel replica (:class:`disagg.perf.parallel.DataParallelEngine`) on this
        fabric: ``gpus_per_node`` GPUs a node (a pod), NVLink across ``domain`` GPUs, the network between
        (the KV link when it is one, else InfiniBand NDR)."""
        if role.data == 1:
            return self.model(role.tensor)
        from disagg.perf import parallel

        net = self.link if self.link.name != "nvlink" else pm.interconnect("infiniband-ndr")
        fabric = parallel.Fabric(self.inputs.gpus_per_node, self.inputs.domain, net)
        base = self.model(role.tensor)
        fields = {f: getattr(base, f) for f in ("shape", "hw", "tp", "link", "eff", "calibration")}
        return parallel.DataParallelEngine(**fields, layout=role.layout(self.inputs.gpus_per_node), fabric=fabric,
                                           attention_flops=pm.gpu(self.inputs.gpu).flops)

    def data_sizes(self) -> list[int]:
        """Data-parallel ranks (tensor 1 each, experts spread over all of them) of a mixture-of-experts
        replica: within one node or whole nodes of it (each pod a node's GPUs, whole DP ranks each: what
        admission takes), within the budget, leaving KV room on a rank for one full request. Empty for a
        dense model."""
        i = self.inputs
        if not self.shape.moe:
            return []
        need = i.isl + i.osl
        node = i.gpus_per_node
        out = []
        nvlink_kv = self.link.name == "nvlink"   # KV over NVLink: both roles' replicas inside one domain
        for d in DATA_SIZES:
            if d > min(i.gpus, i.max_data) or (d > node and d % node) or (nvlink_kv and d > i.domain):
                continue
            m = self.engine(Role(1, d))
            if m.kv_capacity_tokens() / d >= need:
                out.append(d)
        return out

    def roles(self) -> list[Role]:
        """Every replica layout searched for a role: tensor parallel inside one NVLink domain
        (:meth:`tp_sizes`), and for a mixture-of-experts model DP attention + EP (:meth:`data_sizes`)."""
        return [Role(tp) for tp in self.tp_sizes()] + [Role(1, d) for d in self.data_sizes()]

    def tp_sizes(self) -> list[int]:
        """TP sizes whose shards divide the heads, stay inside one NVLink domain (a TP wider than a node spans
        whole-node pods: ``podsPerReplica``), and leave KV room for one full request."""
        out = []
        need = self.inputs.isl + self.inputs.osl
        node = self.inputs.gpus_per_node
        for tp in TP_SIZES:
            if tp > min(self.inputs.max_tp, self.inputs.gpus, self.inputs.domain) or self.shape.heads % tp:
                continue
            if tp > node and tp % node:
                continue
            if self.model(tp).kv_capacity_tokens() >= need:
                out.append(tp)
        return out


def _load_profile(path: str) -> pm.Profile:
    import yaml

    text = Path(path).read_text()
    doc = yaml.safe_load(text)
    if isinstance(doc, dict) and doc.get("kind") == "ConfigMap":  # `disagg profile --configmap` output
        doc = yaml.safe_load(doc["data"][pm.PROFILE_KEY])
    return pm.Profile.from_dict(doc)


# ---------------------------------------------------------------- one layout

@dataclass(frozen=True)
class Estimate:
    mode: str                     # "aggregated" | "disaggregated"
    prefill_tp: int               # 0 for aggregated
    prefill_workers: int          # per unit (0 for aggregated)
    decode_tp: int                # the worker's TP for aggregated
    decode_workers: int           # per unit
    replicas: int                 # units deployed to fill the budget
    batch: int                    # requests per decode (or aggregated) worker
    tokens_per_s_per_gpu: float   # output tokens
    tokens_per_s_per_user: float  # 1 / mean ITL
    ttft_s: float                 # at the SLO percentile
    itl_s: float                  # at the SLO percentile
    itl_mean_s: float
    request_rate: float           # requests/s the deployment (all replicas) carries
    prefill_utilization: float    # busy share of a prefill worker (of the chunk budget, aggregated)
    kv_transfer_s: float
    prefill_flops_per_gpu: float  # achieved FLOP/s on a GPU that prefills
    decode_bytes_per_gpu: float   # achieved HBM bytes/s on a GPU that decodes
    chunk_tokens: int = 0         # aggregated: prefill chunk budget a step (--max-num-batched-tokens)
    meets_slo: bool = False
    gpus_per_node: int = 8        # a replica wider than this spans whole-node pods (tensor parallel across them)
    prefill_data: int = 1         # data-parallel ranks (expert parallel over them) of a prefill replica
    decode_data: int = 1          # ... of a decode (or aggregated) replica; ``batch`` counts all its ranks'

    @property
    def prefill_role(self) -> Role:
        return Role(self.prefill_tp, self.prefill_data)

    @property
    def decode_role(self) -> Role:
        return Role(self.decode_tp, self.decode_data)

    def pods(self, tp: int, data: int = 1) -> int:
        """Pods of one replica of TP ``tp`` x ``data`` ranks: one, or whole nodes of ``gpus_per_node`` GPUs."""
        return Role(tp, data).pods(self.gpus_per_node) if tp else 0

    @property
    def prefill_pods(self) -> int:
        return self.pods(self.prefill_tp, self.prefill_data)

    @property
    def decode_pods(self) -> int:
        return self.pods(self.decode_tp, self.decode_data)

    @property
    def prefill_gpus(self) -> int:
        """GPUs of one prefill replica."""
        return self.prefill_tp * self.prefill_data

    @property
    def decode_gpus(self) -> int:
        return self.decode_tp * self.decode_data

    @property
    def expert_parallel(self) -> bool:
        return max(self.prefill_data, self.decode_data) > 1

    @property
    def unit_gpus(self) -> int:
        return self.prefill_gpus * self.prefill_workers + self.decode_gpus * self.decode_workers

    @property
    def gpus(self) -> int:
        return self.unit_gpus * self.replicas

    @property
    def layout(self) -> str:
        node = self.gpus_per_node
        if self.mode == "aggregated":
            return (f"{self.decode_workers * self.replicas}x {self.decode_role.label(node)} "
                    f"chunk {self.chunk_tokens}")
        unit = (f"{self.prefill_workers}P({self.prefill_role.label(node)})+"
                f"{self.decode_workers}D({self.decode_role.label(node)})")
        return unit if self.replicas == 1 else f"{self.replicas}x {unit}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(layout=self.layout, gpus=self.gpus, unit_gpus=self.unit_gpus, prefill_pods=self.prefill_pods,
                 decode_pods=self.decode_pods, expert_parallel=self.expert_parallel)
        return d


def _decode_bytes(model: pm.PerfModel, concurrency: float, context_total: float) -> float:
    return model.shape.weight_bytes + model.shape.kv_bytes_per_token * context_total


def aggregated(setup: Setup, tp: int, batch: int, chunk: int | None = None) -> Estimate | None:
    """One aggregated worker of TP ``tp`` running ``batch`` requests with a prefill chunk budget of ``chunk``
    tokens a step (vLLM's --max-num-batched-tokens; None when it cannot serve them).

    Steps are of two kinds: decode only, and decode plus one prompt's chunk (``k = ceil(new / chunk)``
    chunks a prompt). A share ``f = batch x k / OSL`` of steps carries a chunk; each decoding request gets
    one token a step, so the per-token ITL at the percentile is the chunked step's when ``f`` exceeds the
    percentile's tail, else the decode step's: the prefill-decode interference disaggregation removes.
    """
    i = setup.inputs
    m = setup.model(tp)
    chunk = chunk or i.max_batched_tokens
    cap = min(m.max_concurrency(i.isl + i.osl), i.max_batch)
    if batch > cap or chunk <= batch:
        return None
    new, cached = i.isl * (1 - i.prefix_reuse), i.isl * i.prefix_reuse
    ctx = i.isl + i.osl / 2.0
    k = max(1, math.ceil(new / (chunk - batch)))
    piece = [(new, cached)]
    tail = 1.0 - i.percentile / 100.0

    def steps(b: float) -> tuple[float, float, float, float]:
        f = b * k / i.osl
        t_d = m.decode_step_time(b, b * ctx)
        t_mix = m.mixed_step_time(b, b * ctx, piece, 1.0 / k)
        return f, t_d, t_mix, (1 - min(f, 1.0)) * t_d + min(f, 1.0) * t_mix

    f, t_d, t_mix, mean = steps(batch)
    if f >= 1.0:                               # the chunk budget cannot keep the batch full
        return None
    b_p = serving.batch_at_percentile(batch, i.percentile, cap)
    f_p, t_d_p, t_mix_p, _ = steps(b_p)
    itl_p = t_mix_p if f_p > tail else t_d_p
    rate_w = batch / (i.osl * mean)
    service = k * t_mix
    wait = queue_wait(rate_w, service, i.percentile)
    ttft = i.percentile / 100.0 * t_d + wait + service
    workers = i.gpus // tp
    fm, rm = m.mixed_step_work(batch, batch * ctx, piece, 1.0 / k)
    fd, rd = m.mixed_step_work(batch, batch * ctx, (), 1.0)
    flops, reads = (1 - f) * fd + f * fm, (1 - f) * rd + f * rm   # per step, on average
    return Estimate("aggregated", 0, 0, tp, 1, workers, batch,
                    tokens_per_s_per_gpu=batch / mean / tp, tokens_per_s_per_user=1.0 / mean,
                    ttft_s=ttft, itl_s=itl_p, itl_mean_s=mean, request_rate=rate_w * workers,
                    prefill_utilization=rate_w * service, kv_transfer_s=0.0,
                    prefill_flops_per_gpu=flops / mean / tp, decode_bytes_per_gpu=reads / mean / tp,
                    chunk_tokens=chunk, gpus_per_node=i.gpus_per_node)


def _as_role(r: int | Role) -> Role:
    return r if isinstance(r, Role) else Role(r)


@dataclass(frozen=True)
class _Prefill:
    tp: int
    service: float        # seconds to prefill one prompt alone (a data-parallel rank: with every rank as busy)
    transfer: float       # seconds to move its KV cache (set per decode TP)
    flops: float          # FLOPs of one prompt
    data: int = 1         # data-parallel ranks of the replica: prompts it prefills side by side

    @property
    def gpus(self) -> int:
        return self.tp * self.data

    @property
    def role(self) -> Role:
        return Role(self.tp, self.data)


def disaggregated_ttft(setup: Setup, pre: _Prefill, workers: int, rate: float, first_step: float) -> float:
    """TTFT at the SLO percentile: wait for one of the unit's prefill workers (the router hands a prompt to
    whichever is free: one queue, ``workers`` servers, each data-parallel rank one), prefill, KV transfer,
    first decode step."""
    work = serving.PrefillWork((pre.service,), (pre.transfer,), pre.data)  # one prompt length: no variance
    return serving.prefill_ttft(work, rate, workers, setup.inputs.percentile, first_step)


def disaggregated(setup: Setup, prefill_tp: int | Role, prefill_workers: int, decode_tp: int | Role,
                  decode_workers: int, batch: int) -> Estimate | None:
    """One xPyD unit with ``batch`` requests per decode worker (None when it cannot serve them)."""
    pre = _prefill(setup, prefill_tp, decode_tp)
    dec = _decode(setup, decode_tp, batch)
    if pre is None or dec is None:
        return None
    return _disagg_estimate(setup, pre, decode_tp, dec, prefill_workers, decode_workers, batch)


def _prefill(setup: Setup, tp: int | Role, decode_tp: int | Role) -> _Prefill | None:
    i = setup.inputs
    role, dec = _as_role(tp), _as_role(decode_tp)
    m = setup.engine(role)
    if m.kv_capacity_tokens() / role.data < i.isl:
        return None
    new, cached = i.isl * (1 - i.prefix_reuse), i.isl * i.prefix_reuse
    return _Prefill(role.tensor, m.ttft(i.isl, cached), serving.kv_transfer_time(m, i.isl, dec.tensor),
                    m.prefill_flops(new, cached), role.data)


def _decode(setup: Setup, tp: int | Role, batch: int) -> tuple[float, float, float] | None:
    """(mean ITL, ITL at the percentile, HBM bytes per GPU a step) of a decode worker at ``batch`` (all
    its ranks' requests: a data-parallel replica runs at most ``max_batch`` on each rank)."""
    i = setup.inputs
    role = _as_role(tp)
    m = setup.engine(role)
    cap = min(m.max_concurrency(i.isl + i.osl), i.max_batch * role.data)
    if batch > cap:
        return None
    ctx = i.isl + i.osl / 2.0
    b_p = serving.batch_at_percentile(batch, i.percentile, cap)
    if role.data > 1:
        weights = m.replica.weight_bytes_per_gpu() * role.gpus
    else:
        weights = m.shape.weight_bytes
    reads = (weights + m.shape.kv_bytes_per_token * batch * ctx) / role.gpus
    return m.itl(batch, ctx), m.itl(b_p, ctx), reads


def _disagg_estimate(setup: Setup, pre: _Prefill, decode_tp: int | Role, dec: tuple[float, float, float], x: int,
                     y: int, batch: int) -> Estimate | None:
    i = setup.inputs
    d = _as_role(decode_tp)
    itl, itl_p, reads = dec
    rate = y * batch / (i.osl * itl)
    util = rate / (x * pre.data) * pre.service
    if util >= serving.PREFILL_MAX_UTILIZATION:
        return None
    ttft = disaggregated_ttft(setup, pre, x, rate, itl)
    unit = x * pre.gpus + y * d.gpus
    if unit > i.gpus:
        return None
    k = i.gpus // unit
    return Estimate("disaggregated", pre.tp, x, d.tensor, y, k, batch,
                    tokens_per_s_per_gpu=y * batch / itl / unit, tokens_per_s_per_user=1.0 / itl,
                    ttft_s=ttft, itl_s=itl_p, itl_mean_s=itl, request_rate=rate * k,
                    prefill_utilization=util, kv_transfer_s=pre.transfer,
                    prefill_flops_per_gpu=rate / x * pre.flops / pre.gpus, decode_bytes_per_gpu=reads / itl,
                    gpus_per_node=i.gpus_per_node, prefill_data=pre.data, decode_data=d.data)


def least_prefill(setup: Setup, pre: _Prefill, decode_tp: int | Role, dec: tuple[float, float, float], y: int,
                  batch: int) -> Estimate | None:
    """The xPyD point with the fewest prefill workers whose TTFT meets the target (None if none fits)."""
    i = setup.inputs
    d = _as_role(decode_tp)
    itl, _, _ = dec
    rate = y * batch / (i.osl * itl)
    room = (i.gpus - y * d.gpus) // pre.gpus
    cap = serving.PREFILL_MAX_UTILIZATION
    lo = max(1, math.ceil(rate * pre.service / (cap * pre.data) - 1e-12))
    if lo > room:
        return None
    target = i.ttft_ms / 1000.0

    def ok(x: int) -> bool:
        return rate / (x * pre.data) * pre.service < cap and disaggregated_ttft(setup, pre, x, rate, itl) <= target

    if not ok(room):
        return None
    hi = room
    while lo < hi:  # TTFT falls as prefill workers are added: binary search
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return _disagg_estimate(setup, pre, d, dec, lo, y, batch)


# ---------------------------------------------------------------- enumeration and frontier

def _batches(limit: int) -> list[int]:
    return [b for b in BATCHES if b <= limit]


def enumerate_aggregated(setup: Setup) -> list[Estimate]:
    i = setup.inputs
    new = i.isl * (1 - i.prefix_reuse)
    out = []
    for tp in setup.tp_sizes():
        for b in _batches(i.max_batch):
            # budgets below the limit, up to the first that takes a whole prompt and the batch in one step
            chunks = [c for c in CHUNKS if c < i.max_batched_tokens]
            chunks = [c for c in chunks if c < new + b] + [c for c in chunks if c >= new + b][:1]
            for c in sorted(set(chunks + [i.max_batched_tokens])):
                e = aggregated(setup, tp, b, c)
                if e is not None:
                    out.append(e)
    return out


def enumerate_disaggregated(setup: Setup) -> list[Estimate]:
    """Every xPyD unit within the budget (least prefill workers meeting TTFT for each decode side), over
    every replica layout of each role (:meth:`Setup.roles`: TP, and DP + EP for a mixture-of-experts
    model; a data-parallel decode's batch is ``max_batch`` or fewer requests on each rank)."""
    i = setup.inputs
    roles = setup.roles()
    out = []
    for rd in roles:
        batches = sorted({b * rd.data for b in _batches(i.max_batch)})
        decs = {b: _decode(setup, rd, b) for b in batches}
        for rp in roles:
            if rp.gpus + rd.gpus > i.gpus:
                continue
            pre = _prefill(setup, rp, rd)
            if pre is None:
                continue
            for y in range(1, (i.gpus - rp.gpus) // rd.gpus + 1):
                for b, dec in decs.items():
                    if dec is None:
                        continue
                    e = least_prefill(setup, pre, rd, dec, y, b)
                    if e is not None:
                        out.append(e)
    return out


def meets(e: Estimate, inputs: Inputs) -> bool:
    return e.ttft_s <= inputs.ttft_ms / 1000.0 + 1e-12 and e.itl_s <= inputs.itl_ms / 1000.0 + 1e-12


def pareto(points: Iterable[Estimate]) -> list[Estimate]:
    """Points no other point beats on both tokens/s/GPU and tokens/s/user, by tokens/s/user ascending."""
    pts = sorted(points, key=lambda e: (-e.tokens_per_s_per_user, -e.tokens_per_s_per_gpu, e.gpus))
    front, best = [], -math.inf
    for e in pts:
        if e.tokens_per_s_per_gpu > best * (1 + 1e-9):
            front.append(e)
            best = e.tokens_per_s_per_gpu
    return front[::-1]


def frontier(points: Iterable[Estimate]) -> list[Estimate]:
    """The Pareto front with meeting the SLO as a third objective: the points meeting it that no other
    meeting point beats, and the points missing it that no point at all beats; by tokens/s/user.

    Tokens/s/user is 1 / mean ITL while the SLO holds ITL at a percentile, so a layout with long
    chunked-prefill steps can beat one that meets the SLO on both axes and still miss it. A plain
    Pareto front would hide the layout that meets it (and pick a worse best)."""
    pts = list(points)
    meeting = pareto(e for e in pts if e.meets_slo)
    missing = [e for e in pareto(pts) if not e.meets_slo]
    return sorted(meeting + missing, key=lambda e: (e.tokens_per_s_per_user, -e.tokens_per_s_per_gpu))


def frontier_value(front: list[Estimate], user_speed: float) -> float:
    """Most tokens/s/GPU the frontier offers at ``user_speed`` tokens/s/user or faster (0 if none)."""
    return max((e.tokens_per_s_per_gpu for e in front if e.tokens_per_s_per_user >= user_speed * (1 - 1e-9)),
               default=0.0)


@dataclass
class Result:
    setup: Setup
    aggregated: list[Estimate]        # frontier() of the layouts meeting TTFT, by tokens/s/user ascending
    disaggregated: list[Estimate]
    best: Estimate | None             # most tokens/s/GPU meeting both SLOs
    best_aggregated: Estimate | None
    best_disaggregated: Estimate | None
    evaluated: int = 0

    @property
    def inputs(self) -> Inputs:
        return self.setup.inputs

    def gain_at(self, user_speed: float) -> float | None:
        """Disaggregated over aggregated tokens/s/GPU at ``user_speed`` tokens/s/user (None: agg has none)."""
        a = frontier_value(self.aggregated, user_speed)
        d = frontier_value(self.disaggregated, user_speed)
        return d / a if a > 0 else None

    def summary(self) -> dict[str, Any]:
        i = self.inputs
        speed = 1000.0 / i.itl_ms
        return {"model": self.setup.shape.name, "gpu": self.setup.hw.name, "gpus": i.gpus,
                "interconnect": self.setup.link.name, "isl": i.isl, "osl": i.osl, "prefix_reuse": i.prefix_reuse,
                "precision": i.precision, "ttft_ms": i.ttft_ms, "itl_ms": i.itl_ms, "percentile": i.percentile,
                "best": self.best.to_dict() if self.best else None,
                "best_aggregated": self.best_aggregated.to_dict() if self.best_aggregated else None,
                "best_disaggregated": self.best_disaggregated.to_dict() if self.best_disaggregated else None,
                "gain_at_slo_user_speed": self.gain_at(speed), "slo_user_speed": speed,
                "notes": list(self.setup.notes), "evaluated": self.evaluated}


def configure(inputs: Inputs) -> Result:
    """The whole search: one code path for the CLI and the web page."""
    setup = Setup.of(inputs)
    pipeline = pipeline_note(setup)
    if pipeline:
        setup = replace(setup, notes=setup.notes + (pipeline,))
    expert = expert_note(setup)
    if expert:
        setup = replace(setup, notes=setup.notes + (expert,))
    if not setup.roles():
        moe = (f" nor as {inputs.max_data} or fewer data-parallel expert-parallel ranks" if setup.shape.moe else "")
        raise ValueError(f"{setup.shape.name} does not fit {inputs.gpus} x {setup.hw.name} at TP <= "
                         f"{min(inputs.max_tp, inputs.domain)} (NVLink domains of {inputs.domain} GPUs){moe} with room "
                         f"for one {inputs.isl + inputs.osl}-token request" + (f"; {pipeline}" if pipeline else ""))
    ttft = inputs.ttft_ms / 1000.0
    agg_all = enumerate_aggregated(setup)
    dis_all = enumerate_disaggregated(setup)
    fronts = []
    for pts in (agg_all, dis_all):
        ok_ttft = [e for e in pts if e.ttft_s <= ttft + 1e-12]
        fronts.append(frontier(replace(e, meets_slo=meets(e, inputs)) for e in ok_ttft))

    def best(front: list[Estimate]) -> Estimate | None:
        ok = [e for e in front if e.meets_slo]
        return max(ok, key=lambda e: (e.tokens_per_s_per_gpu, e.tokens_per_s_per_user), default=None)

    ba, bd = best(fronts[0]), best(fronts[1])
    overall = max((e for e in (ba, bd) if e is not None),
                  key=lambda e: (e.tokens_per_s_per_gpu, e.tokens_per_s_per_user), default=None)
    return Result(setup, fronts[0], fronts[1], overall, ba, bd, len(agg_all) + len(dis_all))


def expert_note(setup: Setup) -> str | None:
    """For a mixture-of-experts model: which data-parallel expert-parallel layouts were searched and what
    they assume (disagg.perf.parallel's terms); None for a dense model."""
    sizes = setup.data_sizes()
    if not setup.shape.moe:
        return None
    i = setup.inputs
    if not sizes:
        return (f"{setup.shape.name} is a mixture of experts, but no data-parallel expert-parallel replica of at "
                f"most {min(i.gpus, i.max_data)} GPUs leaves a rank KV room for one request")
    return (f"{setup.shape.name} is a mixture of experts: DP attention + expert parallel replicas of "
            f"{', '.join(map(str, sizes))} GPUs searched (tensor 1 a rank, whole-node pods of {i.gpus_per_node}; "
            f"all-to-all over NVLink inside {i.domain}-GPU domains, the network beyond; DeepEP-style FP8 dispatch, "
            "two overlapped micro-batches, expert skew 1.10: disagg.perf.parallel); aggregated layouts are dense "
            "TP only")


def pipeline_note(setup: Setup) -> str | None:
    """Where a replica must be wider than one NVLink domain (the weights and one request's KV do not fit
    the largest TP inside it): the layout that would serve it, pipeline stages over domains (DistServe's
    low node-affinity placement when nodes have few GPUs: each stage's prefill and decode segments share
    a node, KV moves over NVLink), priced by the performance model, and why it is not emitted. None when
    a TP layout inside one domain fits."""
    from disagg.api.parallelism import Layout
    from disagg.perf import parallel

    i = setup.inputs
    if setup.tp_sizes() or setup.data_sizes():
        return None
    need = setup.shape.weight_bytes + setup.shape.kv_bytes_per_token * (i.isl + i.osl)
    per_gpu = setup.hw.memory_bytes * setup.eff.memory_utilization
    tp = max((t for t in TP_SIZES if t <= min(i.domain, i.max_tp) and setup.shape.heads % t == 0), default=1)
    stages = max(2, math.ceil(need / (per_gpu * tp)))
    if tp * stages > i.gpus:
        return (f"{setup.shape.name} needs {stages} pipeline stages of TP {tp} ({tp * stages} GPUs), more than "
                f"the budget of {i.gpus}")
    lay = Layout(tensor=tp, pipeline=stages, pods=max(1, tp * stages // i.gpus_per_node))
    fabric = parallel.Fabric(i.gpus_per_node, i.domain, pm.interconnect("infiniband-ndr"))
    r = parallel.ReplicaModel(setup.model(tp), lay, fabric)
    ttft = r.prefill_time([(float(i.isl), 0.0)])
    itl1, bubble = r.pipeline_decode_step(1, i.isl + i.osl / 2)
    itl = r.itl(stages * 8, i.isl + i.osl / 2)
    return (f"needs pipeline parallel, refused by this vLLM (README, 'Why no pipeline parallel'): "
            f"{setup.shape.name} fits no TP inside an NVLink domain of {i.domain} GPUs; "
            f"{stages} stages of TP {tp} over {lay.pods} pods (DistServe's low node-affinity placement) would "
            f"prefill {i.isl} tokens in {ttft * 1000:.0f} ms and decode at {itl1 * 1000:.1f} ms a token alone "
            f"(pipeline bubble {bubble:.0%}), {itl * 1000:.1f} ms at {stages * 8} requests; not emitted")
