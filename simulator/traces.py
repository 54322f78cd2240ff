"""Request traces for the simulator: synthetic shapes and a file format for real ones.

File format (CSV with a header, or JSON lines), one request per row:
``timestamp`` (seconds from the start), ``input_tokens``, ``output_tokens``,
``prefix_group`` (requests of one group share a cached prompt prefix; empty: none).
The Mooncake trace format (``timestamp`` in ms, ``input_length``, ``output_length``,
``hash_ids``: one id per 512-token block) is read as it is, prefix blocks included.

Synthetic shapes: Poisson (constant rate), step, diurnal (sinusoidal rate), bursty
(on/off), flash crowds; token mixes: lognormal (:class:`Mix`) or Pareto with a spike of very short
prompts (:class:`ParetoMix`); tenants of different mixes merged into one trace (:func:`merge`).
All are seeded and deterministic.
"""

from __future__ import annotations

import csv
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

BLOCK_TOKENS = 512  # tokens per prefix block (the Mooncake trace's hash_ids unit)
REAL_TRACE = "mooncake_conversation.jsonl"


@dataclass(frozen=True)
class Request:
    t: float                         # arrival, seconds from the start
    input_tokens: int
    output_tokens: int
    prefix_group: str = ""
    blocks: tuple[int | str, ...] = ()  # prefix block ids, one per BLOCK_TOKENS of input
    adapter: str = ""                # the LoRA adapter it names ("": the base model)


@dataclass(frozen=True)
class Trace:
    name: str
    requests: tuple[Request, ...]

    @property
    def duration(self) -> float:
        return self.requests[-1].t if self.requests else 0.0

    def scaled(self, rate: float = 1.0, time: float = 1.0, limit: float | None = None) -> Trace:
        """``rate`` x the request rate (time compressed), then ``time`` x stretched; cut at ``limit`` s."""
        k = time / rate
        reqs = tuple(Request(r.t * k, r.input_tokens, r.output_tokens, r.prefix_group, r.blocks)
                     for r in self.requests if limit is None or r.t * k <= limit)
        return Trace(self.name, reqs)


# ---------------------------------------------------------------- synthetic

