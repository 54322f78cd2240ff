"""The performance model: how long prefill, decode steps and KV transfers take.

One module, shared by the planner, the simulator and (later) the configurator.
Sources, in order of preference:

1. a measured :class:`Profile` (``disagg profile`` writes one) fitted by least squares;
2. the analytic default from the model's shape and the GPU's data sheet
   (``data/models.yaml``, ``data/gpus.yaml``): prefill is compute-bound
   (FLOPs / (TP x peak FLOP/s x MFU)), a decode step is bandwidth-bound
   (weights + KV cache read / (TP x HBM bandwidth x MBU));
3. online correction: scale factors learnt from observed versus predicted latency
   (:class:`OnlineCorrection`).

Whatever the source, no estimate is faster than physics allows: prefill never
exceeds TP x peak FLOP/s and a decode step never reads faster than TP x HBM
bandwidth (the *physical floor*, applied last).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cache
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

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def matmul_flops_per_token(self) -> float:
        """2 FLOPs per weight per token, less the embedding lookup (no FLOPs)."""
        return 2.0 * max(self.params - self.vocab * self.hidden, self.params / 2)

    def attention_flops(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        """QK^T and AV for ``new_tokens`` attending causally to ``cached + earlier new`` tokens."""
        return 4.0 * self.layers * self.hidden * new_tokens * (cached_tokens + (new_tokens + 1) / 2.0)


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


@cache
def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((DATA / name).read_text())


def gpu(name: str) -> GPUSpec:
    specs = _load("gpus.yaml")["gpus"]
    if name not in specs:
        raise KeyError(f"unknown GPU {name!r}; known: {', '.join(sorted(specs))}")
    s = specs[name]
    return GPUSpec(name, float(s["flops_bf16"]), float(s["hbm_bandwidth"]), float(s["memory_bytes"]),
                   float(s["nvlink_bandwidth"]))


def model(name: str) -> ModelShape:
    specs = _load("models.yaml")["models"]
    if name not in specs:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(sorted(specs))}")
    s = specs[name]
    return ModelShape(name, int(s["layers"]), int(s["hidden"]), int(s["heads"]), int(s["kv_heads"]),
                      int(s["intermediate"]), int(s["vocab"]), float(s["params"]), int(s.get("dtype_bytes", 2)))


def interconnect(name: str) -> Interconnect:
    specs = _load("gpus.yaml")["interconnects"]
    if name not in specs:
        raise KeyError(f"unknown interconnect {name!r}; known: {', '.join(sorted(specs))}")
    s = specs[name]
    return Interconnect(name, float(s["bandwidth"]), float(s["latency_seconds"]), float(s["efficiency"]))


def default_efficiency() -> Efficiency:
    s = _load("gpus.yaml")["efficiency"]
    return Efficiency(float(s["prefill_mfu"]), float(s["decode_mbu"]), float(s["step_overhead_seconds"]),
                      float(s["memory_utilization"]))


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
    decode points: ``{concurrency, context, seconds}`` (one step, every request at ``context`` tokens).
    Fit: prefill = a + b*sum(tokens) + c*sum(tokens^2); decode step = a + b*concurrency + c*sum(context).
    """

    model: str
    gpu: str
    tensor_parallel_size: int
    prefill: tuple[dict[str, float], ...]
    decode: tuple[dict[str, float], ...]
    prefill_coef: tuple[float, float, float] = field(init=False)
    decode_coef: tuple[float, float, float] = field(init=False)

    def __post_init__(self) -> None:
        if len(self.prefill) < 3 or len(self.decode) < 3:
            raise ValueError("a profile needs at least 3 prefill and 3 decode points")
        pc = _lstsq_nonneg([[1.0, p["tokens"] * p["batch"], p["tokens"] ** 2 * p["batch"]] for p in self.prefill],
                           [p["seconds"] for p in self.prefill])
        dc = _lstsq_nonneg([[1.0, d["concurrency"], d["concurrency"] * d["context"]] for d in self.decode],
                           [d["seconds"] for d in self.decode])
        object.__setattr__(self, "prefill_coef", tuple(pc))
        object.__setattr__(self, "decode_coef", tuple(dc))

    def prefill_seconds(self, new_tokens: Sequence[float]) -> float:
        a, b, c = self.prefill_coef
        return a + b * sum(new_tokens) + c * sum(t * t for t in new_tokens)

    def decode_seconds(self, concurrency: float, context_total: float) -> float:
        a, b, c = self.decode_coef
        return a + b * concurrency + c * context_total

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "gpu": self.gpu, "tensorParallelSize": self.tensor_parallel_size,
                "prefill": list(self.prefill), "decode": list(self.decode)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        return cls(d["model"], d["gpu"], int(d.get("tensorParallelSize", 1)),
                   tuple(dict(p) for p in d["prefill"]), tuple(dict(p) for p in d["decode"]))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        text = Path(path).read_text()
        return cls.from_dict(json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text))


# ---------------------------------------------------------------- the model

@dataclass(frozen=True)
class PerfModel:
    """Latency of one replica (``tp`` GPUs) of ``shape`` on ``hw``.

    ``prefill_scale``/``decode_scale`` are online corrections (1.0 = uncorrected).
    """

    shape: ModelShape
    hw: GPUSpec
    tp: int = 1
    link: Interconnect = field(default_factory=lambda: interconnect("infiniband-ndr"))
    eff: Efficiency = field(default_factory=default_efficiency)
    profile: Profile | None = None
    prefill_scale: float = 1.0
    decode_scale: float = 1.0

    @classmethod
    def analytic(cls, model_name: str, gpu_name: str, tp: int = 1, link: str = "infiniband-ndr",
                 profile: Profile | None = None) -> PerfModel:
        return cls(model(model_name), gpu(gpu_name), tp, interconnect(link), default_efficiency(), profile)

    def corrected(self, prefill_scale: float = 1.0, decode_scale: float = 1.0) -> PerfModel:
        return replace(self, prefill_scale=prefill_scale, decode_scale=decode_scale)

    # -- prefill --------------------------------------------------------
    def prefill_flops(self, new_tokens: float, cached_tokens: float = 0.0) -> float:
        return (self.shape.matmul_flops_per_token * new_tokens
                + self.shape.attention_flops(new_tokens, cached_tokens))

    def prefill_floor(self, batch: Sequence[tuple[float, float]]) -> float:
        """Physical lower bound: all FLOPs at TP x peak, weights read once at TP x HBM bandwidth."""
        flops = sum(self.prefill_flops(n, c) for n, c in batch)
        reads = self.shape.weight_bytes + self.shape.kv_bytes_per_token * sum(c for _, c in batch)
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
            reads = self.shape.weight_bytes + self.shape.kv_bytes_per_token * sum(c for _, c in batch)
            est = max(flops / (self.tp * self.hw.flops * self.eff.prefill_mfu),
                      reads / (self.tp * self.hw.hbm_bandwidth * self.eff.decode_mbu)) + self.eff.step_overhead_seconds
        return max(est * self.prefill_scale, floor)

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
        flops = self.shape.matmul_flops_per_token * concurrency + 4.0 * self.shape.layers * self.shape.hidden * context_total
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
                     + 4.0 * self.shape.layers * self.shape.hidden * context_total)
            est = max(reads / (self.tp * self.hw.hbm_bandwidth * self.eff.decode_mbu),
                      flops / (self.tp * self.hw.flops * self.eff.prefill_mfu)) + self.eff.step_overhead_seconds
        return max(est * self.decode_scale, floor)

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

