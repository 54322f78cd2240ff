"""Kernel timings measured on real GPUs, in the performance model's :class:`~.model.Calibration` form.

Vidur's public H100 profiling (``microsoft/vidur``, ``data/profiling/``, MIT; the project keeps a copy in
``../shared/calibration/vidur-h100/``, its README says what each column is) times one transformer layer's
GEMMs for three models at 1-4096 tokens and TP 1-8, and NCCL all-reduces within a DGX H100 (NVSwitch).
:func:`read_vidur` turns those files into a calibration (every point); ``python -m disagg.perf.measured
DIR`` writes the subset the package ships as ``data/calibration/H100-SXM.json`` (the fits need far fewer
points than the files hold). tests/test_calibration_h100.py checks the model against every point.

GEMM points with at least :data:`PREFILL_TOKENS` tokens count as prefill kernels (they set the calibrated
prefill MFU), those with at most :data:`DECODE_TOKENS` as decode kernels (weight-read bound: decode MBU);
the ones between (phase ``ridge``) only shape :meth:`~.model.Calibration.gemm_seconds`.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any, Iterator

from .model import Calibration, ModelShape

# Vidur's per-layer op names -> the model's (ModelShape.layer_gemms)
GEMM_OPS = {"attn_pre_proj": "qkv", "attn_post_proj": "o", "mlp_up_proj": "gate_up", "mlp_down_proj": "down"}
PREFILL_TOKENS = 1024
DECODE_TOKENS = 64
SOURCE = {"source": "Vidur H100 profiling (github.com/microsoft/vidur data/profiling, commit "
                    "7d47513363ec447a741ac5e47241580b47724fbf, MIT): per-layer GEMM medians, DGX H100 all-reduce and send/recv medians"}
# the shipped subset: these token counts, every tenth all-reduce size
SHIPPED_TOKENS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def vidur_shape(row: dict[str, str], name: str) -> ModelShape:
    """The model shape a Vidur compute row describes (only what the layer GEMMs need is meaningful)."""
    heads, hidden = int(row["n_head"]), int(row["n_embd"])
    return ModelShape(name, 1, hidden, heads, int(row["n_kv_head"]), int(row["n_expanded_embd"]),
                      int(row["vocab_size"]), 0.0)


def gemm_rows(root: Path) -> Iterator[dict[str, Any]]:
    """Every measured GEMM: ``{model, op, tp, m, k, n, seconds}`` (the median)."""
    for path in sorted((root / "compute").glob("*.mlp.csv")):
        name = path.name.removesuffix(".mlp.csv")
        with path.open() as f:
            for row in csv.DictReader(f):
                tp = int(row["num_tensor_parallel_workers"])
                shapes = {op: (k, n) for op, k, n in vidur_shape(row, name).layer_gemms(tp)}
                for col, op in GEMM_OPS.items():
                    k, n = shapes[op]
                    yield {"model": name, "op": op, "tp": tp, "m": int(row["num_tokens"]), "k": k, "n": n,
                           "seconds": float(row[f"time_stats.{col}.median"]) / 1000}


def allreduce_rows(root: Path, topology: str = "h100_dgx") -> Iterator[dict[str, Any]]:
    """Every measured all-reduce: ``{workers, bytes, seconds}`` (16-bit elements, the median)."""
    with (root / "network" / f"{topology}.all_reduce.csv").open() as f:
        for row in csv.DictReader(f):
            yield {"workers": int(row["num_workers"]), "bytes": 2 * int(row["size"]),
                   "seconds": float(row["time_stats.all_reduce.median"]) / 1000}


def sendrecv_rows(root: Path, topology: str = "h100_dgx") -> Iterator[dict[str, Any]]:
    """Every measured send/recv between two GPUs: ``{crossNode, bytes, seconds}`` (the median). Vidur's
    ``devices_per_node`` 1 puts the two ranks on two nodes (the network), 2 on one node (NVLink)."""
    with (root / "network" / f"{topology}.send_recv.csv").open() as f:
        for row in csv.DictReader(f):
            yield {"crossNode": int(row["devices_per_node"]) == 1, "bytes": 2 * int(row["size"]),
                   "seconds": float(row["time_stats.send_recv.median"]) / 1000}


def _phase(m: int) -> str:
    return "prefill" if m >= PREFILL_TOKENS else "decode" if m <= DECODE_TOKENS else "ridge"


def _gemm_point(g: dict[str, Any]) -> dict[str, Any]:
    return {"phase": _phase(g["m"]), "op": g["op"],
            "m": g["m"], "k": g["k"], "n": g["n"], "seconds": g["seconds"]}


def read_vidur(root: Path, models: set[str] | None = None, tokens: set[int] | None = None,
               allreduce_every: int = 1) -> Calibration:
    """A calibration from Vidur's files: the GEMMs of ``models`` (all by default) at ``tokens`` (all), and
    every ``allreduce_every``-th all-reduce size."""
    gemm = [_gemm_point(g) for g in gemm_rows(root)
            if (models is None or g["model"] in models) and (tokens is None or g["m"] in tokens)]
    ar = [p for i, p in enumerate(allreduce_rows(root)) if i % allreduce_every == 0]
    sr = [p for i, p in enumerate(sendrecv_rows(root)) if i % allreduce_every == 0]
    return Calibration("H100-SXM", "NVIDIA H100 80GB HBM3 (Vidur's DGX H100)",
                       "Vidur commit 7d47513 or before", 2, tuple(gemm), (),
                       dict(SOURCE), tuple(ar), tuple(sr))


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if len(args) != 2:
        print("usage: python -m disagg.perf.measured VIDUR_DIR OUT.json", file=sys.stderr)
        return 2
    cal = read_vidur(Path(args[0]), tokens=set(SHIPPED_TOKENS), allreduce_every=10)
    Path(args[1]).write_text(json.dumps(cal.to_dict(), separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
