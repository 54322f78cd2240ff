"""The multi-node terms of the performance model (perf/parallel.py): each against the H100 measurements in
../shared/calibration (Vidur's DGX H100 send/recv and all-reduce) where they apply and a hand-checked case,
and the two published large-scale DeepSeek-V3 deployments within 25% per node (perf/README.md's table)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from disagg.api.parallelism import Layout
from disagg.perf import measured as ms
from disagg.perf import model as pm
from disagg.perf import parallel as pp
from disagg.perf import serving

VIDUR = Path(__file__).resolve().parents[2] / "shared" / "calibration" / "vidur-h100"
H100 = pm.gpu("H100-SXM")
IB = pm.interconnect("infiniband-ndr")


def _replica(model: str, lay: Layout, fabric: pp.Fabric | None = None) -> pp.ReplicaModel:
    return pp.ReplicaModel(pm.PerfModel.analytic(model, "H100-SXM", lay.tensor), lay, fabric or pp.Fabric())


# ---------------------------------------------------------------- against the measurements

@pytest.fixture(scope="module")
def sendrecv():
    assert (VIDUR / "network").is_dir(), f"{VIDUR} missing (the project's shared calibration data)"
    return list(ms.sendrecv_rows(VIDUR))


@pytest.mark.parametrize("cross", [False, True], ids=["nvlink", "network"])
def test_point_to_point_within_25_percent_of_the_h100_send_recv(sendrecv, cross):
    """Every measured send/recv (NCCL, a DGX H100: two GPUs of one node, or of two nodes): the model's
    p2p_time (the shipped calibration's fit) within 25% on at least 95% of the sizes."""
    m = pm.PerfModel.analytic("meta-llama/Llama-3.1-70B-Instruct", "H100-SXM", 8)
    pts = [p for p in sendrecv if p["crossNode"] == cross]
    ratios = [m.p2p_time(p["bytes"], cross_node=cross) / p["seconds"] for p in pts]
    inside = sum(0.8 <= r <= 1.25 for r in ratios) / len(ratios)
    assert len(pts) > 900 and inside >= 0.95, (cross, inside, min(ratios), max(ratios))
    # the large transfers (what a pipeline boundary or a KV shard moves) all within 25%
    big = [r for p, r in zip(pts, ratios) if p["bytes"] >= 16 << 20]
    assert big and all(0.8 <= r <= 1.25 for r in big), (min(big), max(big))


def test_stage_transfer_between_nodes_is_the_measured_send_recv(sendrecv):
    """A pipeline boundary of a 70B model at PP 2 x TP 8 across two 8-GPU nodes (no NVLink between them):
    each TP rank sends tokens x hidden x 2 / 8 bytes to its peer, at the measured cross-node send/recv."""
    r = _replica("meta-llama/Llama-3.1-70B-Instruct", Layout(tensor=8, pipeline=2, pods=2))
    tokens = 4096
    per_rank = tokens * 8192 * 2 / 8                                    # 8 MiB
    t = r.stage_transfer_time(tokens)
    near = min((p for p in sendrecv if p["crossNode"]), key=lambda p: abs(p["bytes"] - per_rank))
    assert t == pytest.approx(r.engine.calibration.sendrecv_seconds(per_rank, True))
    assert 0.8 <= t / near["seconds"] <= 1.25, (t, near)
    # inside one NVLink domain (two nodes of a multi-node domain) the boundary is NVLink, far faster
    inside = _replica("meta-llama/Llama-3.1-70B-Instruct", Layout(tensor=8, pipeline=2, pods=2), pp.Fabric(8, 32))
    assert inside.stage_transfer_time(tokens) < t / 5


def test_allreduce_inside_a_domain_is_the_engines_and_beyond_it_a_ring_over_the_network():
    """Up to 8 ranks: the engine's all-reduce (the calibration, within 25% of every DGX H100 point:
    tests/test_calibration_h100.py); wider than the NVLink domain: a ring over one NIC per GPU, by hand."""
    r = _replica("meta-llama/Llama-3.1-405B-Instruct", Layout(tensor=16, pods=2))
    nbytes = 64 << 20
    assert r.allreduce_time(nbytes, 8) == r.engine.allreduce_time(nbytes, 8)
    by_hand = 2 * 15 * IB.latency_seconds + 2 * 15 / 16 * nbytes / (IB.bandwidth * IB.efficiency)
    assert r.allreduce_time(nbytes, 16) == pytest.approx(by_hand)
    in_domain = _replica("meta-llama/Llama-3.1-405B-Instruct", Layout(tensor=16, pods=2), pp.Fabric(8, 32))
    assert in_domain.allreduce_time(nbytes, 16) < r.allreduce_time(nbytes, 16) / 4
    assert in_domain.tp_comm_time(512) == in_domain.engine.tp_comm_time(512)


# ---------------------------------------------------------------- hand-checked terms

def test_pipeline_stages_bubble_and_transfer_by_hand():
    """PP 4 x TP 2 of a 70B model on one 8-GPU node: a stage is the engine's time over 4; a prompt passes
    4 stages and 3 boundaries; one decode request leaves 3 of 4 slots idle (the bubble), 4 or more none."""
    lay = Layout(tensor=2, pipeline=4)
    r = _replica("meta-llama/Llama-3.1-70B-Instruct", lay)
    e = r.engine
    prompt = [(2048.0, 0.0)]
    stage = e.prefill_time(prompt) / 4                  # the engine's time includes its TP all-reduces
    xfer = r.stage_transfer_time(2048)
    assert xfer == pytest.approx(e.p2p_time(2048 * 8192 * 2 / 2, cross_node=False))
    latency, interval = r.pipeline_prefill(prompt)
    assert latency == pytest.approx(4 * stage + 3 * xfer, rel=1e-6)
    assert interval == pytest.approx(max(stage, xfer), rel=1e-6)
    itl1, bubble1 = r.pipeline_decode_step(1, 4000)
    assert bubble1 == pytest.approx(0.75)
    assert itl1 == pytest.approx(e.decode_step_time(1, 4000) + 3 * r.stage_transfer_time(1), rel=1e-6)
    itl8, bubble8 = r.pipeline_decode_step(8, 8 * 4000)
    assert bubble8 == 0.0
    # 8 requests in 4 micro-batches of 2: each token passes the 4 stages, each at a quarter of the engine's step
    assert itl8 == pytest.approx(e.decode_step_time(2, 2 * 4000) + 3 * r.stage_transfer_time(2), rel=1e-6)
    # without pipeline parallel the replica is the engine
    flat = _replica("meta-llama/Llama-3.1-70B-Instruct", Layout(tensor=8))
    assert flat.prefill_time(prompt) == pytest.approx(flat.engine.prefill_time(prompt))
    assert flat.itl(16, 4000) == pytest.approx(flat.engine.itl(16, 4000))


def test_expert_imbalance_by_hand():
    assert pp.expert_imbalance(1000, 1) == 1.0
    assert pp.expert_imbalance(2048, 72) == pytest.approx(1.10 * (1 + math.sqrt(2 * math.log(72) / 2048)))
    # more tokens per GPU balance better; more GPUs worse
    assert pp.expert_imbalance(16384 * 8, 32) < pp.expert_imbalance(256 * 8, 32) < pp.expert_imbalance(256 * 8, 144)


def test_expert_parallel_step_by_hand():
    """DeepSeek-V3, EP16 over two 8-GPU nodes, 64 decode requests per GPU: the per-expert batch, the
    all-to-all's network and NVLink shares and the expert GEMMs' weight reads, by hand."""
    lay = Layout(tensor=1, data=16, expert=True, pods=2)
    m = pp.ReplicaModel.of("deepseek-ai/DeepSeek-V3", "H100-SXM", lay, precision="fp8")
    s, e = m.shape, m.engine
    step = m.moe_step(64, 2000, "decode")
    rows = 64 * 8
    imb = pp.expert_imbalance(rows, 16)
    assert step.per_expert == pytest.approx(rows * imb / (256 / 16))     # 16 experts per GPU
    # 8 of the 16 GPUs are on the other node: half the rows cross the network, 7/16 go over NVLink
    net_bytes = rows * 8 / 16 * s.hidden * pp.COMBINE_BYTES * imb
    nvl_bytes = rows * 7 / 16 * s.hidden * pp.COMBINE_BYTES * imb
    one = IB.latency_seconds + max(net_bytes / (IB.bandwidth * IB.efficiency), nvl_bytes / (H100.nvlink_bandwidth * 0.8))
    assert step.combine == pytest.approx(58 * one)
    # at a per-expert batch of ~38 rows the expert GEMMs read their weights: 58 layers x 16 experts x 44M x 1 byte
    weights = 58 * 16 * s.expert_params
    assert step.experts >= weights / H100.hbm_bandwidth
    assert step.experts == pytest.approx(weights / (H100.hbm_bandwidth * e.eff.decode_mbu), rel=0.1)
    # overlapped, half of the shorter of compute and communication is hidden
    assert step.total == pytest.approx(step.compute + step.communication
                                       - 0.5 * min(step.compute, step.communication) + step.overhead)
    assert pp.ReplicaModel.of("deepseek-ai/DeepSeek-V3", "H100-SXM", lay, precision="fp8",
                              overlap=False).moe_step(64, 2000).total > step.total


def test_expert_parallel_spreads_the_experts_weights():
    """A DeepSeek-V3 replica over 32 GPUs holds 1/32 of the routed experts per GPU and fits; the whole
    model on one 8-GPU node at FP8 (671 GB over 640 GB) does not."""
    wide = pp.ReplicaModel.of("deepseek-ai/DeepSeek-V3", "H100-SXM", Layout(data=32, expert=True, pods=4),
                              precision="fp8")
    node = pp.ReplicaModel.of("deepseek-ai/DeepSeek-V3", "H100-SXM", Layout(tensor=8), precision="fp8")
    assert wide.kv_capacity_tokens() > 1e6 and node.kv_capacity_tokens() == 0


def test_kv_transfer_per_rank_between_heterogeneous_layouts():
    """Llama 3.1 70B (8 KV heads), a 4,000-token prompt (1.31 GB of KV) over one NIC per GPU: TP 2 -> TP 1
    reads both shards over the decode's one link (two reads); TP 1 -> TP 2 sends both halves over the
    prefill's one link; TP 2 -> TP 2 moves a half on each of two links; TP 16 (heads replicated) -> TP 8."""
    s = pm.model("meta-llama/Llama-3.1-70B-Instruct")
    total = s.kv_bytes_per_token * 4000
    bw, lat = IB.bandwidth * IB.efficiency, IB.latency_seconds
    assert pp.kv_transfer_seconds(s, 4000, 2, 1, IB) == pytest.approx(2 * lat + total / bw)
    assert pp.kv_transfer_seconds(s, 4000, 1, 2, IB) == pytest.approx(lat + total / bw)
    assert pp.kv_transfer_seconds(s, 4000, 2, 2, IB) == pytest.approx(lat + total / 2 / bw)
    assert pp.kv_transfer_seconds(s, 4000, 16, 8, IB) == pytest.approx(lat + total / 8 / bw)
    # MLA's latent is whole on every rank: each decode rank reads all of it from one prefill rank
    ds = pm.model("deepseek-ai/DeepSeek-V3")
    assert pp.kv_transfer_seconds(ds, 2000, 8, 8, IB) == pytest.approx(lat + ds.kv_bytes_per_token * 2000 / bw)
    # the serving model (planner, configurator, simulator) charges the same
    m = pm.PerfModel.analytic("meta-llama/Llama-3.1-70B-Instruct", "H100-SXM", 2)
    assert serving.kv_transfer_time(m, 4000, 1) == pytest.approx(2 * lat + total / bw)


def test_a_group_starts_with_its_slowest_pod():
    assert pp.group_startup([60.0, 95.0, 70.0]) == 95.0
    assert pp.group_startup([]) == 0.0


# ---------------------------------------------------------------- published large-scale results

@pytest.mark.parametrize("check", pp.published_checks(), ids=lambda c: c.name.split(",")[0])
def test_published_throughput_per_node_within_25_percent(check):
    assert 0.75 <= check.ratio <= 1.25, (check.name, check.model, check.published)
    assert len(check.assumptions) >= 6 and check.source


def test_the_readme_carries_the_table():
    """perf/README.md's table is the one `python -m disagg.perf.parallel` prints (figures to 0.1k, ratios)."""
    text = (Path(__file__).resolve().parent.parent / "perf" / "README.md").read_text()
    for c in pp.published_checks():
        assert f"| {c.published / 1e3:.1f}k | {c.model / 1e3:.1f}k | {c.ratio:.2f} |" in text, c.name
