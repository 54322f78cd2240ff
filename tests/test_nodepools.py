"""The declarative node pool file turns into the fleet it describes (no cluster needed)."""

from collections import Counter

import pytest
from pydantic import ValidationError

from disagg.e2e.localcluster import nodepools


def test_default_pools_shape():
    nodes = nodepools.nodes(nodepools.load())
    gpu = [n for n in nodes if "nvidia.com/gpu" in n["status"]["capacity"]]
    cpu = [n for n in nodes if "nvidia.com/gpu" not in n["status"]["capacity"]]
    assert len(gpu) == 2 * 2 * 2 * 4 and len(cpu) == 2
    assert all(n["status"]["capacity"]["nvidia.com/gpu"] == "8" for n in gpu)
    labels = [n["metadata"]["labels"] for n in gpu]
    assert Counter(lab[nodepools.ZONE_LABEL] for lab in labels) == {"zone-a": 16, "zone-b": 16}
    assert len({lab[nodepools.RACK_LABEL] for lab in labels}) == 4
    cliques = Counter(lab[nodepools.CLIQUE_LABEL] for lab in labels)
    assert len(cliques) == 8 and set(cliques.values()) == {4}
    for lab in labels:
        assert lab["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3" and lab["nvidia.com/gpu.count"] == "8"
    # one NVLink domain never spans racks
    rack_of = {}
    for lab in labels:
        assert rack_of.setdefault(lab[nodepools.CLIQUE_LABEL], lab[nodepools.RACK_LABEL]) == lab[nodepools.RACK_LABEL]
    names = [n["metadata"]["name"] for n in nodes]
    assert len(set(names)) == len(names)
    ips = [n["status"]["addresses"][0]["address"] for n in nodes]
    assert len(set(ips)) == len(ips)


def test_bad_pool_file_names_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("pools:\n  - name: gpu\n    gpus: -1\n")
    with pytest.raises(ValidationError, match="gpus"):
        nodepools.load(bad)
