"""The performance model: how long prefill, decode steps and KV transfers take.

One module, shared by the planner, the simulator and the configurator (what these latencies mean under
load, queueing and batching, is :mod:`.serving`, shared by the same three). Sources, in order of preference:

1. a measured :class:`Profile` (``disagg profile`` writes one) fitted by least squares;
2. the analytic default from the model's shape and the GPU's data sheet
   (``data/models.yaml``, ``data/gpus.yaml``): prefill is compute-bound
   (FLOPs / (TP x peak FLOP/s x MFU)), a decode step is bandwidth-bound
   (weights + KV cache read / (TP x HBM bandwidth x MBU));
3. online correction: scale factors learnt from observed versus predicted latency
   (:class:`OnlineCorrection`).

A :class:`Calibration` (kernel timings measured on a real GPU) replaces the data-sheet efficiencies of
the analytic default for that GPU, and its GEMM and all-reduce timings give :meth:`PerfModel.gemm_time`
and :meth:`PerfModel.allreduce_time`. One ships for the H100 (``data/calibration/``, from Vidur's public
H100 profiling, see :mod:`.measured`) and is used by default: :func:`planning_calibration` is the one place
that picks it, for :meth:`PerfModel.analytic` (the planner and the simulator) and the configurator (a file of
one's own, ``bench/gpu_kernels_calibrate.py`` writes one, takes precedence; ``measured=False`` keeps the data
sheet, for comparisons). GPUs without measurements, and weights of another width than the one measured
(FP8), keep the data sheet.
Tensor-parallel all-reduces (:meth:`PerfModel.tp_comm_time`) are in every step of a TP > 1 replica
(``tp_comm=False`` leaves them out, for comparisons only). Those up to :data:`CUSTOM_ALLREDUCE_MAX_BYTES`
are vLLM's custom all-reduce (the data sheet's latency plus the bytes over NVLink), not the NCCL ones the
calibration measured (a ~30-40 us floor); larger ones are NCCL's, measured where a calibration has them.

Whatever the source, no estimate is faster than physics allows: prefill never
exceeds TP x peak FLOP/s and a decode step never reads faster than TP x HBM
bandwidth (the *physical floor*, applied last).
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

import yaml

DATA = Path(__file__).resolve().parent / "data"
PROFILE_KEY = "profile.yaml"  # key of a profile in its ConfigMap (spec.planner.profileRef)


# ---------------------------------------------------------------- specs

@dataclass(frozen=True)
class GPUSpec:
    name: str
    flops: float              # dense 16-bit tensor FLOP/s
    hbm_bandwidth: float      # bytes/s
    memory_bytes: float
    nvlink_bandwidth: float   # bytes/s per direction


@dataclass(frozen=True)
class ModelShape:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    params: float
    dtype_bytes: int = 2
    attention_head_dim: int = 0   # config.json head_dim when it is not hidden / heads (Qwen3); 0: hidden / heads
    # mixture of experts (0: a dense model): routed experts, how many each token uses, each expert's FFN width,
    # shared experts every token uses, the first layers that are dense instead (DeepSeek's first_k_dense_replace)
    experts: int = 0
    experts_active: int = 0
    expert_intermediate: int = 0
    shared_experts: int = 0
    dense_layers: int = 0
    active_params: float = 0.0    # parameters one token uses (MoE); 0: all of them
    kv_latent: int = 0            # MLA: the cached width per layer and token (kv_lora_rank + rope dim); 0: K and V heads
    kv_dtype_bytes: int = 0       # KV cache element width when it differs from the weights' (FP8 weights, BF16 KV)

    @property
    def moe(self) -> bool:
        return self.experts > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.dense_layers if self.moe else 0

    @property
    def expert_params(self) -> float:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3.0 * self.hidden * self.expert_intermediate

    @property
    def routed_params(self) -> float:
        """Parameters of every routed expert of every MoE layer (what expert parallel spreads over GPUs)."""
        return self.moe_layers * self.experts * self.expert_params

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        """Width of the attention's queries (heads x head_dim; the hidden size for most models)."""
        return self.heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head (MLA: the latent, every layer)."""
        width = self.kv_latent or 2 * self.kv_heads * self.head_dim
        return self.layers * width * (self.kv_dtype_bytes or self.dtype_bytes)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def matmul_flops_per_token(self) -> float:
        """2 FLOPs per weight per token, less the embedding lookup (no FLOPs); a MoE token only through its
        active parameters."""
        used = self.active_params or self.params
        return 2.0 * max(used - self.vocab * self.hidden, used / 2)

    def layer_gemms(self, tp: int = 1) -> list[tuple[str, int, int]]:
        """``(op, k, n)`` of one layer's GEMMs on one TP rank: column-parallel QKV and gate+up,
        row-parallel output projection and down (``m`` is the number of tokens)."""
        hd, kv = self.head_dim, max(self.kv_heads // tp, 1)
        return [("qkv", self.hidden, (self.heads // tp + 2 * kv) * hd),
                ("o", self.heads // tp * hd, self.hidden),
                ("gate_up", self.hidden, 2 * self.intermediate // tp),
                ("down", self.intermediate // tp, self.hidden)]

    def attention_flops(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """QK^T and AV for ``new_tokens`` attending causally to ``cached + earlier new`` tokens."""
        return 4.0 * self.layers * self.q_dim * new_tokens * (cached_tokens + (new_tokens + 1) / 2.0)


@dataclass(frozen=True)
class Interconnect:
    name: str
    bandwidth: float           # bytes/s per direction, per GPU link
    latency_seconds: float
    efficiency: float = 0.8


@dataclass(frozen=True)
class Efficiency:
    prefill_mfu: float = 0.5
    decode_mbu: float = 0.7
    step_overhead_seconds: float = 0.003
    memory_utilization: float = 0.9
    tp_allreduce_latency_seconds: float = 8e-6   # one small all-reduce across a TP group (custom all-reduce)


@cache
def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DATA / name).read_text())


def _resolve(kind: str, specs: dict[str, Any], name: str) -> str:
    """A data-file key from its exact name, any case, or one of its ``aliases``."""
    if name in specs:
        return name
    low = name.lower()
    for key, s in specs.items():
        if key.lower() == low or low in (str(a).lower() for a in s.get("aliases", ())):
            return key
    known = sorted(set(specs) | {str(a) for s in specs.values() for a in s.get("aliases", ())})
    raise KeyError(f"unknown {kind} {name!r}; known: {', '.join(known)}")


def gpu(name: str, precision: str = "bf16") -> GPUSpec:
    """A GPU by name or alias (``h200`` is ``H200-SXM``); ``precision="fp8"`` plans with its FP8 tensor rate."""
    specs = _load("gpus.yaml")["gpus"]
    key = _resolve("GPU", specs, name)
    s = specs[key]
    if precision not in ("bf16", "fp8"):
        raise ValueError(f"unknown precision {precision!r}; known: bf16, fp8")
    return GPUSpec(key, float(s[f"flops_{precision}"]), float(s["hbm_bandwidth"]), float(s["memory_bytes"]),
                   float(s["nvlink_bandwidth"]))


def model(name: str) -> ModelShape:
    specs = _load("models.yaml")["models"]
    if name not in specs:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(specs))}")
    s = specs[name]
    return ModelShape(name, int(s["layers"]), int(s["hidden"]), int(s["heads"]), int(s["kv_heads"]),
                      int(s["intermediate"]), int(s["vocab"]), float(s["params"]), int(s.get("dtype_bytes", 2)),
                      int(s.get("head_dim", 0)), experts=int(s.get("experts", 0)),
                      experts_active=int(s.get("experts_active", 0)),
                      expert_intermediate=int(s.get("expert_intermediate", 0)),
                      shared_experts=int(s.get("shared_experts", 0)), dense_layers=int(s.get("dense_layers", 0)),
                      active_params=float(s.get("active_params", 0.0)), kv_latent=int(s.get("kv_latent", 0)),
                      kv_dtype_bytes=int(s.get("kv_dtype_bytes", 0)))


_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "fp8": 1}


def model_from_config(config: str | Path | dict[str, Any], name: str | None = None) -> ModelShape:
    """A model's shape from its Hugging Face ``config.json`` (a path, its directory or the parsed dict).

    The parameter count is computed from the shape (embeddings, attention, gated MLP, the LM head unless
    tied), as config.json does not carry it. Multimodal configs are read from their ``text_config``.
    """
    if not isinstance(config, dict):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        config = json.loads(path.read_text())
        name = name or config.get("_name_or_path") or path.parent.name
    c = config.get("text_config", config)
    hidden, layers, heads = int(c["hidden_size"]), int(c["num_hidden_layers"]), int(c["num_attention_heads"])
    kv_heads = int(c.get("num_key_value_heads") or heads)
    head_dim = int(c.get("head_dim") or hidden // heads)
    inter, vocab = int(c["intermediate_size"]), int(c["vocab_size"])
    per_layer = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2 + 3 * hidden * inter
    embed = vocab * hidden * (1 if c.get("tie_word_embeddings", config.get("tie_word_embeddings")) else 2)
    dtype = _DTYPE_BYTES.get(str(c.get("torch_dtype") or c.get("dtype") or config.get("torch_dtype")
                                 or config.get("dtype") or "bfloat16"), 2)
    return ModelShape(name or str(c.get("model_type", "model")), layers, hidden, heads, kv_heads, inter, vocab,
                      float(layers * per_layer + embed), dtype,
                      head_dim if head_dim != hidden // heads else 0)


def interconnect(name: str) -> Interconnect:
    """An interconnect by name or alias (``infiniband`` is ``infiniband-ndr``)."""
    specs = _load("gpus.yaml")["interconnects"]
    key = _resolve("interconnect", specs, name)
    s = specs[key]
    return Interconnect(key, float(s["bandwidth"]), float(s["latency_seconds"]), float(s["efficiency"]))


def default_efficiency() -> Efficiency:
    s = _load("gpus.yaml")["efficiency"]
    return Efficiency(float(s["prefill_mfu"]), float(s["decode_mbu"]), float(s["step_overhead_seconds"]),
                      float(s["memory_utilization"]),
                      float(s.get("tp_allreduce_latency_seconds", Efficiency.tp_allreduce_latency_seconds)))


def known_gpus() -> list[str]:
    return sorted(_load("gpus.yaml")["gpus"])


def known_models() -> list[str]:
    return sorted(_load("models.yaml")["models"])


# ---------------------------------------------------------------- measured profile

def _lstsq_nonneg(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with coefficients clipped at zero and the rest refitted (small active-set loop)."""
    import numpy as np

    a = np.asarray(rows, dtype=float)
    y = np.asarray(ys, dtype=float)
    active = list(range(a.shape[1]))
    coef = np.zeros(a.shape[1])
    for _ in range(a.shape[1]):
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            return [float(c) for c in coef]
        active = [i for i, c in zip(active, sol) if c > 0]
        if not active:
            break
    coef[:] = 0
    if active:
        sol, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        coef[active] = np.clip(sol, 0, None)
    return [float(c) for c in coef]


