"""The performance model: physical bounds, shapes of the curves, profiles, online correction."""

import math
from dataclasses import replace

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from disagg.perf import model as pm

MODELS = pm.known_models()
GPUS = pm.known_gpus()

tokens = st.integers(min_value=1, max_value=131072)
cached = st.integers(min_value=0, max_value=65536)
batch = st.integers(min_value=1, max_value=64)
tp = st.sampled_from([1, 2, 4, 8])
scale = st.floats(min_value=0.01, max_value=10)


def test_data_files_carry_sources_and_sane_numbers():
    gpus = yaml.safe_load((pm.DATA / "gpus.yaml").read_text())
    models = yaml.safe_load((pm.DATA / "models.yaml").read_text())
    for name, g in gpus["gpus"].items():
        assert g["source"], name
        assert 1e14 < g["flops_bf16"] < 1e16 and 1e11 < g["hbm_bandwidth"] < 2e13, name
    for name, m in models["models"].items():
        assert m["source"], name
        assert m["hidden"] % m["heads"] == 0 and m["heads"] % m["kv_heads"] == 0, name
    for name, link in gpus["interconnects"].items():
        assert link["source"] and 0 < link["efficiency"] <= 1, name
    assert "H100-SXM" in GPUS and "meta-llama/Llama-3.1-8B-Instruct" in MODELS


def test_unknown_names_are_refused_with_the_known_ones():
    with pytest.raises(KeyError, match="H100-SXM"):
        pm.gpu("H9000")
    with pytest.raises(KeyError, match="Llama"):
        pm.model("gpt-9")


def test_kv_bytes_per_token_from_the_shape():
    # Llama-3.1-8B: 2 (K,V) x 32 layers x 8 KV heads x 128 head_dim x 2 bytes = 128 KiB per token
    assert pm.model("meta-llama/Llama-3.1-8B-Instruct").kv_bytes_per_token == 131072


@settings(max_examples=200, deadline=None)
@given(m=st.sampled_from(MODELS), g=st.sampled_from(GPUS), tp=tp, n=tokens, c=cached, b=batch, s=scale)
def test_prefill_never_beats_peak_flops(m, g, tp, n, c, b, s):
    model = pm.PerfModel.analytic(m, g, tp).corrected(prefill_scale=s)
    t = model.prefill_time([(n, c)] * b)
    assert t > 0
    assert b * model.prefill_flops(n, c) / t <= tp * model.hw.flops * (1 + 1e-9)


@settings(max_examples=200, deadline=None)
@given(m=st.sampled_from(MODELS), g=st.sampled_from(GPUS), tp=tp, b=batch, ctx=tokens, s=scale)
def test_decode_never_reads_faster_than_hbm(m, g, tp, b, ctx, s):
    model = pm.PerfModel.analytic(m, g, tp).corrected(decode_scale=s)
    t = model.itl(b, ctx)
    read = model.shape.weight_bytes + model.shape.kv_bytes_per_token * b * ctx
    assert read / t <= tp * model.hw.hbm_bandwidth * (1 + 1e-9)


@settings(max_examples=100, deadline=None)
@given(m=st.sampled_from(MODELS), g=st.sampled_from(GPUS), n=st.integers(1, 65536), b=st.integers(1, 32))
def test_latency_grows_with_prompt_batch_concurrency_and_context(m, g, n, b):
    model = pm.PerfModel.analytic(m, g)
    assert model.ttft(n + 256, batch=b) >= model.ttft(n, batch=b)
    assert model.ttft(n, batch=b + 1) >= model.ttft(n, batch=b)
    assert model.itl(b + 1, n) >= model.itl(b, n)
    assert model.itl(b, n + 1024) >= model.itl(b, n)
    # cached prefix tokens make prefill cheaper, never dearer
    assert model.ttft(n + 512, cached_tokens=512) <= model.ttft(n + 512)


def test_regimes_prefill_compute_bound_decode_memory_bound():
    model = pm.PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM")
    # long prompt: prefill runs at the configured MFU, within a few percent
    n = 8192
    mfu = model.prefill_flops(n) / model.ttft(n) / model.hw.flops
    assert 0.4 < mfu <= model.eff.prefill_mfu
    # single-stream decode: ~weights / (HBM x MBU): 16 GB / 2.35 TB/s ~ 7 ms, plus overhead
    assert 0.006 < model.itl(1, 1024) < 0.015
    # batching decode raises throughput far more than it raises ITL
    assert model.decode_throughput(32, 1024) > 10 * model.decode_throughput(1, 1024)
    assert model.itl(32, 1024) < 2 * model.itl(1, 1024)
    # TP halves compute time (roughly)
    tp2 = pm.PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM", tp=2)
    assert tp2.ttft(n) < 0.6 * model.ttft(n)


