"""``disagg configure``: the frontiers for a model, GPU and SLO; CSV, PNG and the best layout's YAML."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from .estimate import Inputs, configure


def add_arguments(p: Any) -> None:
    p.add_argument("--model", help="a known model name (perf/data/models.yaml, any case, with or without the "
                                   "organisation) or a Hugging Face config.json (file or directory)")
    p.add_argument("--gpu", default="h100", help="GPU name or alias: h100, h200, b200, a100, l40s, ... "
                                                  "(perf/data/gpus.yaml)")
    p.add_argument("--gpus", type=int, default=8, help="GPU budget")
    p.add_argument("--isl", type=int, default=3000, help="input (prompt) tokens per request")
    p.add_argument("--osl", type=int, default=150, help="output tokens per request")
    p.add_argument("--ttft-ms", type=float, default=500.0, help="time-to-first-token target at the percentile")
    p.add_argument("--itl-ms", type=float, default=50.0, help="inter-token latency target at the percentile")
    p.add_argument("--percentile", type=float, default=90.0, help="SLO percentile")
    p.add_argument("--interconnect", default="infiniband",
                   help="KV transfer link: nvlink, infiniband, ethernet (RoCE), or a perf/data/gpus.yaml name")
    p.add_argument("--prefix-reuse", type=float, default=0.0, help="share of prompt tokens already cached (0..1)")
    p.add_argument("--precision", choices=["bf16", "fp8"], default="bf16", help="weights and KV cache")
    p.add_argument("--max-batch", type=int, default=512, help="most requests per worker (vLLM --max-num-seqs)")
    p.add_argument("--max-batched-tokens", type=int, default=8192,
                   help="largest prefill chunk budget an aggregated worker may use a step")
    p.add_argument("--max-tp", type=int, default=8, help="largest tensor-parallel size (a replica wider than a "
                                                           "node spans whole-node pods inside one NVLink domain)")
    p.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of one node (a pod takes at most these)")
    p.add_argument("--domain-gpus", type=int, default=0,
                   help="GPUs of one NVLink domain (0: one node; an NVL72 rack: 72); tensor parallel stays inside it")
    p.add_argument("--max-data", type=int, default=256,
                   help="most data-parallel ranks (= expert-parallel GPUs) of one replica of a mixture-of-experts model")
    p.add_argument("--calibration", help="kernel calibration file (bench/gpu_kernels_calibrate.py) for this GPU")
    p.add_argument("--profile", help="measured profile (disagg profile) that replaces the analytic estimate")
    p.add_argument("--out", default="configure-out", help="directory for frontier.csv, frontier.png, "
                                                           "deployment.yaml and summary.json")
    p.add_argument("--name", help="metadata.name of the DisaggDeployment (default: from the model)")
    p.add_argument("--namespace", help="metadata.namespace of the DisaggDeployment")
    p.add_argument("--source", help="spec.model.source (default: hf://<model> for known models)")
    p.add_argument("--serve", action="store_true", help="serve the web page instead (same inputs, same code)")
    p.add_argument("--host", default="127.0.0.1", help="address the page listens on (--serve)")
    p.add_argument("--port", type=int, default=8090, help="port of the page (--serve)")


def inputs_from_args(args: Any) -> Inputs:
    return Inputs(model=args.model, gpu=args.gpu, gpus=args.gpus, isl=args.isl, osl=args.osl, ttft_ms=args.ttft_ms,
                  itl_ms=args.itl_ms, percentile=args.percentile, interconnect=args.interconnect,
                  prefix_reuse=args.prefix_reuse, precision=args.precision, max_batch=args.max_batch,
                  max_batched_tokens=args.max_batched_tokens, max_tp=args.max_tp, calibration=args.calibration,
                  gpus_per_node=args.gpus_per_node, domain_gpus=args.domain_gpus, max_data=args.max_data,
                  profile=args.profile)


def run_cli(args: Any) -> int:
    from . import manifest, report

    if args.serve:
        from .web import serve

        serve(args.host, args.port, defaults=args)
        return 0
    if not args.model:
        print("disagg configure: --model is required (a known name or a config.json)", file=sys.stderr)
        return 2
    try:
        result = configure(inputs_from_args(args))
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"disagg configure: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(report.table(result))
    paths = [report.write_csv(result, out / "frontier.csv"), report.plot(result, out / "frontier.png")]
    summary = result.summary()
    summary["gains"] = [{"tokens_per_s_per_user": s, "aggregated": a, "disaggregated": d, "ratio": r}
                        for s, a, d, r in report.gains(result)]
    if result.best is not None:
        path = out / "deployment.yaml"
        path.write_text(manifest.to_yaml(result, result.best, name=args.name, namespace=args.namespace,
                                         source=args.source))
        paths.append(path)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    paths.append(out / "summary.json")
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if result.best is not None else 1
