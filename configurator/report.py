"""The frontiers as a side-by-side table, a CSV and a PNG plot."""

from __future__ import annotations

import csv
import math
from itertools import zip_longest
from pathlib import Path

from .estimate import Estimate, Result, frontier_value

CSV_COLUMNS = ["mode", "layout", "prefill_tp", "prefill_data", "prefill_pods", "prefill_workers", "decode_tp",
               "decode_data", "decode_pods", "decode_workers", "expert_parallel", "replicas", "gpus",
               "batch", "chunk_tokens", "tokens_per_s_per_gpu", "tokens_per_s_per_user", "ttft_ms", "itl_ms",
               "itl_mean_ms", "request_rate", "prefill_utilization", "kv_transfer_ms", "meets_slo", "best"]

USER_SPEEDS = (10, 20, 30, 50, 75, 100, 125, 150)   # tokens/s/user at which the gain is tabulated


def _row(e: Estimate, best: Estimate | None) -> dict[str, object]:
    return {"mode": e.mode, "layout": e.layout, "prefill_tp": e.prefill_tp, "prefill_data": e.prefill_data,
            "prefill_pods": e.prefill_pods, "prefill_workers": e.prefill_workers, "decode_tp": e.decode_tp,
            "decode_data": e.decode_data, "decode_pods": e.decode_pods, "decode_workers": e.decode_workers,
            "expert_parallel": e.expert_parallel, "replicas": e.replicas, "gpus": e.gpus,
            "batch": e.batch, "chunk_tokens": e.chunk_tokens,
            "tokens_per_s_per_gpu": round(e.tokens_per_s_per_gpu, 3),
            "tokens_per_s_per_user": round(e.tokens_per_s_per_user, 3), "ttft_ms": round(e.ttft_s * 1000, 2),
            "itl_ms": round(e.itl_s * 1000, 3), "itl_mean_ms": round(e.itl_mean_s * 1000, 3),
            "request_rate": round(e.request_rate, 4), "prefill_utilization": round(e.prefill_utilization, 4),
            "kv_transfer_ms": round(e.kv_transfer_s * 1000, 3), "meets_slo": e.meets_slo, "best": e == best}


def write_csv(result: Result, path: str | Path) -> Path:
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
        w.writeheader()
        for e in result.aggregated + result.disaggregated:
            w.writerow(_row(e, result.best))
    return path


def gains(result: Result) -> list[tuple[float, float, float, float | None]]:
    """(tokens/s/user, aggregated tokens/s/GPU, disaggregated tokens/s/GPU, ratio) along the frontiers."""
    out = []
    speeds = sorted(set(USER_SPEEDS) | {round(1000.0 / result.inputs.itl_ms, 1)})
    for s in speeds:
        a, d = frontier_value(result.aggregated, s), frontier_value(result.disaggregated, s)
        if a or d:
            out.append((s, a, d, d / a if a and d else None))
    return out


def _ratio(a: float, d: float, r: float | None) -> str:
    return f"{r:.2f}x" if r is not None else ("aggregated only" if a else "disaggregated only")


