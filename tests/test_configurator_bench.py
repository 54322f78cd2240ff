"""bench/gpu_kernels_calibrate.py tried out on the CPU with the worker environment's PyTorch (--quick,
small kernels): it runs, and what it writes is a calibration file the performance model loads. The real
calibration needs a GPU and never runs in tests."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from disagg.perf import model as pm

REPO = Path(__file__).resolve().parent.parent


def test_calibration_script_runs_on_cpu_and_writes_a_loadable_file(worker_python, tmp_path):  # noqa: F811
    config = {"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 256, "vocab_size": 512, "torch_dtype": "float32"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "cal.json"
    run = subprocess.run([worker_python, str(REPO / "bench" / "gpu_kernels_calibrate.py"), "--gpu", "h100",
                          "--model", str(tmp_path), "--device", "cpu", "--quick", "--repeat", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    cal = pm.Calibration.load(out)
    assert cal.gpu == "H100-SXM" and "not a GPU" in cal.device and cal.measured_at
    assert cal.gemm and cal.attention and all(p["seconds"] > 0 for p in cal.gemm + cal.attention)
    doc = json.loads(out.read_text())
    assert doc["torch"] and doc["model"]
    eff = cal.efficiency(pm.gpu("h100"))   # a CPU is far slower than an H100: tiny but valid efficiencies
    assert 0 < eff.prefill_mfu <= 1 and 0 < eff.decode_mbu <= 1
