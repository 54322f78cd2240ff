"""The configurator's layouts for a mixture-of-experts model: DP attention + expert parallel replicas (data-
parallel ranks within a node or over whole-node pods), priced by the multi-node terms of the performance
model (disagg.perf.parallel: one home, imported), on the same frontier, CSV, PNG and DisaggDeployment as
the dense layouts; every manifest passes the API's models and the CRD's schema with pipeline 1, and the
local cluster's GPU pools place it with every group inside one NVLink domain (e2e/clusters/default.yaml:
8-GPU H100 nodes in domains of 4)."""

from __future__ import annotations

import csv

import pytest
import yaml
from kubernetes import client

from disagg.api import v1alpha1 as api
from disagg.api.parallelism import Layout
from disagg.configurator import Inputs, configure, manifest, report
from disagg.configurator import estimate as est
from disagg.perf import model as pm
from disagg.perf import parallel
from disagg.planner import decide as dc

DEEPSEEK = "deepseek-ai/DeepSeek-V3"


def _inputs(**kw) -> Inputs:
    base = dict(model=DEEPSEEK, gpu="h100", gpus=96, isl=2000, osl=500, ttft_ms=2000, itl_ms=70,
                interconnect="infiniband")
    base.update(kw)
    return Inputs(**base)


@pytest.fixture(scope="module")
def result():
    """12 nodes of 8 H100s (SGLang's large-scale EP deployment's size), one node an NVLink domain."""
    return configure(_inputs())


def test_a_moe_model_that_fits_no_node_gets_dp_attention_and_expert_parallel(result, tmp_path):
    """DeepSeek-V3's 671 GB of FP8 weights fit no 8 x 80 GB node at any TP: without DP + EP there is no
    layout at all (the dense search alone says pipeline parallel, refused); with it both roles are data-parallel
    expert-parallel replicas over whole-node pods and the best meets the SLO."""
    s = result.setup
    assert s.tp_sizes() == [] and s.data_sizes()[0] == 16          # 8 ranks leave no KV room: 2 nodes at least
    assert any("DP attention + expert parallel" in n for n in s.notes)
    best = result.best
    assert best is not None and best.meets_slo and best.mode == "disaggregated"
    assert best.prefill_data >= 16 and best.decode_data >= 16 and best.prefill_tp == best.decode_tp == 1
    assert best.prefill_pods == best.prefill_data // 8 and best.decode_pods == best.decode_data // 8
    assert best.gpus <= 96 and "EP" in best.layout and "pods" in best.layout
    assert result.aggregated == []                                   # aggregated layouts are dense TP only
    assert all(e.expert_parallel for e in result.disaggregated)
    # CSV and PNG carry the layouts
    rows = list(csv.DictReader(report.write_csv(result, tmp_path / "f.csv").open()))
    assert {"prefill_data", "decode_data", "expert_parallel"} <= set(rows[0])
    assert sum(r["best"] == "True" for r in rows) == 1
    assert report.plot(result, tmp_path / "f.png").stat().st_size > 0
    assert best.layout in report.table(result)


def test_the_estimate_is_the_performance_models_own(result):
    """The configurator prices a DP + EP replica with disagg.perf.parallel's terms, not a dense engine: the
    best point's ITL is ReplicaModel.moe_decode_step at its requests per rank, its prefill the loaded
    moe_step of one prompt per rank, and the planner builds the same model from the emitted manifest."""
    i, best = result.inputs, result.best
    lay = Layout(tensor=1, data=best.decode_data, expert=True, pods=best.decode_pods)
    fabric = parallel.Fabric(8, 8, pm.interconnect("infiniband-ndr"))
    replica = parallel.ReplicaModel.of(DEEPSEEK, "H100-SXM", lay, fabric, precision="fp8")
    ctx = i.isl + i.osl / 2
    assert best.itl_mean_s == pytest.approx(replica.moe_decode_step(best.batch / best.decode_data, ctx).total,
                                            rel=1e-9)
    pre = parallel.ReplicaModel.of(DEEPSEEK, "H100-SXM", replace_data(lay, best.prefill_data, best.prefill_pods),
                                   fabric, precision="fp8")
    service = pre.moe_step(i.isl, (i.isl + 1) / 2, "prefill").total
    assert est._prefill(setup := result.setup, best.prefill_role, best.decode_role).service == pytest.approx(service)
    # the planner, reading the manifest, builds the same models (domain: one node, as the configurator had it)
    obj = manifest.validate(manifest.manifest(result, best))
    models = dc.RoleModels.from_spec(obj.spec, DEEPSEEK, "H100-SXM")
    assert isinstance(models.decode, parallel.DataParallelEngine) and models.decode.gpus == best.decode_gpus
    assert models.decode.itl(best.batch, ctx) == pytest.approx(best.itl_mean_s, rel=1e-9)
    assert models.prefill.ttft(i.isl) == pytest.approx(setup.engine(best.prefill_role).ttft(i.isl), rel=1e-9)


def replace_data(lay: Layout, data: int, pods: int) -> Layout:
    return Layout(tensor=lay.tensor, data=data, expert=True, pods=pods)


def test_no_moe_layout_beats_the_data_sheet(result):
    """Per GPU, no point prefills faster than FP8 peak nor decodes past HBM bandwidth."""
    hw = result.setup.hw
    assert hw.flops == pm.gpu("h100", "fp8").flops
    for e in result.disaggregated:
        assert e.prefill_flops_per_gpu < hw.flops and e.decode_bytes_per_gpu < hw.hbm_bandwidth