def table(result: Result) -> str:
    """Both frontiers side by side (fastest per user first), the best layout, the gain along the frontier."""
    i, s = result.inputs, result.setup
    lines = [f"{s.shape.name} on up to {i.gpus} x {s.hw.name} ({i.precision}), ISL {i.isl} / OSL {i.osl}, "
             f"prefix reuse {i.prefix_reuse:.0%}, KV over {s.link.name}; "
             f"SLO TTFT <= {i.ttft_ms:g} ms, ITL <= {i.itl_ms:g} ms at p{i.percentile:g}"]
    lines += [f"note: {n}" for n in s.notes]
    lines.append("Pareto frontiers (layouts meeting the TTFT target; * also meets ITL; <= best): "
                 "tokens/s/user, output tokens/s/GPU, layout, batch, TTFT/ITL ms at the percentile")
    w = max([28] + [len(e.layout) for e in result.aggregated + result.disaggregated])   # multi-node layouts
    head = f"{'user':>6} {'/GPU':>7}  {'layout':<{w}} {'b':>5} {'TTFT':>5} {'ITL':>6}  "
    lines.append(f"{'aggregated':<{len(head)}}| disaggregated")
    lines.append(head + "| " + head)

    def cell(e: Estimate | None) -> str:
        if e is None:
            return " " * len(head)
        mark = "<=" if e == result.best else ("* " if e.meets_slo else "  ")
        return (f"{e.tokens_per_s_per_user:6.1f} {e.tokens_per_s_per_gpu:7.1f}  {e.layout:<{w}} {e.batch:>5} "
                f"{e.ttft_s * 1000:5.0f} {e.itl_s * 1000:6.1f}{mark}")

    for a, d in zip_longest(result.aggregated[::-1], result.disaggregated[::-1]):
        lines.append(cell(a) + "| " + cell(d))
    b = result.best
    if b is None:
        lines.append("no layout meets both SLO targets within the budget")
    else:
        lines.append(f"best meeting the SLO: {b.mode} {b.layout} ({b.gpus} GPUs), {b.batch} requests per decode "
                     f"worker: {b.tokens_per_s_per_gpu:.1f} tokens/s/GPU, {b.tokens_per_s_per_user:.1f} tokens/s/user, "
                     f"TTFT {b.ttft_s * 1000:.0f} ms, ITL {b.itl_s * 1000:.1f} ms")
    for label, e in (("aggregated", result.best_aggregated), ("disaggregated", result.best_disaggregated)):
        if e is not None and e != b:
            lines.append(f"best {label}: {e.layout}: {e.tokens_per_s_per_gpu:.1f} tokens/s/GPU, "
                         f"{e.tokens_per_s_per_user:.1f} tokens/s/user")
    g = gains(result)
    if g:
        lines.append("disaggregated / aggregated tokens/s/GPU at a fixed tokens/s/user (frontiers, TTFT met): "
                     + ", ".join(f"{sp:g}: {_ratio(a, d, r)}" for sp, a, d, r in g))
    return "\n".join(lines)


def plot(result: Result, path: str | Path) -> Path:
    """tokens/s/GPU against tokens/s/user for both frontiers, the ITL target and the best layout marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    i, s = result.inputs, result.setup
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for front, label, color in ((result.aggregated, "aggregated", "tab:blue"),
                                (result.disaggregated, "disaggregated", "tab:orange")):
        if not front:
            continue
        ok = [e for e in front if e.meets_slo]
        bad = [e for e in front if not e.meets_slo]
        for part, style in ((ok, "-"), (bad, ":")):     # each part is a staircase of its own
            ax.step([e.tokens_per_s_per_user for e in part], [e.tokens_per_s_per_gpu for e in part], where="pre",
                    color=color, alpha=0.5, linestyle=style)
        ax.scatter([e.tokens_per_s_per_user for e in ok], [e.tokens_per_s_per_gpu for e in ok], color=color,
                   label=f"{label} (meets SLO)", zorder=3)
        ax.scatter([e.tokens_per_s_per_user for e in bad], [e.tokens_per_s_per_gpu for e in bad],
                   facecolors="none", edgecolors=color, label=f"{label} (misses ITL)", zorder=3)
    ax.axvline(1000.0 / i.itl_ms, color="red", linewidth=0.8, linestyle="--", label=f"1 / ITL target")
    b = result.best
    if b is not None:
        ax.scatter([b.tokens_per_s_per_user], [b.tokens_per_s_per_gpu], marker="*", s=300, color="gold",
                   edgecolors="black", zorder=4, label=f"best: {b.layout}")
    ax.set_xlabel("tokens/s/user (1 / mean ITL)")
    ax.set_ylabel("output tokens/s/GPU")
    ax.set_title(f"{s.shape.name}, {i.gpus} x {s.hw.name}, ISL {i.isl} / OSL {i.osl}, "
                 f"TTFT <= {i.ttft_ms:g} ms, ITL <= {i.itl_ms:g} ms (p{i.percentile:g})", fontsize=9)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def fmt(v: float | None) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v:.2f}"
