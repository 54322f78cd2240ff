"""A multi-pod replica's arithmetic (disagg.api.parallelism): pods, GPUs per pod and per replica, and
the vLLM flags each pod of the group runs with, for every layout; and the API refusing layouts vLLM
would refuse, with the words admission uses. The API server's side of the refusals is in
tests/test_admission.py."""

import copy
import json
import subprocess
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from disagg.api import parallelism as par
from disagg.api import v1alpha1 as api
from disagg.api.names import MAX_GROUP_REPLICAS, MAX_NAME_LENGTH, group_pod_name

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = yaml.safe_load((REPO / "examples" / "small.yaml").read_text())
LEADER = "10.1.2.3"


def role(**fields) -> api.RoleSpec:
    return api.RoleSpec.model_validate(fields)


def nnodes(pods: int, rank: int) -> list[str]:
    return ["--distributed-executor-backend", "mp", "--nnodes", str(pods), "--node-rank", str(rank),
            "--master-addr", LEADER, "--master-port", str(par.MASTER_PORT)]


# (id, role spec, pods, GPUs per pod, GPUs per replica, each pod's flags)
LAYOUTS = [
    ("tp4-one-pod", {"tensorParallelSize": 4}, 1, 4, 4,
     [["--tensor-parallel-size", "4"]]),
    ("tp2-over-2-pods", {"parallelism": {"tensor": 2}, "podsPerReplica": 2}, 2, 1, 2,
     [["--tensor-parallel-size", "2", *nnodes(2, 0)],
      ["--tensor-parallel-size", "2", *nnodes(2, 1), "--headless"]]),
    ("pp2-over-2-pods", {"parallelism": {"pipeline": 2}, "podsPerReplica": 2}, 2, 1, 2,
     [["--tensor-parallel-size", "1", "--pipeline-parallel-size", "2", *nnodes(2, 0)],
      ["--tensor-parallel-size", "1", "--pipeline-parallel-size", "2", *nnodes(2, 1), "--headless"]]),
    ("tp8xpp2-over-4-pods-of-4",
     {"parallelism": {"tensor": 8, "pipeline": 2}, "podsPerReplica": 4,
      "resources": {"limits": {"nvidia.com/gpu": 4}}}, 4, 4, 16,
     [["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2", *nnodes(4, r)] + (["--headless"] if r else [])
      for r in range(4)]),
    ("dp16-ep-over-2-pods", {"parallelism": {"data": 16, "dataLocal": 8, "expert": True}, "podsPerReplica": 2},
     2, 8, 16,
     [["--tensor-parallel-size", "1", "--data-parallel-size", "16", "--enable-expert-parallel",
       "--data-parallel-size-local", "8", "--data-parallel-address", LEADER,
       "--data-parallel-rpc-port", str(par.DP_RPC_PORT)],
      ["--tensor-parallel-size", "1", "--data-parallel-size", "16", "--enable-expert-parallel",
       "--data-parallel-size-local", "8", "--data-parallel-address", LEADER,
       "--data-parallel-rpc-port", str(par.DP_RPC_PORT), "--data-parallel-start-rank", "8", "--headless"]]),
]


@pytest.mark.parametrize("case,spec,pods,per_pod,per_replica,flags", LAYOUTS, ids=[c[0] for c in LAYOUTS])
def test_group_gpus_and_ranks(case, spec, pods, per_pod, per_replica, flags):
    r = role(**spec)
    lay = r.layout()
    assert (lay.pods, lay.gpus_per_pod, lay.gpus_per_replica, lay.world_size) == (pods, per_pod, per_replica,
                                                                                 per_replica)
    assert lay.pods * lay.gpus_per_pod == lay.gpus_per_replica
    assert r.gpus() == per_pod  # what one node must hold for one pod
    members = par.group(lay, LEADER)
    assert [list(m.flags) for m in members] == flags
    assert [(m.index, m.leader, m.headless, m.gpus) for m in members] == \
        [(i, i == 0, i > 0, per_pod) for i in range(pods)]


def test_ranks_are_contiguous_slices_of_the_world():
    """vLLM's mp executor puts ranks node_rank * world/nnodes ... on each node: the pods' first ranks
    step by GPUs per pod, and data-parallel pods' start ranks by dataLocal."""
    lay = role(parallelism={"tensor": 8, "pipeline": 2}, podsPerReplica=4).layout()
    assert [m.first_rank for m in par.group(lay, LEADER)] == [0, 4, 8, 12]
    lay = role(parallelism={"data": 16, "expert": True}, podsPerReplica=4).layout()
    assert lay.data_local == 4  # derived: data / pods
    assert [m.first_rank for m in par.group(lay, LEADER)] == [0, 4, 8, 12]
    assert par.rank_flags(lay, 3, LEADER)[-3:] == ["--data-parallel-start-rank", "12", "--headless"]


