"""The performance model against kernel timings measured on H100s (Vidur's public profiling, a copy in
``../shared/calibration/vidur-h100/``): per-layer GEMMs (QKV, output projection, MLP up and down) of three
real models at 1-4096 tokens and TP 1-8, and NCCL all-reduces within a DGX H100.

The data sheet's efficiencies miss these by far more than 25%; the calibration fitted from them
(:class:`Calibration`, shipped as ``perf/data/calibration/H100-SXM.json``) holds most points within 25%.
Not every one: cuBLAS picks a different kernel at some token counts, and neighbouring counts (8 tokens apart)
then differ by up to 1.5x, which no smooth model follows. So the bounds are: at least 90% of the points
within 25%, the median error under 15%, and none off by 2x; the worst ratio of each op is printed."""

import statistics
from collections import defaultdict
from pathlib import Path

import pytest

from disagg.perf import measured as ms
from disagg.perf import model as pm

REPO = Path(__file__).resolve().parent.parent
VIDUR = REPO.parent / "shared" / "calibration" / "vidur-h100"
H100 = pm.gpu("h100")
WITHIN = 0.25


@pytest.fixture(scope="module")
def gemms():
    assert (VIDUR / "compute").is_dir(), f"{VIDUR} missing (the project's shared calibration data)"
    return list(ms.gemm_rows(VIDUR))


@pytest.fixture(scope="module")
def allreduces():
    return list(ms.allreduce_rows(VIDUR))


def _model(tp: int, calibration: pm.Calibration | None) -> pm.PerfModel:
    # only the GEMM and all-reduce methods are used: the shape does not matter
    return pm.PerfModel(pm.model("meta-llama/Llama-3.1-8B-Instruct"), H100, tp, calibration=calibration)


def _gemm_ratios(rows, calibration) -> dict[str, list[float]]:
    """Predicted / measured for every point, by op."""
    out: dict[str, list[float]] = defaultdict(list)
    for g in rows:
        out[g["op"]].append(_model(g["tp"], calibration).gemm_time(g["m"], g["k"], g["n"]) / g["seconds"])
    return out


def _summary(ratios: dict) -> dict:
    return {op: {"worst": max(r, key=lambda x: abs(x - 1)), "within": sum(abs(x - 1) <= WITHIN for x in r) / len(r),
                 "median_error": statistics.median(abs(x - 1) for x in r)} for op, r in ratios.items()}


def _report(title: str, summary: dict) -> str:
    lines = [title] + [f"  {op}: worst ratio {s['worst']:.2f}, {s['within']:.1%} within 25%, median error "
                       f"{s['median_error']:.1%}" for op, s in summary.items()]
    print("\n".join(lines))
    return "\n".join(lines)


def _holds(s) -> bool:
    return s["within"] >= 0.9 and s["median_error"] <= 0.15 and 0.5 <= s["worst"] <= 2.0


def test_data_sheet_efficiencies_miss_the_measured_gemms(gemms):
    summary = _summary(_gemm_ratios(gemms, None))
    text = _report("data sheet (MFU 0.5, MBU 0.7, no calibration):", summary)
    assert set(summary) == {"qkv", "o", "gate_up", "down"}
    # why the calibration exists: every op has points off by more than 25%, most of them
    assert all(s["within"] < 0.7 and abs(s["worst"] - 1) > WITHIN for s in summary.values()), text


def test_calibrated_gemm_times_are_within_25_percent(gemms):
    summary = _summary(_gemm_ratios(gemms, pm.shipped_calibration("H100-SXM")))
    text = _report("shipped H100 calibration (fitted to 19 of the 259 token counts):", summary)
    assert all(_holds(s) for s in summary.values()), text


def test_calibration_predicts_a_model_it_was_not_fitted_to(gemms):
    """Fitted to two of the models, checked on the third: the fit is the hardware's, not one shape's."""
    names = sorted({g["model"] for g in gemms})
    assert len(names) == 3
    for held_out in names:
        cal = ms.read_vidur(VIDUR, models=set(names) - {held_out}, tokens=set(ms.SHIPPED_TOKENS))
        summary = _summary(_gemm_ratios([g for g in gemms if g["model"] == held_out], cal))
        text = _report(f"fitted without {held_out}:", summary)
        assert all(s["within"] >= 0.85 and s["median_error"] <= 0.15 and 0.5 <= s["worst"] <= 2.0
                   for s in summary.values()), text