def test_every_moe_frontier_point_is_a_valid_disaggdeployment(result):
    for n, e in enumerate(result.aggregated + result.disaggregated):
        doc = yaml.safe_load(manifest.to_yaml(result, e, name=f"p-{n}"))
        obj = manifest.validate(doc)                                 # pydantic models and the CRD's schema
        for role in ("prefill", "decode"):
            spec = doc["spec"][role]
            lay = getattr(obj.spec, role).layout()
            assert lay.pipeline == 1 and spec["parallelism"].get("pipeline", 1) == 1
            assert spec["parallelism"] == {"tensor": 1, "data": lay.data, "expert": True}
            assert spec.get("podsPerReplica", 1) == lay.pods and lay.data % lay.pods == 0
            assert spec["resources"]["limits"]["nvidia.com/gpu"] == lay.gpus_per_pod <= 8
        ranks = e.batch / e.decode_data
        seqs = int(doc["spec"]["decode"]["extraArgs"][doc["spec"]["decode"]["extraArgs"].index("--max-num-seqs") + 1])
        assert ranks <= seqs <= ranks + 2 * ranks ** 0.5 + 1          # per engine (DP rank), not per replica
        # replicas wider than a one-node domain: packed where possible, never required into one domain
        assert doc["spec"]["scheduling"]["topology"] == {"key": manifest.TOPOLOGY_KEY, "mode": "preferred"}


def test_inside_a_multi_node_nvlink_domain_every_replica_is_required_in_one():
    r = configure(_inputs(gpus=64, domain_gpus=32, max_data=32))
    assert r.best is not None and max(r.best.prefill_gpus, r.best.decode_gpus) <= 32
    doc = yaml.safe_load(manifest.to_yaml(r, r.best))
    assert doc["spec"]["scheduling"]["topology"] == {"key": manifest.TOPOLOGY_KEY, "mode": "required"}
    # KV over NVLink keeps both roles inside one domain: no replica wider than it is searched
    nv = est.Setup.of(_inputs(gpus=64, domain_gpus=16, interconnect="nvlink"))
    assert nv.data_sizes() == [16]


def test_dense_models_get_no_expert_parallel_and_small_moe_budgets_say_why():
    setup = est.Setup.of(Inputs(model="Qwen/Qwen3-32B", gpu="h100", gpus=16))
    assert setup.data_sizes() == [] and all(r.data == 1 for r in setup.roles())
    with pytest.raises(ValueError, match="data-parallel expert-parallel ranks"):
        configure(_inputs(gpus=8))


def test_h800_and_h100_differ_only_where_nvlink_carries_the_all_to_all():
    """H800: the H100's compute and HBM, NVLink 200 GB/s. With one node a domain the network bounds every
    all-to-all (the same figures); in 32-GPU NVLink domains it is NVLink's, and the H800 is slower."""
    h100, h800 = configure(_inputs(gpus=64)), configure(_inputs(gpus=64, gpu="h800"))
    assert h800.best.tokens_per_s_per_gpu == pytest.approx(h100.best.tokens_per_s_per_gpu, rel=1e-6)
    lay = Layout(tensor=1, data=32, expert=True, pods=4)
    speed = {g: parallel.role_engine(DEEPSEEK, g, lay, nvlink_domain=32).itl(32 * 64, 2250)
             for g in ("H100-SXM", "H800-SXM")}
    assert speed["H800-SXM"] > speed["H100-SXM"]


@pytest.mark.cluster
def test_the_moe_manifest_is_admitted_and_placed_with_every_group_inside_one_domain(api_client, namespace,
                                                                                     operator):
    from disagg.api.names import GROUP, LABEL_GROUP
    from disagg.e2e.localcluster import nodepools
    from disagg.e2e.testing import DD, wait_for

    r = configure(_inputs(gpus=64, domain_gpus=32, max_data=32))
    objects = client.CustomObjectsApi(api_client)
    for n, e in enumerate(r.disaggregated):                          # the API server's CEL rules too
        doc = yaml.safe_load(manifest.to_yaml(r, e, name=f"moe-point-{n}", namespace=namespace))
        objects.create_namespaced_custom_object(GROUP, api.VERSION, namespace, api.PLURAL, doc, dry_run="All")
    doc = yaml.safe_load(manifest.to_yaml(r, r.best, name="deepseek-moe-cfg", namespace=namespace))
    spec = doc["spec"]
    dd = DD(api_client, namespace, doc)

    def placed():
        s = dd.status()
        return all((s.get(role) or {}).get("ready") == spec[role]["replicas"] for role in ("prefill", "decode")) and s
    wait_for(placed, 300, f"every replica placed and ready (status: {dd.status()})")
    core = client.CoreV1Api(api_client)
    nodes = {n.metadata.name: n for n in core.list_node().items}
    for role in ("prefill", "decode"):
        groups: dict[str, list] = {}
        for p in dd.pods(role):
            groups.setdefault(p.metadata.labels.get(LABEL_GROUP, p.metadata.name), []).append(p)
        assert len(groups) == spec[role]["replicas"]
        for group, pods in groups.items():
            assert len(pods) == spec[role].get("podsPerReplica", 1), group
            domains = {nodes[p.spec.node_name].metadata.labels[nodepools.CLIQUE_LABEL] for p in pods}
            assert len(domains) == 1, f"{group} spans {domains}"
            assert len({p.spec.node_name for p in pods}) == len(pods)   # one pod a node: 8 GPUs each
