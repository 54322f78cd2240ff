"""The configurator's multi-node layouts: a model that fits no node gets tensor parallel across whole-node pods
inside one NVLink domain (never pipeline parallel: refused by this vLLM, reported in the notes instead), its
manifest passes the API's models and schema, and the local cluster's operator places every group of it inside
one domain (e2e/clusters/default.yaml: 8-GPU nodes in domains of 4)."""

from __future__ import annotations

import pytest
import yaml
from kubernetes import client

from disagg.api import v1alpha1 as api
from disagg.configurator import Inputs, configure, manifest, report

LLAMA_405B = "meta-llama/Llama-3.1-405B-Instruct"


def _inputs(**kw) -> Inputs:
    base = dict(model=LLAMA_405B, gpu="h100", gpus=64, isl=2000, osl=200, ttft_ms=3000, itl_ms=100, max_tp=32,
                domain_gpus=32, interconnect="nvlink", max_batch=64)
    base.update(kw)
    return Inputs(**base)


@pytest.fixture(scope="module")
def result():
    return configure(_inputs())


def test_a_model_that_fits_no_node_gets_tensor_parallel_across_pods(result, tmp_path):
    best = result.best
    assert best is not None and best.meets_slo
    assert max(best.decode_tp, best.prefill_tp) == 16 and max(best.decode_pods, best.prefill_pods) == 2
    assert "pods" in best.layout
    # every point of both frontiers is a multi-pod layout (405B at 16 bits is 810 GB: no 8-GPU node holds it)
    assert all(e.decode_pods >= 2 for e in result.aggregated + result.disaggregated)
    doc = yaml.safe_load(manifest.to_yaml(result, best))
    obj = manifest.validate(doc)                                   # pydantic models and the CRD's schema
    role = doc["spec"]["decode"]
    assert role["podsPerReplica"] == 2 and role["parallelism"] == {"tensor": 16}
    assert role["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert obj.spec.decode.layout().pipeline == 1
    assert doc["spec"]["scheduling"]["topology"] == {"key": manifest.TOPOLOGY_KEY, "mode": "required"}
    # the frontier's CSV and PNG carry the pods
    report.write_csv(result, tmp_path / "f.csv")
    assert "decode_pods" in (tmp_path / "f.csv").read_text().splitlines()[0]
    assert report.plot(result, tmp_path / "f.png").stat().st_size > 0


def test_where_only_pipeline_parallel_fits_it_is_reported_never_emitted():
    """Domains of one 8-GPU node: 405B fits no TP inside one; the configurator says what pipeline parallel
    across nodes (DistServe's low node-affinity placement) would give and that this vLLM refuses it."""
    with pytest.raises(ValueError) as e:
        configure(_inputs(domain_gpus=8, max_tp=8))
    text = str(e.value)
    assert "needs pipeline parallel, refused by this vLLM" in text and "2 stages of TP 8" in text


def test_every_frontier_point_validates(result):
    for n, e in enumerate(result.aggregated + result.disaggregated):
        doc = yaml.safe_load(manifest.to_yaml(result, e, name=f"p-{n}"))
        for role in ("prefill", "decode"):
            assert doc["spec"][role].get("parallelism", {}).get("pipeline", 1) == 1


@pytest.mark.cluster
def test_the_manifest_is_placed_with_every_group_inside_one_domain(result, api_client, namespace, operator):
    from disagg.api.names import LABEL_GROUP
    from disagg.e2e.localcluster import nodepools
    from disagg.e2e.testing import DD, wait_for

    doc = yaml.safe_load(manifest.to_yaml(result, result.best, name="llama-405b-cfg", namespace=namespace))
    spec = doc["spec"]
    dd = DD(api_client, namespace, doc)

    def placed():
        s = dd.status()
        return all((s.get(r) or {}).get("ready") == spec[r]["replicas"] for r in ("prefill", "decode")) and s
    wait_for(placed, 240, f"every replica placed and ready (status: {dd.status()})")
    core = client.CoreV1Api(api_client)
    nodes = {n.metadata.name: n for n in core.list_node().items}
    for role in ("prefill", "decode"):
        if not spec[role]["replicas"]:
            continue
        groups: dict[str, list] = {}
        for p in dd.pods(role):
            groups.setdefault(p.metadata.labels.get(LABEL_GROUP, p.metadata.name), []).append(p)
        assert len(groups) == spec[role]["replicas"]
        for group, pods in groups.items():
            assert len(pods) == spec[role].get("podsPerReplica", 1), group
            domains = {nodes[p.spec.node_name].metadata.labels[nodepools.CLIQUE_LABEL] for p in pods}
            assert len(domains) == 1, f"{group} spans {domains}"
    assert api.KIND == doc["kind"]
