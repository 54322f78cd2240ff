"""GPU only (never run by tests): time the kernels that dominate each phase on this GPU with PyTorch and
write the calibration file the performance model uses in place of the data sheet's efficiencies
(``disagg configure --calibration FILE``; :class:`disagg.perf.model.Calibration`).

Needs a CUDA GPU and a Python with PyTorch (the control-plane venv has none; the worker image's does):

    python bench/gpu_kernels_calibrate.py --gpu h200 --model Qwen/Qwen2.5-32B-Instruct --tp 1 --out calib-h200.json

What is timed, for one tensor-parallel shard of the model (``--tp``):

* prefill: the model's GEMMs (QKV, O, gate+up, down) at prompt-sized token counts, and causal attention
  (``scaled_dot_product_attention``, flash kernels) at several prompt lengths;
* decode: the same GEMMs at decode batch sizes (weight-read bound), and one-query attention against
  several cached context lengths (KV-read bound).

Each kernel is timed with CUDA events after warm-up (median of ``--repeat``). The file records which GPU
(the data-file name and the device's own name), when, and the torch/CUDA versions; the performance model
derives prefill MFU (FLOPs / time / peak) and decode MBU (bytes / time / peak) from the raw timings.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Callable

try:
    from disagg.perf import model as pm
except ImportError:  # a Python without the disagg package (a worker image's): the model's file itself
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "disagg_perfmodel", Path(__file__).resolve().parent.parent / "perf" / "model.py")
    pm = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = pm
    _spec.loader.exec_module(pm)

PREFILL_TOKENS = (512, 1024, 2048, 4096, 8192)
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
PREFILL_CONTEXTS = (1024, 4096, 8192)
DECODE_CONTEXTS = (1024, 4096, 16384)
DECODE_ATTENTION_BATCH = 32
QUICK = {"prefill_tokens": (128, 512), "decode_batches": (1, 8), "prefill_contexts": (256, 1024),
         "decode_contexts": (256, 1024)}   # --quick: a few small kernels, to try the script out on a CPU

Timer = Callable[[dict[str, Any]], float]


def gemm_shapes(shape: pm.ModelShape, tp: int) -> list[tuple[str, int, int]]:
    """(name, k, n) of one layer's GEMMs on one TP rank (column-parallel QKV and gate+up, row-parallel O
    and down): the performance model's own list."""
    return shape.layer_gemms(tp)


def plan(shape: pm.ModelShape, tp: int, prefill_tokens=PREFILL_TOKENS, decode_batches=DECODE_BATCHES,
         prefill_contexts=PREFILL_CONTEXTS, decode_contexts=DECODE_CONTEXTS) -> dict[str, list[dict[str, Any]]]:
    """Every kernel to time (without its seconds)."""
    heads, kv = shape.heads // tp, max(shape.kv_heads // tp, 1)
    gemm = []
    for name, k, n in gemm_shapes(shape, tp):
        gemm += [{"phase": "prefill", "op": name, "m": m, "k": k, "n": n} for m in prefill_tokens]
        gemm += [{"phase": "decode", "op": name, "m": m, "k": k, "n": n} for m in decode_batches]
    attention = [{"phase": "prefill", "batch": 1, "q_tokens": c, "context": c, "heads": heads, "kv_heads": kv,
                  "head_dim": shape.head_dim} for c in prefill_contexts]
    attention += [{"phase": "decode", "batch": DECODE_ATTENTION_BATCH, "q_tokens": 1, "context": c, "heads": heads,
                   "kv_heads": kv, "head_dim": shape.head_dim} for c in decode_contexts]
    return {"gemm": gemm, "attention": attention}