@dataclass(frozen=True)
class Profile:
    """Latencies measured on a running worker (``disagg profile``), fitted once.

    prefill points: ``{tokens, batch, seconds}`` (``batch`` prompts of ``tokens`` each, no cache);
    decode points: ``{concurrency, context, seconds}`` (one step, every request at ``context`` tokens);
    handoff points (optional): ``{tokens, seconds}``, a lone request's TTFT through the whole P/D path
    (router, prefill, KV pull, decode's first step), measured beside the worker's own points.
    Fit: prefill = a + b*sum(tokens) + c*sum(tokens^2) + d*prompts; decode step = a + b*concurrency +
    c*sum(context). ``d`` (:attr:`prefill_per_prompt`) is what each prompt of a batch costs beyond its tokens
    (the frontend's handling, scheduling, sampling, the answer), fitted only where the points have more than
    one batch size (with one it cannot be told from ``a``): a CPU pair, 2026-12-04, 32 tokens took 13.7 ms
    alone and 27.2 ms three at a time, which a per-token fit charges as 0.5 ms more, so a burst of short
    prompts was predicted at a fraction of its time.
    hand-off = the median, over the points, of what the path took beyond this profile's own prefill and
    first decode step: the router's hops, the KV pull and the frontends between them, which a worker
    measured alone never shows (a CPU pair, 2026-12-02: 119-229 ms through the router against 16 ms of
    engine time). A constant: its length-dependent part, the KV bytes, is the link's
    (:meth:`PerfModel.handoff_time`), and a slope fitted to three lone requests follows their noise (the same
    pair's points at 32/256/768 tokens: 463/530/132 ms in one profile, 968 us/token fitted in the next).
    """

    model: str
    gpu: str
    tensor_parallel_size: int
    prefill: tuple[dict[str, float], ...]
    decode: tuple[dict[str, float], ...]
    handoff: tuple[dict[str, float], ...] = ()
    prefill_coef: tuple[float, float, float] = field(init=False)
    prefill_per_prompt: float = field(init=False)
    decode_coef: tuple[float, float, float] = field(init=False)
    # the P/D hand-off beyond prefill and the first decode step; None when the path was not measured
    handoff_base: float | None = field(init=False)

    def __post_init__(self) -> None:
        if len(self.prefill) < 3 or len(self.decode) < 3:
            raise ValueError("a profile needs at least 3 prefill and 3 decode points")
        per_prompt = len({p["batch"] for p in self.prefill}) > 1
        pc = _lstsq_nonneg([[1.0, p["tokens"] * p["batch"], p["tokens"] ** 2 * p["batch"]]
                            + ([float(p["batch"])] if per_prompt else []) for p in self.prefill],
                           [p["seconds"] for p in self.prefill])
        dc = _lstsq_nonneg([[1.0, d["concurrency"], d["concurrency"] * d["context"]] for d in self.decode],
                           [d["seconds"] for d in self.decode])
        object.__setattr__(self, "prefill_coef", tuple(pc[:3]))
        object.__setattr__(self, "prefill_per_prompt", pc[3] if per_prompt else 0.0)
        object.__setattr__(self, "decode_coef", tuple(dc))
        base = None
        if self.handoff:
            beyond = [h["seconds"] - self.prefill_seconds([h["tokens"]]) - self.decode_seconds(1, h["tokens"])
                      for h in self.handoff]
            base = max(statistics.median(beyond), 0.0)
        object.__setattr__(self, "handoff_base", base)

    def prefill_seconds(self, new_tokens: Sequence[float]) -> float:
        a, b, c = self.prefill_coef
        return (a + b * sum(new_tokens) + c * sum(t * t for t in new_tokens)
                + self.prefill_per_prompt * len(new_tokens))

    def decode_seconds(self, concurrency: float, context_total: float) -> float:
        a, b, c = self.decode_coef
        return a + b * concurrency + c * context_total

    def to_dict(self) -> dict[str, Any]:
        d = {"model": self.model, "gpu": self.gpu, "tensorParallelSize": self.tensor_parallel_size,
             "prefill": list(self.prefill), "decode": list(self.decode)}
        if self.handoff:
            d["handoff"] = list(self.handoff)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        return cls(d["model"], d["gpu"], int(d.get("tensorParallelSize", 1)),
                   tuple(dict(p) for p in d["prefill"]), tuple(dict(p) for p in d["decode"]),
                   tuple(dict(p) for p in d.get("handoff") or ()))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        text = Path(path).read_text()
        return cls.from_dict(json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text))


