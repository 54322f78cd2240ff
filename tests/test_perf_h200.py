"""The data-sheet H200 model against the kernels measured on an H200 last session
(``bench/results/H200-SXM-kernels-2026-12-04.json``: ``bench/gpu_kernels_calibrate.py``, bf16 GEMMs of
Llama-3.1-8B, a Llama-3.1-70B TP 4 shard and Qwen2.5-32B at 1-8,192 tokens, one GPU, no all-reduce).

What it shows (the table in perf/README.md, "The H200 data sheet against one H200"): the data sheet's
prefill GEMMs are 1.2-1.6x slower than measured (MFU 0.5 where the kernels ran at ~0.72), its decode GEMMs
0.57-0.97x the measured time (MBU 0.7 where small-batch GEMMs reached ~0.55); most layers miss by more than
25%. A fit to the file holds the layers within 0.83-1.22. The default stays the data sheet (one run on one
machine, no all-reduce for TP > 1, BF16 only); ``--calibration`` with the file plans with it. The bounds
below fail if the data sheet or the file changes so that this reading no longer holds."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from disagg.perf import model as pm

REPO = Path(__file__).resolve().parent.parent
MEASURED = REPO / "bench" / "results" / "H200-SXM-kernels-2026-12-04.json"
H200 = pm.gpu("h200")
# (k, n) of each layer GEMM: qkv, o, gate_up, down of the TP shard measured
LAYERS = {"Llama-3.1-8B": {(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)},
          "Llama-3.1-70B TP4": {(8192, 2560), (2048, 8192), (8192, 14336), (7168, 8192)},
          "Qwen2.5-32B": {(5120, 7168), (5120, 5120), (5120, 55296), (27648, 5120)}}


@pytest.fixture(scope="module")
def measured():
    return json.loads(MEASURED.read_text())


def _model(calibration: pm.Calibration | None) -> pm.PerfModel:
    # gemm_time only: the shape does not matter
    eff = calibration.efficiency(H200) if calibration else pm.default_efficiency()
    return pm.PerfModel(pm.model("meta-llama/Llama-3.1-8B-Instruct"), H200, 1, eff=eff, calibration=calibration)


def layer_ratios(doc: dict, calibration: pm.Calibration | None) -> dict[tuple[str, str], list[float]]:
    """Per (model, phase): predicted / measured time of one layer's four GEMMs at each token count."""
    m = _model(calibration)
    out: dict[tuple[str, str], list[float]] = {}
    for name, shapes in LAYERS.items():
        for phase in ("prefill", "decode"):
            pts = [g for g in doc["gemm"] if g["phase"] == phase and (g["k"], g["n"]) in shapes]
            for tokens in sorted({g["m"] for g in pts}):
                at = [g for g in pts if g["m"] == tokens]
                assert len(at) == 4, (name, phase, tokens)
                out.setdefault((name, phase), []).append(
                    sum(m.gemm_time(g["m"], g["k"], g["n"]) for g in at) / sum(g["seconds"] for g in at))
    return out


def table(doc: dict) -> str:
    """The perf/README.md table: per model and phase, the range of layer ratios (data sheet; a fit to the file)."""
    sheet, fit = layer_ratios(doc, None), layer_ratios(doc, pm.Calibration.from_dict(doc))
    lines = ["| layer GEMMs (bf16, one H200) | tokens | data sheet / measured | within 25% | fit to the file / measured |",
             "|---|---|---|---|---|"]
    for (name, phase), rs in sheet.items():
        tokens = sorted({g["m"] for g in doc["gemm"] if g["phase"] == phase})
        f = fit[(name, phase)]
        lines.append(f"| {name} {phase} | {tokens[0]}-{tokens[-1]} | {min(rs):.2f}-{max(rs):.2f} "
                     f"(median {statistics.median(rs):.2f}) | {sum(abs(r - 1) <= 0.25 for r in rs)} of {len(rs)} | "
                     f"{min(f):.2f}-{max(f):.2f} |")
    return "\n".join(lines)


def test_the_data_sheet_h200_misses_the_measured_layers_both_ways(measured):
    ratios = layer_ratios(measured, None)
    print("\n" + table(measured))
    prefill = [r for (_, phase), rs in ratios.items() if phase == "prefill" for r in rs]
    decode = [r for (_, phase), rs in ratios.items() if phase == "decode" for r in rs]
    # prefill pessimistic (MFU 0.5 against ~0.72 measured), decode optimistic (MBU 0.7 against ~0.55)
    assert statistics.median(prefill) > 1.3 and min(prefill) > 1.1
    assert statistics.median(decode) < 0.8 and max(decode) < 1.0
    within = sum(abs(r - 1) <= 0.25 for r in prefill + decode) / len(prefill + decode)
    assert within < 0.4


def test_a_fit_to_the_file_holds_every_layer_within_25_percent(measured):
    cal = pm.Calibration.from_dict(measured)
    assert cal.prefill_mfu(H200) == pytest.approx(0.72, abs=0.01)
    assert cal.decode_mbu(H200) == pytest.approx(0.55, abs=0.01)
    ratios = [r for rs in layer_ratios(measured, cal).values() for r in rs]
    assert sum(abs(r - 1) <= 0.25 for r in ratios) == len(ratios)


def test_the_default_h200_plan_stays_the_data_sheet_and_the_readme_has_the_table(measured):
    assert pm.shipped_calibration("H200-SXM") is None
    h200 = pm.PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "h200")
    assert h200.calibration is None and h200.eff == pm.default_efficiency()
    assert table(measured) in (REPO / "perf" / "README.md").read_text()
