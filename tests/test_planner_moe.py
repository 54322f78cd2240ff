"""The planner and the simulator size a data-parallel, expert-parallel replica of a mixture-of-experts model
with the multi-node terms (disagg.perf.parallel.DataParallelEngine, built by role_engine: imported, never
copied), not as a dense engine of its tensor size, and scale such replicas in whole groups."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from disagg.api import v1alpha1 as api
from disagg.api.parallelism import Layout
from disagg.perf import parallel, serving
from disagg.perf.model import PerfModel
from disagg.planner import decide as dc
from disagg.simulator import simulate as sm
from disagg.simulator import traces

DEEPSEEK = "deepseek-ai/DeepSeek-V3"


def _spec(topology: dict | None = None, budget: int = 256) -> api.DisaggDeploymentSpec:
    doc = {"model": {"name": DEEPSEEK, "source": f"hf://{DEEPSEEK}"},
           "prefill": {"replicas": 1, "podsPerReplica": 2, "parallelism": {"tensor": 1, "data": 16, "expert": True}},
           "decode": {"replicas": 1, "podsPerReplica": 4, "parallelism": {"tensor": 1, "data": 32, "expert": True}},
           "scheduling": {"gang": {"minPrefill": 1, "minDecode": 1}},
           "slo": {"ttftMs": 2000, "itlMs": 70}, "planner": {"enabled": True, "gpuBudget": budget}}
    if topology:
        doc["scheduling"]["topology"] = topology
    return api.DisaggDeploymentSpec.model_validate(doc)


LOAD = dc.Load(rate=40.0, input_mean=2000, input_p=3000, output_mean=500)


def test_the_planner_prices_a_dp_ep_replica_with_the_multi_node_terms():
    models = dc.RoleModels.from_spec(_spec(), DEEPSEEK, "H100-SXM")
    p, d = models.prefill, models.decode
    assert isinstance(p, parallel.DataParallelEngine) and isinstance(d, parallel.DataParallelEngine)
    assert (p.gpus, p.servers, d.gpus, d.servers, d.tp) == (16, 16, 32, 32, 1)
    # each pod its own node and NVLink domain: the all-to-all beyond a pod is the network's
    assert d.fabric.gpus_per_node == d.fabric.domain_gpus == 8
    replica = parallel.ReplicaModel.of(DEEPSEEK, "H100-SXM", Layout(tensor=1, data=32, expert=True, pods=4),
                                       parallel.Fabric(8, 8), precision="fp8")
    assert d.itl(32 * 48, 2250) == pytest.approx(replica.moe_decode_step(48, 2250).total, rel=1e-12)
    assert d.kv_capacity_tokens() == pytest.approx(replica.kv_capacity_tokens())
    # a topology that holds each group in one NVLink domain: the all-to-all is NVLink's across the group
    one = dc.RoleModels.from_spec(_spec({"key": parallel.NVLINK_DOMAIN_KEY, "mode": "required"}), DEEPSEEK, "H100-SXM")
    assert one.decode.fabric.domain_gpus == 32 and one.decode.itl(32 * 48, 2250) < d.itl(32 * 48, 2250)
    # dense layouts are unchanged: one engine of their tensor size
    dense = api.DisaggDeploymentSpec.model_validate({
        "model": {"name": "m", "source": "hf://x/y"}, "prefill": {"tensorParallelSize": 2},
        "decode": {"tensorParallelSize": 4}, "slo": {"ttftMs": 500, "itlMs": 40}})
    dm = dc.RoleModels.from_spec(dense, "meta-llama/Llama-3.1-70B-Instruct", "H100-SXM")
    assert dm.decode == PerfModel.analytic("meta-llama/Llama-3.1-70B-Instruct", "H100-SXM", 4)


def test_sizing_counts_every_rank_and_differs_from_the_dense_engine():
    """A 16-rank prefill replica is 16 servers of one queue; a DP decode replica holds its ranks' batches.
    The dense engine of the replica's tensor size (one GPU) holds no KV for DeepSeek-V3 at all: it asked for
    the most decode replicas whatever the load."""
    models = dc.RoleModels.from_spec(_spec(), DEEPSEEK, "H100-SXM")
    n, ttft = dc.size_prefill(models, LOAD, 2.0, 90)
    work = serving.prefill_work(models.prefill, serving.PromptMix(2000, 3000, 90), 0.0, 1)
    assert work.servers == 16 and ttft <= 2.0
    assert n == max(1, math.ceil(LOAD.rate * work.mean / (serving.PREFILL_MAX_UTILIZATION * 16)))
    # by M/G/c with n x 16 servers: one replica fewer misses the utilisation cap or the target
    assert n == 1 or LOAD.rate * work.mean / ((n - 1) * 16) >= serving.PREFILL_MAX_UTILIZATION or \
        serving.prefill_ttft(work, LOAD.rate, n - 1, 90) > 2.0
    d, itl = dc.size_decode(models, LOAD, 0.07, 90)
    assert 1 <= d <= 2 and itl <= 0.07
    dense = PerfModel.analytic(DEEPSEEK, "H100-SXM", 1)
    assert dense.kv_capacity_tokens() == 0
    assert dc.size_decode(dense, LOAD, 0.07, 90)[0] == dc.MAX_REPLICAS


def test_decide_scales_moe_groups_whole_within_the_budget():
    """Load several times what one group of each role carries: the planner asks for whole groups (16 and 32
    GPUs), as many as the DP model sizes; under a budget every GPU of them counts."""
    heavy = dc.Load(rate=400.0, input_mean=2000, input_p=3000, output_mean=500)
    obs = dc.Observation(time=0.0, request_rate=heavy.rate, ttft=1.0, itl=0.09, input_tokens_mean=2000,
                         input_tokens_p=3000, output_tokens_mean=500, output_tokens_p=750, prefix_hit_ratio=0.0)
    spec = _spec(budget=1024)
    models = dc.RoleModels.from_spec(spec, DEEPSEEK, "H100-SXM")
    t = dc.Target.from_spec(spec)
    assert t.replica_gpus == (16, 32)
    decision, _ = dc.decide(obs, t, dc.Memory(), models, now=0.0)
    want_p = dc.size_prefill(models, heavy, 2.0, 90)[0]
    want_d = dc.size_decode(models, heavy, 0.07, 90)[0]
    assert decision.decode.needed >= want_d > 1 and decision.prefill.needed >= want_p > 1
    assert decision.prefill.replicas == decision.prefill.needed and decision.decode.replicas == decision.decode.needed
    small = dc.Target.from_spec(_spec(budget=16 + 2 * 32))
    limited, _ = dc.decide(obs, small, dc.Memory(), models, now=0.0)
    assert limited.reason == "GPUBudgetLimited"
    assert small.gpus(limited.prefill.replicas, limited.decode.replicas) <= 80
    assert limited.prefill.replicas >= 1 and limited.decode.replicas >= 1


def test_the_simulator_runs_dp_ep_replicas_with_the_same_model_and_counts_whole_groups():
    cfg = sm.SimConfig(model=DEEPSEEK, gpu="H100-SXM", prefill_data=16, prefill_pods=2, decode_data=32,
                       decode_pods=4, ttft_target=2.0, itl_target=0.07, interval=15.0, cooldown=60.0, startup=30.0,
                       drain_limit=120.0)
    pm_, dm_ = cfg.planning_models()
    assert isinstance(dm_, parallel.DataParallelEngine) and (pm_.gpus, dm_.gpus) == (16, 32)
    models = dc.RoleModels.from_spec(_spec(), DEEPSEEK, "H100-SXM")
    assert dm_.itl(640, 2250) == pytest.approx(models.decode.itl(640, 2250), rel=1e-12)  # the planner's model
    assert cfg.target(1, 2).gpus(1, 2) == 16 + 2 * 32
    trace = traces.poisson(4, 90, traces.Mix(input_mean=2000, output_mean=200, prefix_groups=0), seed=3)
    r = sm.simulate(trace, sm.StaticPolicy(1, 1), cfg)
    assert r.finished == r.arrived > 0
    assert r.attainment > 0.9
    assert r.gpu_seconds == pytest.approx((16 + 32) * r.intervals[-1].t, rel=0.35)
    assert all(i.gpus == 48 for i in r.intervals)
    # static-peak sizes the same trace with the DP models: one group of each
    assert sm.static_peak(cfg, trace).size == (1, 1)
    # a step to 15x the rate: the planner adds whole 16-GPU prefill groups (one group prefills ~97k tokens/s,
    # the step asks 120k), every interval's GPUs are whole groups, the decode group carries the rest
    step = traces.step([4, 60], 90, traces.Mix(input_mean=2000, output_mean=200, prefix_groups=0), seed=3)
    p = sm.simulate(step, "planner", replace(cfg, gpu_budget=3 * 16 + 2 * 32))
    assert p.finished == p.arrived and p.summary()["max_prefill"] >= 2
    assert all(i.gpus == 16 * i.prefill + 32 * i.decode <= 112 for i in p.intervals)
    assert p.summary()["itl_attainment"] > 0.95