def test_kv_transfer_time_scales_with_bytes_and_link():
    model = pm.PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM")
    ib, tcp, nvl = pm.interconnect("infiniband-ndr"), pm.interconnect("tcp-25g"), pm.interconnect("nvlink")
    one_gb = 1e9
    assert model.kv_transfer_time(one_gb, ib) == pytest.approx(ib.latency_seconds + one_gb / (ib.bandwidth * ib.efficiency))
    assert model.kv_transfer_time(2 * one_gb, ib) > 1.9 * model.kv_transfer_time(one_gb, ib) - ib.latency_seconds
    assert model.kv_transfer_time(one_gb, nvl) < model.kv_transfer_time(one_gb, ib) < model.kv_transfer_time(one_gb, tcp)
    assert model.kv_transfer_time(0) == 0
    # never faster than the wire
    assert one_gb / model.kv_transfer_time(one_gb, ib, parallel_links=1) <= ib.bandwidth


def test_memory_capacity_limits_concurrency():
    model = pm.PerfModel.analytic("meta-llama/Llama-3.1-70B-Instruct", "H100-SXM", tp=1)
    assert model.kv_capacity_tokens() == 0 and model.max_concurrency(1000) == 0  # 141 GB of weights on 80 GB
    model = pm.PerfModel.analytic("meta-llama/Llama-3.1-70B-Instruct", "H100-SXM", tp=4)
    assert model.max_concurrency(4096) > 10
    b = model.max_concurrency_for_itl(0.05, 4096)
    assert b >= 1 and model.itl(b, 4096) <= 0.05 and (b == model.max_concurrency(4096) or model.itl(b + 1, 4096) > 0.05)
    assert model.max_concurrency_for_itl(1e-6, 4096) == 0


def _synthetic_profile(truth: pm.PerfModel) -> pm.Profile:
    prefill = [{"tokens": n, "batch": b, "seconds": truth.ttft(n, batch=b)} for n in (256, 1024, 4096, 16384) for b in (1, 4)]
    decode = [{"concurrency": b, "context": c, "seconds": truth.itl(b, c)} for b in (1, 8, 32, 64) for c in (512, 4096)]
    return pm.Profile("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM", 1, tuple(prefill), tuple(decode))


def test_measured_profile_overrides_the_analytic_default(tmp_path):
    analytic = pm.PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM")
    # the "real" worker is 1.6x slower than the data sheet suggests
    truth = analytic.corrected(prefill_scale=1.6, decode_scale=1.6)
    profile = _synthetic_profile(truth)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile.to_dict()))
    profiled = pm.PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM", profile=pm.Profile.load(path))
    for n in (512, 2048, 8192):
        assert profiled.ttft(n) == pytest.approx(truth.ttft(n), rel=0.1)
        assert abs(profiled.ttft(n) - truth.ttft(n)) < abs(analytic.ttft(n) - truth.ttft(n))
    for b, c in ((4, 1024), (16, 2048), (48, 4096)):
        assert profiled.itl(b, c) == pytest.approx(truth.itl(b, c), rel=0.1)


def test_profile_that_claims_faster_than_physics_is_floored():
    fast = pm.Profile("m", "g", 1, tuple({"tokens": n, "batch": 1, "seconds": 1e-6} for n in (1, 2, 3)),
                      tuple({"concurrency": b, "context": 1, "seconds": 1e-6} for b in (1, 2, 3)))
    model = pm.PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM", profile=fast)
    assert model.ttft(8192) == pytest.approx(model.prefill_floor([(8192, 0)]))
    assert model.itl(8, 1024) == pytest.approx(model.decode_floor(8, 8192))


def test_online_correction_converges_and_is_clamped():
    analytic = pm.PerfModel.analytic("meta-llama/Llama-3.1-8B-Instruct", "H100-SXM")
    truth = analytic.corrected(prefill_scale=2.0, decode_scale=0.8)
    corr = pm.OnlineCorrection()
    for _ in range(30):
        planned = analytic.corrected(corr.prefill, corr.decode)
        corr = corr.observe(truth.ttft(4096), planned.ttft(4096), truth.itl(16, 2048), planned.itl(16, 2048))
    assert corr.prefill == pytest.approx(2.0, rel=0.02)
    assert corr.decode == pytest.approx(0.8, rel=0.02)
    # missing or absurd observations do not move it; one wild sample is clamped
    assert corr.observe(None, 1.0, math.nan, 1.0) == corr
    wild = pm.OnlineCorrection(alpha=1.0).observe(1e9, 1e-9, 1e-12, 1.0)
    assert wild.prefill == pytest.approx(wild.hi) and wild.decode == pytest.approx(wild.lo)