def test_allreduce_times_within_25_percent(allreduces):
    cal = pm.shipped_calibration("H100-SXM")
    calibrated, sheet = defaultdict(list), defaultdict(list)
    for p in allreduces:
        calibrated[f"all-reduce TP{p['workers']}"].append(_model(p["workers"], cal).allreduce_time(p["bytes"]) / p["seconds"])
        sheet[f"all-reduce TP{p['workers']}"].append(_model(p["workers"], None).allreduce_time(p["bytes"]) / p["seconds"])
    old = _report("data sheet (8 us + ring at 80% of NVLink):", _summary(sheet))
    assert all(s["within"] < 0.5 for s in _summary(sheet).values()), old
    summary = _summary(calibrated)
    text = _report("shipped H100 calibration:", summary)
    assert set(summary) == {"all-reduce TP2", "all-reduce TP4", "all-reduce TP8"}
    # the worst is one point: TP2's smallest message (7 us) under a floor of ~38 us every other small one shows
    assert all(s["within"] >= 0.9 and s["median_error"] <= 0.10 for s in summary.values()), text
    assert all(abs(r - 1) <= WITHIN for r in calibrated["all-reduce TP8"][len(calibrated["all-reduce TP8"]) // 2:]), text


def test_the_model_plans_with_the_calibration_for_h100_only():
    cal = pm.shipped_calibration("H100-SXM")
    assert cal is not None and pm.shipped_calibration("H200-SXM") is None
    m = pm.PerfModel.analytic("meta-llama/Llama-3.1-70B-Instruct", "h100", tp=4)   # the default: calibrated
    assert m.calibration is cal and m.eff == cal.efficiency(H100)
    assert 0.6 < m.eff.prefill_mfu < 0.8 and 0.7 < m.eff.decode_mbu <= 1.0
    sheet = pm.PerfModel.analytic("meta-llama/Llama-3.1-70B-Instruct", "h100", tp=4, measured=False)
    assert sheet.calibration is None and sheet.eff == pm.default_efficiency()
    # a prefill chunk's all-reduces (32 MiB here) are NCCL's: measured
    tokens = 2048
    assert tokens * m.shape.hidden * 2 > pm.CUSTOM_ALLREDUCE_MAX_BYTES
    assert m.tp_comm_time(tokens) == pytest.approx(
        2 * m.shape.layers * cal.allreduce_seconds(4, tokens * m.shape.hidden * 2))
    # a decode step's (32 sequences: 512 KiB) are vLLM's custom all-reduce, well under NCCL's measured floor
    batch = 32
    assert m.tp_comm_time(batch) == pytest.approx(2 * m.shape.layers * m.custom_allreduce_time(batch * m.shape.hidden * 2))
    assert all(m.tp_comm_time(t) <= 2 * m.shape.layers * cal.allreduce_seconds(4, t * m.shape.hidden * 2) + 1e-12
               for t in (1, 32, 256, 511))
    assert m.tp_comm_time(batch) < 0.5 * 2 * m.shape.layers * cal.allreduce_seconds(4, batch * m.shape.hidden * 2)
    # more tokens never communicate faster, across the switch from custom all-reduce to NCCL too
    times = [m.tp_comm_time(t) for t in (1, 64, 256, 511, 512, 513, 1024, 4096, 16384)]
    assert times == sorted(times)
    # no measurements for this GPU: the data sheet, unchanged
    h200 = pm.PerfModel.analytic("meta-llama/Llama-3.1-70B-Instruct", "h200", tp=4)
    assert h200.calibration is None and h200.eff == pm.default_efficiency()
    # nor for weights of another width than the one measured
    assert pm.planning_calibration(H100, dtype_bytes=1) is None and pm.planning_calibration(H100) is cal
    # never faster than the hardware, whatever the fit
    for mm, k, n in [(1, 8192, 1280), (4096, 8192, 57344), (100000, 8192, 8192)]:
        t = m.gemm_time(mm, k, n)
        assert t >= 2 * mm * k * n / H100.flops and t >= 2 * (k * n + mm * (k + n)) / H100.hbm_bandwidth


def test_shipped_file_is_what_the_data_gives(tmp_path):
    out = tmp_path / "H100-SXM.json"
    assert ms.main([str(VIDUR), str(out)]) == 0
    assert out.read_text() == (pm.CALIBRATIONS / "H100-SXM.json").read_text(), \
        "perf/data/calibration/H100-SXM.json drifted: python -m disagg.perf.measured DIR OUT"


def test_the_configurator_plans_with_the_same_calibration():
    """The one choice (perfmodel.planning_calibration) for the planner, the simulator and the configurator."""
    from disagg.configurator import estimate as est

    base = dict(model="meta-llama/Llama-3.1-8B-Instruct", gpu="h100", gpus=8, isl=3000, osl=300,
                ttft_ms=1000, itl_ms=40)
    setup = est.Setup.of(est.Inputs(**base))
    assert setup.calibration is pm.shipped_calibration("H100-SXM")
    assert any("calibration shipped for this GPU" in n for n in setup.notes)
    planner = pm.PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "h100", tp=2)
    assert setup.model(2).ttft(3000) == pytest.approx(planner.ttft(3000))
    assert setup.model(2).itl(32, 3150) == pytest.approx(planner.itl(32, 3150))
    assert est.Setup.of(est.Inputs(**{**base, "precision": "fp8"})).calibration is None
    assert est.Setup.of(est.Inputs(**{**base, "gpu": "h200"})).calibration is None