def test_data_parallel_leader_serves_every_engine():
    """A start rank on a serving vLLM means hybrid load balancing (its API server feeds only its own
    engines); the leader must feed the whole group, since the router sends only to it."""
    lay = role(parallelism={"data": 8, "expert": True}, podsPerReplica=2).layout()
    assert "--data-parallel-start-rank" not in par.rank_flags(lay, 0, LEADER)
    assert "--headless" not in par.rank_flags(lay, 0, LEADER)


def test_one_pod_replicas_keep_their_single_flag():
    """A one-pod replica passes exactly what the operator always passed: the tensor parallel size (the
    examples' tensor-parallel roles; the multi-node examples' replicas span pods, tests/test_groups_plan.py)."""
    checked = 0
    for doc in (yaml.safe_load(p.read_text()) for p in sorted((REPO / "examples").glob("*.yaml"))):
        dd = api.DisaggDeployment.model_validate(doc)
        for r in (dd.spec.prefill, dd.spec.decode):
            lay = r.layout()
            if lay.pods > 1 or lay.pipeline > 1 or lay.data > 1:
                continue
            checked += 1
            assert lay.gpus_per_pod == lay.gpus_per_replica == r.tensor_parallel_size
            assert par.engine_flags(lay, 0, LEADER) == ["--tensor-parallel-size", str(r.tensor_parallel_size)]
    assert checked >= 6, "every one-pod example role checked"
    one = role(parallelism={"data": 4, "expert": True}).layout()  # data parallel inside one pod
    assert par.engine_flags(one, 0, LEADER) == ["--tensor-parallel-size", "1", "--data-parallel-size", "4",
                                                "--enable-expert-parallel"]
    with pytest.raises(ValueError, match="outside a replica of 1 pods"):
        par.rank_flags(one, 1, LEADER)


@pytest.mark.parametrize("spec,tensor", [
    ({}, 1),
    ({"tensorParallelSize": 4}, 4),
    ({"parallelism": {"tensor": 4}}, 4),
    ({"tensorParallelSize": 4, "parallelism": {"tensor": 4}}, 4),
])
def test_tensor_parallel_size_and_parallelism_tensor_are_one_setting(spec, tensor):
    r = role(**spec)
    assert r.layout().tensor == tensor
    assert r.tensor_parallel_size == tensor  # what Python callers (renderer, planner) read
    assert api.RoleSpec.model_validate(r.model_dump(by_alias=True, exclude_none=True)) == r  # round-trips


def test_existing_manifests_are_unchanged_on_the_wire():
    """Nothing new is stored for a manifest that does not use the new fields but defaults; and no
    default for tensorParallelSize, which would contradict a spec that sets only parallelism.tensor."""
    from disagg.api import crd

    prefill = crd.openapi_schema()["properties"]["spec"]["properties"]["prefill"]["properties"]
    assert "default" not in prefill["tensorParallelSize"]
    assert prefill["podsPerReplica"]["default"] == 1 and prefill["parallelism"]["default"] == {}
    assert "default" not in prefill["parallelism"]["properties"]["tensor"]


def spec_with(role_name: str, **fields):
    doc = copy.deepcopy(EXAMPLE)
    doc["spec"][role_name].pop("tensorParallelSize")
    doc["spec"][role_name].update(fields)
    return doc