@dataclass(frozen=True)
class Mix:
    """Token mix of synthetic requests: lognormal lengths and shared system prompts."""

    input_mean: float = 3000
    output_mean: float = 300
    sigma: float = 0.6
    prefix_groups: int = 8
    prefix_tokens: int = 2048       # shared prefix length within a group
    prefix_share: float = 0.7       # fraction of requests that belong to a group

    def sample(self, rng: random.Random, t: float, seq: int) -> Request:
        def lognormal(mean: float) -> int:
            mu = math.log(mean) - self.sigma ** 2 / 2
            return max(1, int(rng.lognormvariate(mu, self.sigma)))

        n_in, n_out = lognormal(self.input_mean), lognormal(self.output_mean)
        group = ""
        blocks: list[int | str] = []
        if self.prefix_groups and rng.random() < self.prefix_share:
            g = rng.randrange(self.prefix_groups)
            group = f"g{g}"
            n_in = max(n_in, self.prefix_tokens + 1)
            blocks = [f"g{g}-{i}" for i in range(self.prefix_tokens // BLOCK_TOKENS)]
        unique = math.ceil(n_in / BLOCK_TOKENS) - len(blocks)
        blocks += [f"r{seq}-{i}" for i in range(max(unique, 0))]
        return Request(t, n_in, n_out, group, tuple(blocks))


def from_rate(name: str, rate: Callable[[float], float], duration: float, peak: float, mix: Mix | ParetoMix = Mix(),
              seed: int = 0) -> Trace:
    """Non-homogeneous Poisson arrivals with ``rate(t)`` <= ``peak`` (thinning)."""
    rng = random.Random(seed)
    out: list[Request] = []
    t = 0.0
    if peak <= 0:
        return Trace(name, ())
    while True:
        t += rng.expovariate(peak)
        if t > duration:
            break
        if rng.random() * peak <= rate(t):
            out.append(mix.sample(rng, t, len(out)))
    return Trace(name, tuple(out))


def poisson(rate: float, duration: float, mix: Mix | ParetoMix = Mix(), seed: int = 0) -> Trace:
    return from_rate("poisson", lambda t: rate, duration, rate, mix, seed)


def step(rates: Iterable[float], step_seconds: float, mix: Mix = Mix(), seed: int = 0) -> Trace:
    rs = list(rates)
    return from_rate("step", lambda t: rs[min(int(t // step_seconds), len(rs) - 1)], step_seconds * len(rs),
                     max(rs), mix, seed)


def diurnal(mean: float, amplitude: float, period: float, duration: float, mix: Mix = Mix(), seed: int = 0) -> Trace:
    """Rate mean x (1 - amplitude x cos(2 pi t / period)): starts at the trough, peaks mid-period."""
    return from_rate("diurnal", lambda t: mean * (1 - amplitude * math.cos(2 * math.pi * t / period)), duration,
                     mean * (1 + amplitude), mix, seed)


def bursty(on_rate: float, off_rate: float, on_seconds: float, off_seconds: float, duration: float,
           mix: Mix = Mix(), seed: int = 0) -> Trace:
    cycle = on_seconds + off_seconds
    return from_rate("bursty", lambda t: on_rate if (t % cycle) >= off_seconds else off_rate, duration,
                     max(on_rate, off_rate), mix, seed)


@dataclass(frozen=True)
class ParetoMix:
    """Heavy-tailed prompts: a Pareto body (``alpha``, minimum ``minimum`` tokens, cut at ``cap``) and a
    spike of very short prompts (``short_share`` of requests, 1 to ``short_max`` tokens: health checks,
    one-word follow-ups); lognormal outputs. No shared prefixes."""

    alpha: float = 1.4
    minimum: float = 3000
    cap: int = 100_000
    short_share: float = 0.2
    short_max: int = 32
    output_mean: float = 150
    sigma: float = 0.6

    def sample(self, rng: random.Random, t: float, seq: int) -> Request:
        if rng.random() < self.short_share:
            n_in = rng.randint(1, self.short_max)
        else:
            n_in = min(int(self.minimum * rng.paretovariate(self.alpha)), self.cap)
        mu = math.log(self.output_mean) - self.sigma ** 2 / 2
        n_out = max(1, int(rng.lognormvariate(mu, self.sigma)))
        return Request(t, n_in, n_out, "", tuple(f"r{seq}-{i}" for i in range(math.ceil(n_in / BLOCK_TOKENS))))


def merge(name: str, *parts: Trace) -> Trace:
    """One trace of several (tenants sharing a deployment): arrivals interleaved in time, the parts'
    prefix blocks kept apart."""
    reqs = [Request(r.t, r.input_tokens, r.output_tokens, r.prefix_group and f"{i}.{r.prefix_group}",
                    tuple(f"{i}.{b}" for b in r.blocks))
            for i, part in enumerate(parts) for r in part.requests]
    reqs.sort(key=lambda r: r.t)
    return Trace(name, tuple(reqs))


def flash_crowd(base: float, surge: float, duration: float, crowds: int = 1, rise: float = 10.0,
                hold: float = 180.0, decay: float = 240.0, mix: Mix | ParetoMix = Mix(), seed: int = 0) -> Trace:
    """Flat ``base`` requests/s with ``crowds`` flash crowds at seeded times: the rate climbs to ``surge``
    x base within ``rise`` s, holds ``hold`` s, then decays exponentially (time constant ``decay`` / 3).
    One crowd per equal slice of the trace, never in its first tenth (the planner starts sized for it)."""
    rng = random.Random(seed * 7919 + 17)
    width = duration / max(crowds, 1)
    starts = [i * width + rng.uniform(0.1 * width if i == 0 else 0.0, 0.6 * width) for i in range(crowds)]

    def rate(t: float) -> float:
        r = base
        for s in starts:
            u = t - s
            if u < 0:
                continue
            if u < rise:
                k = u / rise
            elif u < rise + hold:
                k = 1.0
            else:
                k = math.exp(-(u - rise - hold) * 3.0 / decay)
            r = max(r, base + (surge - 1.0) * base * k)
        return r

    return from_rate("flash", rate, duration, base * surge, mix, seed)


# ---------------------------------------------------------------- files

def load(path: str | Path) -> Trace:
    """A trace file: CSV or JSON lines in the format above, or the Mooncake format."""
    path = Path(path)
    rows: list[dict] = []
    with path.open() as f:
        if path.suffix == ".csv":
            rows = list(csv.DictReader(f))
        else:
            rows = [json.loads(line) for line in f if line.strip()]
    reqs = []
    for i, row in enumerate(rows):
        if "input_length" in row:  # Mooncake: ms, hash_ids
            blocks = tuple(int(b) for b in row.get("hash_ids", ()))
            reqs.append(Request(float(row["timestamp"]) / 1000.0, int(row["input_length"]), int(row["output_length"]),
                                "", blocks))
            continue
        try:
            t, n_in, n_out = float(row["timestamp"]), int(row["input_tokens"]), int(row["output_tokens"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}:{i + 2 if path.suffix == '.csv' else i + 1}: want timestamp, input_tokens, "
                             f"output_tokens[, prefix_group]: {e}") from None
        group = str(row.get("prefix_group") or "")
        reqs.append(Request(t, n_in, n_out, group, _group_blocks(group, n_in, i)))
    reqs.sort(key=lambda r: r.t)
    return Trace(path.stem, tuple(reqs))


def _group_blocks(group: str, n_in: int, seq: int) -> tuple[str, ...]:
    """A group's requests share their first half of blocks (the file format names no prefix length)."""
    n = math.ceil(n_in / BLOCK_TOKENS)
    shared = n // 2 if group else 0
    return tuple([f"{group}-{i}" for i in range(shared)] + [f"r{seq}-{i}" for i in range(n - shared)])


def write_csv(trace: Trace, path: str | Path) -> None:
    with Path(path).open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["timestamp", "input_tokens", "output_tokens", "prefix_group"])
        for r in trace.requests:
            w.writerow([f"{r.t:.3f}", r.input_tokens, r.output_tokens, r.prefix_group])


def shared_traces_dir(repo: Path) -> Path:
    """The project's shared traces: ``<repo>/../shared/traces``."""
    return repo.parent / "shared" / "traces"


def real(repo: Path) -> Trace:
    return load(shared_traces_dir(repo) / REAL_TRACE)


def synthetic(kind: str, duration: float = 3600.0, rate: float = 4.0, seed: int = 0, mix: Mix = Mix()) -> Trace:
    """Named synthetic shapes around a mean ``rate`` (the CLI's and the benchmark's)."""
    if kind == "poisson":
        return poisson(rate, duration, mix, seed)
    if kind == "step":
        return step([rate * 0.5, rate, rate * 2.0, rate], duration / 4, mix, seed)
    if kind == "diurnal":
        return diurnal(rate, 0.8, duration, duration, mix, seed)
    if kind == "bursty":
        return bursty(rate * 2.5, rate * 0.25, duration / 12, duration / 12, duration, mix, seed)
    raise ValueError(f"unknown trace shape {kind!r}; known: poisson, step, diurnal, bursty")