def torch_timer(device: str = "cuda", dtype: str = "bf16", warmup: int = 3, repeat: int = 10) -> Timer:
    """Times one planned kernel on ``device`` (CUDA events on a GPU, wall clock elsewhere)."""
    import time

    import torch
    import torch.nn.functional as F

    tdtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    cuda = device.startswith("cuda")

    def once(fn: Callable[[], Any]) -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / 1000.0
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    def timer(spec: dict[str, Any]) -> float:
        if "m" in spec:
            a = torch.randn(spec["m"], spec["k"], device=device, dtype=tdtype)
            w = torch.randn(spec["k"], spec["n"], device=device, dtype=tdtype)
            fn = lambda: a @ w  # noqa: E731
        else:
            b, q, c = spec["batch"], spec["q_tokens"], spec["context"]
            h, kvh, hd = spec["heads"], spec["kv_heads"], spec["head_dim"]
            qt = torch.randn(b, h, q, hd, device=device, dtype=tdtype)
            kt = torch.randn(b, kvh, c, hd, device=device, dtype=tdtype)
            vt = torch.randn(b, kvh, c, hd, device=device, dtype=tdtype)
            causal = q == c
            gqa = {"enable_gqa": True} if h != kvh else {}
            try:  # grouped-query attention natively (torch >= 2.5): K/V read once per KV head
                F.scaled_dot_product_attention(qt[:, :, :1], kt[:, :, :1], vt[:, :, :1], **gqa)
            except TypeError:  # older torch: materialise the repeated heads (reads more than the model counts)
                kt, vt = kt.repeat_interleave(h // kvh, dim=1), vt.repeat_interleave(h // kvh, dim=1)
                gqa = {}
            fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)  # noqa: E731
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize()
        return statistics.median(once(fn) for _ in range(repeat))

    return timer


def measure(kernels: dict[str, list[dict[str, Any]]], timer: Timer) -> dict[str, list[dict[str, Any]]]:
    return {kind: [{**spec, "seconds": float(timer(spec))} for spec in specs] for kind, specs in kernels.items()}


def build(gpu: str, model: str, tp: int, timer: Timer, device_name: str, dtype: str = "bf16",
          versions: dict[str, str] | None = None, when: dt.datetime | None = None,
          quick: bool = False) -> dict[str, Any]:
    """The calibration file's content; its efficiencies as the performance model will derive them."""
    hw = pm.gpu(gpu)
    shape = _shape(model)
    timed = measure(plan(shape, tp, **(QUICK if quick else {})), timer)
    doc = {"gpu": hw.name, "device": device_name,
           "measuredAt": (when or dt.datetime.now(dt.timezone.utc)).isoformat(timespec="seconds"),
           "dtypeBytes": {"bf16": 2, "fp16": 2, "fp32": 4}[dtype], "model": shape.name,
           "tensorParallelSize": tp, "dtype": dtype, **(versions or {}), **timed}
    cal = pm.Calibration.from_dict(doc)
    doc["derived"] = {"prefillMfu": cal.prefill_mfu(hw), "decodeMbu": cal.decode_mbu(hw),
                      "note": "recomputed from the timings by the performance model; informational here"}
    return doc


def _shape(model: str) -> pm.ModelShape:
    try:
        return pm.model(model)
    except KeyError:
        return pm.model_from_config(model)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", required=True, help="the GPU's perf/data/gpus.yaml name or alias (h100, h200, ...)")
    p.add_argument("--model", default="Qwen/Qwen2.5-32B-Instruct",
                   help="a known model name or a config.json: whose GEMM and attention shapes to time")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size the shapes are sharded for")
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("--device", default="cuda", help="torch device (cuda; cpu only to try the script out)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="a few small kernels only (trying the script out)")
    p.add_argument("--out", default="calibration.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        import torch
    except ImportError:
        print("needs PyTorch (and a CUDA GPU): run it with the worker image's Python", file=sys.stderr)
        return 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: this script times GPU kernels", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{args.device} (not a GPU)"
    versions = {"torch": torch.__version__, "cuda": str(torch.version.cuda)}
    doc = build(args.gpu, args.model, args.tp, torch_timer(args.device, args.dtype, repeat=args.repeat), name,
                args.dtype, versions, quick=args.quick)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    d = doc["derived"]
    print(f"wrote {args.out}: {doc['gpu']} ({name}) at {doc['measuredAt']}: prefill MFU {d['prefillMfu']:.2f}, "
          f"decode MBU {d['decodeMbu']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