# (id, role, role fields, the admission message) - each refused by the models with admission's words
REFUSED = [
    ("tensor-both-different", "prefill", {"tensorParallelSize": 2, "parallelism": {"tensor": 4}},
     par.TENSOR_CONFLICT),
    ("data-without-expert", "decode", {"parallelism": {"data": 2}}, par.DATA_NEEDS_EXPERT),
    ("pods-split-ranks-unevenly", "prefill", {"parallelism": {"tensor": 3}, "podsPerReplica": 2},
     par.PODS_DIVIDE_RANKS),
    ("pods-split-data-unevenly", "prefill", {"parallelism": {"data": 3, "expert": True}, "podsPerReplica": 2},
     par.PODS_DIVIDE_DATA),
    ("data-local-wrong", "prefill", {"parallelism": {"data": 16, "dataLocal": 4, "expert": True},
                                     "podsPerReplica": 2}, par.DATA_LOCAL_MISMATCH),
    ("data-local-without-data", "prefill", {"parallelism": {"tensor": 2, "dataLocal": 2}}, par.DATA_LOCAL_MISMATCH),
    ("gpus-per-pod-wrong", "prefill", {"parallelism": {"pipeline": 2}, "podsPerReplica": 2,
                                       "resources": {"limits": {"nvidia.com/gpu": 2}}},
     "resources.limits: nvidia.com/gpu must equal the GPUs of each pod of a replica"),
    ("gpus-per-pod-wrong-request", "prefill", {"parallelism": {"tensor": 8}, "podsPerReplica": 2,
                                               "resources": {"requests": {"nvidia.com/gpu": "8"}}},
     "resources.requests: nvidia.com/gpu must equal the GPUs of each pod of a replica"),
    ("one-pod-tp-gpus-wrong", "prefill", {"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 2}}},
     "must equal the nvidia.com/gpu each replica requests in resources.limits"),
    ("decode-pipeline", "decode", {"parallelism": {"pipeline": 2}, "podsPerReplica": 2}, par.PIPELINE),
    ("prefill-pipeline", "prefill", {"parallelism": {"pipeline": 2}, "podsPerReplica": 2}, par.PIPELINE),
    ("prefill-pipeline-in-one-pod", "prefill", {"parallelism": {"pipeline": 2, "tensor": 2}}, par.PIPELINE),
    ("group-names-too-long", "prefill", {"parallelism": {"tensor": 2}, "podsPerReplica": 2, "replicas": 1,
                                         "maxReplicas": MAX_GROUP_REPLICAS + 1},
     "maxReplicas may be at most 1000 when podsPerReplica is above 1"),
]


@pytest.mark.parametrize("case,role_name,fields,message", REFUSED, ids=[c[0] for c in REFUSED])
def test_models_refuse_naming_the_field(case, role_name, fields, message):
    with pytest.raises(ValidationError) as err:
        api.DisaggDeployment.model_validate(spec_with(role_name, **fields))
    assert message in str(err.value)


def test_planner_budget_counts_every_pod_of_a_replica():
    doc = spec_with("prefill", parallelism={"tensor": 8}, podsPerReplica=2)
    doc["spec"]["slo"] = {"ttftMs": 500, "itlMs": 50}
    doc["spec"]["planner"] = {"enabled": True, "gpuBudget": 9}  # 8 for one prefill replica, 1 for decode
    assert api.DisaggDeployment.model_validate(doc).spec.gang_min_gpus() == 9
    doc["spec"]["planner"]["gpuBudget"] = 8
    with pytest.raises(ValidationError, match="planner.gpuBudget is below the GPUs the gang minimum needs"):
        api.DisaggDeployment.model_validate(doc)


def test_cel_and_models_share_their_messages():
    """Each layout rule's CEL message is the constant the models raise."""
    rules = api.RoleSpec.model_json_schema()["x-kubernetes-validations"]
    messages = {r["message"] for r in rules}
    for constant in (par.TENSOR_CONFLICT, par.DATA_NEEDS_EXPERT, par.PODS_DIVIDE_RANKS, par.PODS_DIVIDE_DATA,
                     par.DATA_LOCAL_MISMATCH):
        assert constant in messages
    spec_rules = api.DisaggDeploymentSpec.model_json_schema()["x-kubernetes-validations"]
    assert [r["fieldPath"] for r in spec_rules if r["message"] == par.PIPELINE] == \
        [".prefill.parallelism.pipeline", ".decode.parallelism.pipeline"]


def test_longest_pod_name_is_a_dns_label():
    longest = group_pod_name("a" * MAX_NAME_LENGTH, "prefill", MAX_GROUP_REPLICAS - 1, par.MAX_PODS_PER_REPLICA - 1)
    assert len(longest) == 63


_PARSE = """
import json, sys
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
fields = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "data_parallel_size_local",
          "data_parallel_start_rank", "data_parallel_address", "data_parallel_rpc_port", "nnodes", "node_rank",
          "master_addr", "master_port", "enable_expert_parallel", "distributed_executor_backend")
for flags in json.load(sys.stdin):
    ns = parser.parse_args(["--model", "m", *flags])
    args = AsyncEngineArgs.from_cli_args(ns)
    print(json.dumps({**{f: getattr(args, f) for f in fields}, "headless": ns.headless}))
"""


def test_vllm_parses_every_pods_flags(worker_python):
    """The flag names and values are vLLM 0.32's: its own `vllm serve` parser reads each pod's flags
    into the engine arguments the layout means."""
    cases = [(role(**spec).layout(), member) for _, spec, *_ in LAYOUTS
             for member in par.group(role(**spec).layout(), LEADER)]
    # -P: the repository's operator/ folder must not shadow the standard library's operator module.
    out = subprocess.run([worker_python, "-P", "-c", _PARSE], capture_output=True, text=True, timeout=300,
                         input=json.dumps([list(m.flags) for _, m in cases]))
    assert out.returncode == 0, out.stderr[-3000:]
    parsed = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(parsed) == len(cases)
    for (lay, member), got in zip(cases, parsed):
        assert (got["tensor_parallel_size"], got["pipeline_parallel_size"], got["data_parallel_size"],
                got["enable_expert_parallel"]) == (lay.tensor, lay.pipeline, lay.data, lay.expert)
        assert got["headless"] == member.headless
        if lay.multi_node:
            assert (got["nnodes"], got["node_rank"], got["master_addr"], got["master_port"],
                    got["distributed_executor_backend"]) == (lay.pods, member.index, LEADER, par.MASTER_PORT, "mp")
        else:
            assert got["nnodes"] == 1
        if lay.data_parallel_across_pods:
            assert (got["data_parallel_size_local"], got["data_parallel_address"],
                    got["data_parallel_rpc_port"]) == (lay.data_local, LEADER, par.DP_RPC_PORT)
            assert got["data_parallel_start_rank"] == (member.first_rank if member.index else None)