# ---------------------------------------------------------------- kernel calibration

@dataclass(frozen=True)
class Calibration:
    """Kernel timings on one real GPU (``bench/gpu_kernels_calibrate.py`` writes them), which replace the
    data-sheet efficiencies of the analytic model for that GPU.

    ``gemm`` points: ``{phase, m, k, n, seconds}`` (``m`` tokens through a ``k x n`` weight shard);
    ``attention`` points: ``{phase, batch, q_tokens, context, heads, kv_heads, head_dim, seconds}``.
    Prefill MFU = FLOPs of the prefill kernels / their time / peak FLOP/s; decode MBU = bytes the decode
    kernels must read (weights, KV cache) / their time / peak HBM bandwidth. Both are computed here from the
    raw timings, never trusted from the file, and capped at 1 (physics).
    """

    gpu: str
    device: str
    measured_at: str
    dtype_bytes: int
    gemm: tuple[dict[str, Any], ...]
    attention: tuple[dict[str, Any], ...]
    source: dict[str, Any] = field(default_factory=dict, compare=False)
    allreduce: tuple[dict[str, Any], ...] = ()   # {workers, bytes, seconds}: one all-reduce across the group
    # {crossNode, bytes, seconds}: one send/recv between two GPUs, over NVLink (crossNode false) or the network
    sendrecv: tuple[dict[str, Any], ...] = ()

    # -- per-kernel fits (what PerfModel.gemm_time and allreduce_time use) ----------------------------
    @cached_property
    def gemm_coef(self) -> tuple[float, float, float] | None:
        """``(seconds, seconds per FLOP, seconds per byte)`` of ``t = a + flops*b + bytes*c``, fitted to every
        GEMM point by least squares on the relative error (small kernels count as much as large ones).
        A sum, not the roofline's max: near the ridge both the tensor cores and HBM bound a kernel, and
        the intercept is the few microseconds no kernel goes under. None without GEMM points."""
        pts = [(2.0 * g["m"] * g["k"] * g["n"], (g["k"] * g["n"] + g["m"] * (g["k"] + g["n"])) * self.dtype_bytes,
                float(g["seconds"])) for g in self.gemm if float(g["seconds"]) > 0]
        if len(pts) < 3:
            return None
        a, b, c = _lstsq_nonneg([[1.0 / t, f / t, n / t] for f, n, t in pts], [1.0] * len(pts))
        return a, b, c

    def gemm_seconds(self, m: float, k: float, n: float, hw: GPUSpec) -> float | None:
        """One ``m x k`` by ``k x n`` GEMM, never faster than ``hw``'s peak FLOP/s and HBM bandwidth."""
        coef = self.gemm_coef
        if coef is None or m <= 0:
            return None if coef is None else 0.0
        a, b, c = coef
        flops, nbytes = 2.0 * m * k * n, (k * n + m * (k + n)) * self.dtype_bytes
        return a + flops * max(b, 1.0 / hw.flops) + nbytes * max(c, 1.0 / hw.hbm_bandwidth)

    @cached_property
    def allreduce_coef(self) -> dict[int, tuple[float, float, float]]:
        """Per group size: ``(floor, a, c)`` of ``t = max(floor, a + bytes*c)``: a small all-reduce costs a
        fixed latency (NCCL's, tens of microseconds, whatever the size), a large one a start-up plus its
        bytes over the links. The floor is the median time of the smallest tenth of the messages; ``a`` and
        ``c`` are fitted (least squares on the relative error) to the points at least 1.5x slower."""
        out: dict[int, tuple[float, float, float]] = {}
        for w in sorted({int(p["workers"]) for p in self.allreduce}):
            pts = sorted((float(p["bytes"]), float(p["seconds"])) for p in self.allreduce
                         if int(p["workers"]) == w and float(p["seconds"]) > 0)
            if len(pts) < 3:
                continue
            small = sorted(t for _, t in pts[:max(len(pts) // 10, 1)])
            floor = small[len(small) // 2]
            big = [(x, t) for x, t in pts if t >= 1.5 * floor] or pts[-max(len(pts) // 4, 1):]
            a, c = _lstsq_nonneg([[1.0 / t, x / t] for x, t in big], [1.0] * len(big))
            out[w] = (floor, a, c)
        return out

    @cached_property
    def sendrecv_coef(self) -> dict[bool, tuple[float, float, float]]:
        """Per path (True: between nodes, over the network; False: inside a node, over NVLink):
        ``(floor, a, c)`` of ``t = max(floor, a + bytes*c)``, fitted as :attr:`allreduce_coef`."""
        out: dict[bool, tuple[float, float, float]] = {}
        for cross in (False, True):
            pts = sorted((float(p["bytes"]), float(p["seconds"])) for p in self.sendrecv
                         if bool(p["crossNode"]) == cross and float(p["seconds"]) > 0)
            if len(pts) < 3:
                continue
            small = sorted(t for _, t in pts[:max(len(pts) // 10, 1)])
            floor = small[len(small) // 2]
            big = [(x, t) for x, t in pts if t >= 1.5 * floor] or pts[-max(len(pts) // 4, 1):]
            a, c = _lstsq_nonneg([[1.0 / t, x / t] for x, t in big], [1.0] * len(big))
            out[cross] = (floor, a, c)
        return out

    def sendrecv_seconds(self, nbytes: float, cross_node: bool) -> float | None:
        """One send/recv of ``nbytes`` between two GPUs; None if that path was not measured."""
        coef = self.sendrecv_coef.get(bool(cross_node))
        if coef is None:
            return None
        floor, a, c = coef
        return max(floor, a + nbytes * c) if nbytes > 0 else 0.0

    def allreduce_seconds(self, workers: int, nbytes: float) -> float | None:
        """One all-reduce of ``nbytes`` across ``workers`` GPUs; None if no group of that size was measured."""
        coef = self.allreduce_coef.get(int(workers))
        if coef is None:
            return None
        floor, a, c = coef
        return max(floor, a + nbytes * c) if nbytes > 0 else 0.0

    def _points(self, phase: str) -> list[tuple[float, float, float]]:
        """(flops, bytes, seconds) of each kernel timed for ``phase``."""
        b = self.dtype_bytes
        out = []
        for g in self.gemm:
            if g.get("phase", "prefill") == phase:
                m, k, n = float(g["m"]), float(g["k"]), float(g["n"])
                out.append((2 * m * k * n, (k * n + m * k + m * n) * b, float(g["seconds"])))
        for a in self.attention:
            if a.get("phase", "prefill") == phase:
                bt, q, ctx = float(a["batch"]), float(a["q_tokens"]), float(a["context"])
                hd, h, kvh = float(a["head_dim"]), float(a["heads"]), float(a["kv_heads"])
                flops = 4 * bt * h * hd * q * (ctx - q + (q + 1) / 2)
                nbytes = bt * (2 * kvh * hd * ctx + 2 * h * hd * q) * b
                out.append((flops, nbytes, float(a["seconds"])))
        return [p for p in out if p[2] > 0]

    def prefill_mfu(self, hw: GPUSpec) -> float | None:
        pts = self._points("prefill")
        if not pts:
            return None
        return min(sum(f for f, _, _ in pts) / sum(t for _, _, t in pts) / hw.flops, 1.0)

    def decode_mbu(self, hw: GPUSpec) -> float | None:
        pts = self._points("decode")
        if not pts:
            return None
        return min(sum(b for _, b, _ in pts) / sum(t for _, _, t in pts) / hw.hbm_bandwidth, 1.0)

    def efficiency(self, hw: GPUSpec, base: Efficiency | None = None) -> Efficiency:
        """``base`` (the data file's) with the measured prefill MFU and decode MBU in place."""
        base = base or default_efficiency()
        if _resolve("GPU", _load("gpus.yaml")["gpus"], self.gpu) != hw.name:
            raise ValueError(f"calibration was measured on {self.gpu} ({self.device}), not {hw.name}")
        return replace(base, prefill_mfu=self.prefill_mfu(hw) or base.prefill_mfu,
                       decode_mbu=self.decode_mbu(hw) or base.decode_mbu)

    def to_dict(self) -> dict[str, Any]:
        return {**self.source, "gpu": self.gpu, "device": self.device, "measuredAt": self.measured_at,
                "dtypeBytes": self.dtype_bytes, "gemm": list(self.gemm), "attention": list(self.attention),
                **({"allreduce": list(self.allreduce)} if self.allreduce else {}),
                **({"sendrecv": list(self.sendrecv)} if self.sendrecv else {})}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        missing = [k for k in ("gpu", "measuredAt") if k not in d]
        if missing:
            raise ValueError(f"calibration file lacks {', '.join(missing)} (which GPU, and when)")
        return cls(str(d["gpu"]), str(d.get("device", "")), str(d["measuredAt"]), int(d.get("dtypeBytes", 2)),
                   tuple(dict(g) for g in d.get("gemm", ())), tuple(dict(a) for a in d.get("attention", ())),
                   {k: v for k, v in d.items() if k not in ("gemm", "attention", "allreduce", "sendrecv")},
                   tuple(dict(a) for a in d.get("allreduce", ())), tuple(dict(a) for a in d.get("sendrecv", ())))

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        text = Path(path).read_text()
        return cls.from_dict(json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text))


CALIBRATIONS = DATA / "calibration"   # <GPU name>.json: measured kernel timings shipped for that GPU
# vLLM sends a TP all-reduce of at most this many bytes through its own custom all-reduce (peer-to-peer over
# NVLink, one kernel, captured in CUDA graphs; vllm/distributed/device_communicators/custom_all_reduce.py,
# max_size 8 MiB) and larger ones through NCCL. The calibration's all-reduces are NCCL's (nccl-tests style,
# a ~30-40 us floor on a DGX H100), which would charge every decode step's small all-reduces 4-5x what vLLM
# spends on them; the model uses them above this size only.
CUSTOM_ALLREDUCE_MAX_BYTES = 8 * 1024 * 1024


@cache
def shipped_calibration(gpu_name: str) -> Calibration | None:
    """The calibration shipped for this GPU (``data/calibration/<name>.json``), None if there is none."""
    path = CALIBRATIONS / f"{gpu_name}.json"
    return Calibration.load(path) if path.exists() else None


def planning_calibration(hw: GPUSpec, dtype_bytes: int = 2, path: str | Path | None = None,
                         measured: bool = True) -> Calibration | None:
    """The calibration every PerfModel of ``hw`` plans with: ``path`` (one's own measurements) if given,
    else (with ``measured``, the default) the one shipped for this GPU, if any, when it was measured with
    weights of ``dtype_bytes`` bytes (an FP8 model on a BF16 calibration keeps the data sheet)."""
    if path is not None:
        return Calibration.load(path)
    if not measured:
        return None
    cal = shipped_calibration(hw.name)
    return cal if cal is not None and cal.dtype_bytes == dtype_bytes else None


# ---------------------------------------------------------------- the model

# LoRA adapters (spec.model.adapters) in one batch: each distinct adapter active in a step adds this share of the
# step's time. vLLM runs a batch's adapters as segments of one batched LoRA kernel (punica's SGMV/BGMV),
# whose cost grows with the number of distinct adapters in the batch, on top of the base model's step. A
# simple assumed factor, not measured here (no GPU run of it): the planner's online correction absorbs what
# it gets wrong, and it only matters where many adapters run at once.
LORA_STEP_COST_PER_ADAPTER = 0.05


def lora_step_factor(active_adapters: float) -> float:
    """A step's time with ``active_adapters`` distinct LoRA adapters in its batch over the base model's."""
    return 1.0 + LORA_STEP_COST_PER_ADAPTER * max(active_adapters, 0.0)


@dataclass(frozen=True)
class PerfModel:
    """Latency of one replica (``tp`` GPUs) of ``shape`` on ``hw``.

    ``prefill_scale``/``decode_scale`` are online corrections (1.0 = uncorrected). ``tp_comm`` (on by
    default) adds the tensor-parallel all-reduces (two per layer) to every step.
    """

    shape: ModelShape
    hw: GPUSpec
    tp: int = 1
    link: Interconnect = field(default_factory=lambda: interconnect("infiniband-ndr"))
    eff: Efficiency = field(default_factory=default_efficiency)
    profile: Profile | None = None
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    tp_comm: bool = True
    calibration: Calibration | None = field(default=None, compare=False)
    lora_adapters: float = 0.0     # distinct LoRA adapters active in a batch (lora_step_factor)

    @classmethod
    def analytic(cls, model_name: str, gpu_name: str, tp: int = 1, link: str = "infiniband-ndr",
                 profile: Profile | None = None, calibration: Calibration | None = None,
                 measured: bool = True) -> PerfModel:
        """From the data files; ``calibration`` (else, with ``measured``, the default, the one shipped for
        this GPU, if any: :func:`planning_calibration`) replaces the data sheet's efficiencies."""
        hw, shape = gpu(gpu_name), model(model_name)
        if calibration is None:
            calibration = planning_calibration(hw, shape.dtype_bytes, measured=measured)
        eff = calibration.efficiency(hw) if calibration is not None else default_efficiency()
        return cls(shape, hw, tp, interconnect(link), eff, profile, calibration=calibration)

    # -- what a replica is, as the serving model counts it ------------------------
    @property
    def gpus(self) -> int:
        """GPUs of one replica (the TP group; a data-parallel replica, :class:`.parallel.DataParallelEngine`,
        has more)."""
        return self.tp

    @property
    def servers(self) -> int:
        """Prompts one replica prefills side by side, each at :meth:`ttft`'s pace: one engine, one queue
        server (a data-parallel replica: one per data-parallel rank)."""
        return 1

    @property
    def data_parallel(self) -> bool:
        """Whether a request's KV lives on one data-parallel rank (data-parallel attention), not split
        over the tensor group."""
        return False

    # -- kernels ----------------------------------------------------------
    def gemm_time(self, m: float, k: float, n: float) -> float:
        """One GEMM of ``m`` tokens through a ``k x n`` weight (one TP rank's shard): the calibration's fit
        where there is one, else the roofline at the data sheet's efficiencies."""
        if m <= 0:
            return 0.0
        if self.calibration is not None:
            t = self.calibration.gemm_seconds(m, k, n, self.hw)
            if t is not None:
                return t
        b = self.shape.dtype_bytes
        return max(2.0 * m * k * n / (self.hw.flops * self.eff.prefill_mfu),
                   (k * n + m * (k + n)) * b / (self.hw.hbm_bandwidth * self.eff.decode_mbu))

    def allreduce_time(self, nbytes: float, workers: int | None = None) -> float:
        """One all-reduce of ``nbytes`` across ``workers`` GPUs (the TP group): measured where the
        calibration has that group size, else a ring over the GPU's NVLink (2(w-1)/w of the bytes each
        way at 80% of its bandwidth) plus the data file's fixed latency."""
        w = workers or self.tp
        if w <= 1 or nbytes <= 0:
            return 0.0
        if self.calibration is not None:
            t = self.calibration.allreduce_seconds(w, nbytes)
            if t is not None:
                return t
        return self.custom_allreduce_time(nbytes, w)

    def custom_allreduce_time(self, nbytes: float, workers: int | None = None) -> float:
        """One all-reduce by vLLM's custom all-reduce: the data sheet's fixed latency plus a ring's bytes
        (2(w-1)/w each way) over NVLink at 80% of its bandwidth."""
        w = workers or self.tp
        if w <= 1 or nbytes <= 0:
            return 0.0
        return self.eff.tp_allreduce_latency_seconds + 2.0 * (w - 1) / w * nbytes / (self.hw.nvlink_bandwidth * 0.8)

    def p2p_time(self, nbytes: float, cross_node: bool = False, link: Interconnect | None = None) -> float:
        """One send/recv of ``nbytes`` between two GPUs (a pipeline stage's activations, a KV shard): inside
        a node (or NVLink domain) over NVLink, else over the network ``link`` (the model's by default).
        Measured where the calibration has that path (NCCL's send/recv on a DGX H100, inside it and between
        two of them), else the data sheet: the link's latency plus the bytes at its efficiency."""
        if nbytes <= 0:
            return 0.0
        if self.calibration is not None and link is None:
            t = self.calibration.sendrecv_seconds(nbytes, cross_node)
            if t is not None:
                return t
        if cross_node:
            net = link or self.link
            return net.latency_seconds + nbytes / (net.bandwidth * net.efficiency)
        return self.eff.tp_allreduce_latency_seconds + nbytes / (self.hw.nvlink_bandwidth * 0.8)

    # -- tensor parallelism ------------------------------------------------
    def tp_comm_time(self, tokens: float) -> float:
        """Two all-reduces per layer of ``tokens`` x hidden 16-bit activations across the TP group: vLLM's
        custom all-reduce up to :data:`CUSTOM_ALLREDUCE_MAX_BYTES` (at most NCCL's time), else
        :meth:`allreduce_time` (NCCL's, measured where calibrated). 0 at TP 1 or with ``tp_comm`` off."""
        if not self.tp_comm or self.tp <= 1 or tokens <= 0:
            return 0.0
        nbytes = tokens * self.shape.hidden * 2
        one = self.allreduce_time(nbytes)
        if nbytes <= CUSTOM_ALLREDUCE_MAX_BYTES:
            # vLLM takes the custom all-reduce below this size because it beats NCCL there; the ring
            # estimate above overstates its mid-size cost (its two-shot kernel), so never more than NCCL's
            one = min(one, self.custom_allreduce_time(nbytes))
        return 2 * self.shape.layers * one

    def corrected(self, prefill_scale: float = 1.0, decode_scale: float = 1.0) -> PerfModel:
        return replace(self, prefill_scale=prefill_scale, decode_scale=decode_scale)

    def with_lora(self, active_adapters: float) -> PerfModel:
        """The same replica running ``active_adapters`` distinct LoRA adapters in a batch."""
        return replace(self, lora_adapters=active_adapters)

    # -- prefill --------------------------------------------------------
    def prefill_flops(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        return (self.shape.matmul_flops_per_token * new_tokens
                + self.shape.attention_flops(new_tokens, cached_tokens))

    def prefill_floor(self, batch: Sequence[tuple[float, float]]) -> float:
        """Physical lower bound: all FLOPs at TP x peak; weights read once, the cached KV read and the new KV
        written, at TP x HBM bandwidth."""
        flops = sum(self.prefill_flops(n, c) for n, c in batch)
        reads = self.shape.weight_bytes + self.shape.kv_bytes_per_token * sum(n + c for n, c in batch)
        return max(flops / (self.tp * self.hw.flops), reads / (self.tp * self.hw.hbm_bandwidth))

    def prefill_time(self, batch: Sequence[tuple[float, float]]) -> float:
        """Seconds to prefill one batch of ``(new_tokens, cached_tokens)`` prompts together."""
        if not batch or sum(n for n, _ in batch) <= 0:
            return 0.0
        floor = self.prefill_floor(batch)
        if self.profile is not None:
            est = self.profile.prefill_seconds([n for n, _ in batch])
            # the profile has no cache term: add the attention to the cached context analytically
            est += sum(self.shape.attention_flops(n, c) - self.shape.attention_flops(n, 0) for n, c in batch) / (
                self.tp * self.hw.flops * self.eff.prefill_mfu)
        else:
            flops = sum(self.prefill_flops(n, c) for n, c in batch)
            reads = self.shape.weight_bytes + self.shape.kv_bytes_per_token * sum(n + c for n, c in batch)
            est = max(flops / (self.tp * self.hw.flops * self.eff.prefill_mfu),
                      reads / (self.tp * self.hw.hbm_bandwidth * self.eff.decode_mbu)) + self.eff.step_overhead_seconds
        comm = self.tp_comm_time(sum(n for n, _ in batch))
        return max(est * self.prefill_scale * lora_step_factor(self.lora_adapters) + comm, floor)

    def ttft(self, prompt_tokens: float, cached_tokens: float = 0.0, batch: int = 1) -> float:
        """Prefill latency of ``batch`` identical prompts run together (no queueing, no transfer)."""
        return self.prefill_time([(max(prompt_tokens - cached_tokens, 0.0), cached_tokens)] * batch)

    def prefill_throughput(self, prompt_tokens: float, batch: int = 1, cached_tokens: float = 0.0) -> float:
        """New (uncached) prompt tokens per second."""
        t = self.ttft(prompt_tokens, cached_tokens, batch)
        return batch * max(prompt_tokens - cached_tokens, 0.0) / t if t > 0 else 0.0

    # -- decode ---------------------------------------------------------
    def decode_floor(self, concurrency: float, context_total: float) -> float:
        reads = self.shape.weight_bytes + self.shape.kv_bytes_per_token * context_total
        flops = self.shape.matmul_flops_per_token * concurrency + 4.0 * self.shape.layers * self.shape.q_dim * context_total
        return max(reads / (self.tp * self.hw.hbm_bandwidth), flops / (self.tp * self.hw.flops))

    def decode_step_time(self, concurrency: float, context_total: float) -> float:
        """Seconds for one decode step of ``concurrency`` requests holding ``context_total`` tokens in all
        (the inter-token latency each of them sees)."""
        if concurrency <= 0:
            return 0.0
        floor = self.decode_floor(concurrency, context_total)
        if self.profile is not None:
            est = self.profile.decode_seconds(concurrency, context_total)
        else:
            reads = self.shape.weight_bytes + self.shape.kv_bytes_per_token * context_total
            flops = (self.shape.matmul_flops_per_token * concurrency
                     + 4.0 * self.shape.layers * self.shape.q_dim * context_total)
            est = max(reads / (self.tp * self.hw.hbm_bandwidth * self.eff.decode_mbu),
                      flops / (self.tp * self.hw.flops * self.eff.prefill_mfu)) + self.eff.step_overhead_seconds
        return max(est * self.decode_scale * lora_step_factor(self.lora_adapters) + self.tp_comm_time(concurrency),
                   floor)

    def mixed_step_floor(self, concurrency: float, context_total: float,
                         prefill: Sequence[tuple[float, float]] = (), prefill_fraction: float = 1.0) -> float:
        """Physical lower bound of :meth:`mixed_step_time`: its FLOPs at TP x peak, its reads at TP x HBM."""
        flops, reads = self.mixed_step_work(concurrency, context_total, prefill, prefill_fraction)
        return max(flops / (self.tp * self.hw.flops), reads / (self.tp * self.hw.hbm_bandwidth))

    def mixed_step_work(self, concurrency: float, context_total: float, prefill: Sequence[tuple[float, float]] = (),
                        prefill_fraction: float = 1.0) -> tuple[float, float]:
        """(FLOPs, HBM bytes read) of one mixed step (see :meth:`mixed_step_time`)."""
        s = self.shape
        flops = (s.matmul_flops_per_token * concurrency + 4.0 * s.layers * s.q_dim * context_total
                 + prefill_fraction * sum(self.prefill_flops(n, c) for n, c in prefill))
        reads = s.weight_bytes + s.kv_bytes_per_token * (context_total + prefill_fraction * sum(c for _, c in prefill))
        return flops, reads

    def mixed_step_time(self, concurrency: float, context_total: float,
                        prefill: Sequence[tuple[float, float]] = (), prefill_fraction: float = 1.0) -> float:
        """One engine step that decodes ``concurrency`` requests (``context_total`` tokens in all) and, in the
        same pass over the weights, prefills ``prefill_fraction`` of the ``(new, cached)`` prompts in
        ``prefill`` (chunked prefill, the aggregated engine's way: a prompt is spread over steps)."""
        new = prefill_fraction * sum(n for n, _ in prefill)
        if concurrency <= 0 and new <= 0:
            return 0.0
        if new <= 0:
            return self.decode_step_time(concurrency, context_total)
        floor = self.mixed_step_floor(concurrency, context_total, prefill, prefill_fraction)
        if self.profile is not None:
            intercept = self.profile.prefill_coef[0]
            part_p = prefill_fraction * (self.profile.prefill_seconds([n for n, _ in prefill]) - intercept)
            part_d = self.profile.decode_seconds(concurrency, context_total) if concurrency > 0 else intercept
            est = part_p * self.prefill_scale + part_d * self.decode_scale
        else:
            flops, reads = self.mixed_step_work(concurrency, context_total, prefill, prefill_fraction)
            compute = flops / (self.tp * self.hw.flops * self.eff.prefill_mfu)
            memory = reads / (self.tp * self.hw.hbm_bandwidth * self.eff.decode_mbu)
            scale = self.prefill_scale if compute >= memory else self.decode_scale
            est = (max(compute, memory) + self.eff.step_overhead_seconds) * scale
        return max(est * lora_step_factor(self.lora_adapters) + self.tp_comm_time(concurrency + new), floor)

    def itl(self, concurrency: float, context_tokens: float) -> float:
        """Inter-token latency at ``concurrency`` requests of ``context_tokens`` each."""
        return self.decode_step_time(concurrency, concurrency * context_tokens)

    def decode_throughput(self, concurrency: float, context_tokens: float) -> float:
        t = self.itl(concurrency, context_tokens)
        return concurrency / t if t > 0 else 0.0

    def kv_capacity_tokens(self) -> float:
        """Tokens of KV cache one replica holds (vLLM's memory utilisation, less the weights)."""
        free = self.tp * self.hw.memory_bytes * self.eff.memory_utilization - self.shape.weight_bytes
        return max(free, 0.0) / self.shape.kv_bytes_per_token

    def max_concurrency(self, context_tokens: float) -> int:
        return max(int(self.kv_capacity_tokens() // max(context_tokens, 1.0)), 0)

    def max_concurrency_for_itl(self, itl_target: float, context_tokens: float, limit: int = 4096) -> int:
        """Largest concurrency whose ITL meets ``itl_target`` and whose KV cache fits (0 if none)."""
        hi = min(self.max_concurrency(context_tokens), limit)
        if hi < 1 or self.itl(1, context_tokens) > itl_target:
            return 0
        lo = 1
        while lo < hi:  # itl is non-decreasing in concurrency: binary search
            mid = (lo + hi + 1) // 2
            if self.itl(mid, context_tokens) <= itl_target:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- KV transfer ----------------------------------------------------
    def kv_bytes(self, tokens: float) -> float:
        return self.shape.kv_bytes_per_token * tokens

    def kv_transfer_time(self, nbytes: float, link: Interconnect | None = None, parallel_links: int | None = None) -> float:
        """Seconds to move ``nbytes`` of KV cache over ``parallel_links`` links (one per TP rank by default)."""
        link = link or self.link
        lanes = parallel_links or self.tp
        if nbytes <= 0:
            return 0.0
        return link.latency_seconds + nbytes / (lanes * link.bandwidth * link.efficiency)

    def kv_transfer_time_tokens(self, tokens: float) -> float:
        return self.kv_transfer_time(self.kv_bytes(tokens))

    def handoff_time(self, tokens: float, parallel_links: int | None = None) -> float:
        """Seconds from a prompt's prefill ending to decode starting on it: the profile's measured P/D
        hand-off where it has one (never below the KV bytes' time over the link), else that time alone."""
        wire = self.kv_transfer_time(self.kv_bytes(tokens), parallel_links=parallel_links)
        measured = self.profile.handoff_base if self.profile is not None else None
        return wire if measured is None else max(measured, wire)


# ---------------------------------------------------------------- online correction

@dataclass
class OnlineCorrection:
    """Exponentially weighted ratio of observed to predicted latency, per phase.

    The planner feeds it each interval's observed percentile next to what the model
    predicted for the load it observed, and plans with ``model.corrected(...)``.
    Factors are clamped so one noisy sample cannot swing the plan wildly.
    """

    alpha: float = 0.3
    lo: float = 0.25
    hi: float = 8.0
    prefill: float = 1.0
    decode: float = 1.0

    def _update(self, current: float, observed: float, predicted: float) -> float:
        if not (observed > 0 and predicted > 0 and math.isfinite(observed) and math.isfinite(predicted)):
            return current
        ratio = min(max(observed / predicted * current, self.lo), self.hi)  # predicted had `current` applied
        log = (1 - self.alpha) * math.log(current) + self.alpha * math.log(ratio)
        return min(max(math.exp(log), self.lo), self.hi)

    def observe(self, ttft_observed: float | None, ttft_predicted: float | None,
                itl_observed: float | None, itl_predicted: float | None) -> OnlineCorrection:
        return replace(self,
                       prefill=self._update(self.prefill, ttft_observed or 0.0, ttft_predicted or 0.0),
                       decode=self._update(self.decode, itl_observed or 0.0, itl_predicted or 0.0))