def test_online_correction_survives_denormal_and_huge_samples():
    corr = pm.OnlineCorrection()
    assert corr.observe(5e-324, 2.0, 1e308, 1e-308).prefill >= corr.lo
    assert corr.observe(5e-324, 2.0, 1e308, 1e-308).decode <= corr.hi


def _with_handoff(*extra: float) -> pm.Profile:
    """A profile whose lone requests through the P/D path (32, 256, 768 tokens) took ``extra`` seconds beyond
    the profile's own prefill and first decode step."""
    prefill = tuple({"tokens": n, "batch": 1, "seconds": 0.01 + 50e-6 * n} for n in (32, 256, 768))
    decode = tuple({"concurrency": c, "context": 100, "seconds": 0.004 + 0.001 * c} for c in (1, 2, 4))
    bare = pm.Profile("m", "g", 1, prefill, decode)
    handoff = tuple({"tokens": n, "seconds": bare.prefill_seconds([n]) + bare.decode_seconds(1, n) + x}
                    for n, x in zip((32, 256, 768), extra))
    return pm.Profile("m", "g", 1, prefill, decode, handoff)


def test_profile_fits_the_handoff_beyond_prefill_and_the_first_step_and_keeps_it_in_its_file(tmp_path):
    profile = _with_handoff(0.1, 0.12, 0.11)
    assert profile.handoff_base == pytest.approx(0.11)
    # one slow sample does not move it (three lone requests on a shared host: 463, 530, 132 ms)
    assert _with_handoff(0.1, 0.11, 2.0).handoff_base == pytest.approx(0.11)
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(profile.to_dict()))
    assert pm.Profile.load(path).handoff_base == pytest.approx(profile.handoff_base)
    # a profile of one worker alone (every file written before the path was measured) has no hand-off
    bare = pm.Profile.from_dict({k: v for k, v in profile.to_dict().items() if k != "handoff"})
    assert bare.handoff_base is None and "handoff" not in bare.to_dict()


def test_the_measured_handoff_replaces_the_wire_time_but_never_undercuts_it():
    shape = pm.model("meta-llama/Llama-3.1-8B-Instruct")
    base = pm.PerfModel(shape, pm.gpu("H100-SXM"), 1, pm.interconnect("tcp-25g"))
    slow = replace(base, profile=_with_handoff(0.11, 0.11, 0.11))
    assert slow.handoff_time(500) == pytest.approx(0.11)
    assert base.handoff_time(500) == base.kv_transfer_time_tokens(500)
    # a path measured faster than its KV bytes can cross the link is floored at the link
    fast = replace(base, profile=_with_handoff(0.0, 0.0, 0.0))
    for n in (16, 4096, 65536):
        assert fast.handoff_time(n) == pytest.approx(base.kv_transfer_time_tokens(n))
        assert slow.handoff_time(n) >= base.kv_transfer_time_tokens(n)
    assert slow.handoff_time(65536) == pytest.approx(base.kv_transfer_time_tokens(65536))  # 8 GiB over 25 Gb/s


def test_a_prompts_own_cost_is_fitted_where_the_profile_has_batches_of_more_than_one():
    # a CPU worker (2026-12-04): 13.7 ms for 32 tokens alone, 27.2 ms for three at once
    points = [{"tokens": n, "batch": b, "seconds": 0.008 + 0.006 * b + 20e-6 * n * b}
              for n in (32, 256, 768) for b in (1, 3)]
    decode = tuple({"concurrency": c, "context": 100, "seconds": 0.004 + 0.001 * c} for c in (1, 2, 4))
    profile = pm.Profile("m", "g", 1, tuple(points), decode)
    assert profile.prefill_per_prompt == pytest.approx(0.006, rel=1e-3)
    assert profile.prefill_coef[0] == pytest.approx(0.008, rel=1e-3)
    # ten short prompts of a burst cost ten prompts' handling, not one batch's intercept
    ten = profile.prefill_seconds([32] * 10)
    assert ten == pytest.approx(0.008 + 0.06 + 20e-6 * 320, rel=1e-3)
    assert ten > 4 * profile.prefill_seconds([32])
    # a request alone is predicted as measured, and per-token growth is kept
    for p in points:
        assert profile.prefill_seconds([p["tokens"]] * p["batch"]) == pytest.approx(p["seconds"], rel=1e-3)
    # one batch size cannot tell a prompt's cost from the step's: none is fitted, the fit is as before
    alone = pm.Profile("m", "g", 1, tuple(p for p in points if p["batch"] == 1), decode)
    assert alone.prefill_per_prompt == 0.0
    assert alone.prefill_seconds([256]) == pytest.approx(0.014 + 20e-6 * 256, rel=1e-3)
