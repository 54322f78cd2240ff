"""The API server refuses bad DisaggDeployments at admission, naming the field;
the pydantic models refuse the same specs for Python callers."""

import copy
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from disagg.api import parallelism as par
from disagg.api import v1alpha1 as api
from disagg.api.names import MAX_GROUP_REPLICAS

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = yaml.safe_load((REPO / "examples" / "small.yaml").read_text())


def _set(doc, path, value):
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value


_DELETE = object()

# (id, edits, text the API server's message must contain)
INVALID = [
    ("negative-replicas", {"spec.prefill.replicas": -1}, "spec.prefill.replicas"),
    ("min-above-replicas", {"spec.decode.minReplicas": 3}, "spec.decode.minReplicas"),
    ("above-max", {"spec.decode.maxReplicas": 1}, "spec.decode.replicas"),
    ("tp4-on-2-gpus", {"spec.prefill.tensorParallelSize": 4,
                       "spec.prefill.resources": {"limits": {"nvidia.com/gpu": 2}}}, "spec.prefill.tensorParallelSize"),
    ("ttft-zero", {"spec.slo": {"ttftMs": 0, "itlMs": 50}}, "spec.slo.ttftMs"),
    ("unknown-gang-backend", {"spec.scheduling.gang.backend": "kueue"}, "spec.scheduling.gang.backend"),
    ("missing-model", {"spec.model": _DELETE}, "spec.model"),
    ("gang-above-replicas", {"spec.scheduling.gang.minPrefill": 2}, "spec.scheduling.gang.minPrefill"),
    ("planner-without-slo", {"spec.planner.enabled": True}, "spec.planner.enabled"),
    ("name-too-long", {"metadata.name": "a" * 49}, "metadata.name"),
    ("name-not-dns1035", {"metadata.name": "9lives"}, "metadata.name"),
    ("s3-without-tokenizer", {"spec.model.source": "s3://bucket/llama"}, "spec.model.tokenizer"),
    ("role-sets-block-size", {"spec.decode.extraArgs": ["--block-size", "32"]}, "spec.decode.extraArgs"),
    ("role-sets-context", {"spec.prefill.extraArgs": ["--max-model-len=8192"]}, "spec.prefill.extraArgs"),
    ("router-auth-bad-secret-name", {"spec.router.auth": {"secretName": "My_Keys"}}, "spec.router.auth.secretName"),
    ("router-auth-without-secret", {"spec.router.auth": {"key": "keys"}}, "spec.router.auth.secretName"),
    ("router-auth-bad-key", {"spec.router.auth": {"secretName": "keys", "key": "a/b"}}, "spec.router.auth.key"),
    ("router-auth-unknown-field", {"spec.router.auth": {"secretName": "keys", "apiKey": "sk-1"}},
     "spec.router.auth"),
    ("router-body-limit-tiny", {"spec.router.maxBodyBytes": 10}, "spec.router.maxBodyBytes"),
    ("router-processes-too-many", {"spec.router.processes": 17}, "spec.router.processes"),
    ("router-processes-zero", {"spec.router.processes": 0}, "spec.router.processes"),
    ("router-in-flight-below-processes", {"spec.router.processes": 4, "spec.router.maxInFlight": 2},
     "spec.router.maxInFlight"),
    # removed: a URL any namespace user wrote, fetched by the planner's pod; the message names the replacement
    ("planner-prometheus-url", {"spec.planner.prometheusUrl": "http://169.254.169.254/"},
     "spec.planner.prometheusUrl"),
    ("planner-prometheus-not-a-name", {"spec.planner.prometheus": "http://prom:9090"}, "spec.planner.prometheus"),
    # spec.router.mode picker (the router as a gateway's endpoint picker) and its settings
    ("router-mode-unknown", {"spec.router.mode": "sidecar"}, "spec.router.mode"),
    ("router-picker-in-proxy-mode", {"spec.router.picker": {"port": 9003}}, "spec.router.picker"),
    ("router-picker-on-the-http-port", {"spec.router.mode": "picker", "spec.router.picker": {"port": 8000}},
     "spec.router.picker.port"),
    ("router-picker-on-a-metrics-port", {"spec.router.mode": "picker", "spec.router.processes": 2,
                                         "spec.router.picker": {"port": 9201}}, "spec.router.picker.port"),
    ("router-picker-privileged-port", {"spec.router.mode": "picker", "spec.router.picker": {"port": 443}},
     "spec.router.picker.port"),
    ("router-picker-failure-mode", {"spec.router.mode": "picker", "spec.router.picker": {"failureMode": "Open"}},
     "spec.router.picker.failureMode"),
    ("router-picker-selector-without-values", {"spec.router.mode": "picker", "spec.router.picker": {
        "gatewayNamespaceSelector": {"matchExpressions": [{"key": "team", "operator": "In"}]}}},
     "spec.router.picker.gatewayNamespaceSelector.matchExpressions[0].values"),
    # LoRA adapters (spec.model.adapters): LoRA must be on first, names unique and not the base model's
    ("adapters-without-max-loras", {"spec.model.adapters": [{"name": "sql", "source": "hf://org/sql-lora"}]},
     "spec.model.maxLoras"),
    ("adapter-names-duplicate", {"spec.model.maxLoras": 2, "spec.model.adapters": [
        {"name": "sql", "source": "hf://org/sql-lora"}, {"name": "sql", "source": "/adapters/sql"}]},
     "spec.model.adapters"),
    ("adapter-named-as-the-base", {"spec.model.maxLoras": 2, "spec.model.adapters": [
        {"name": "qwen2.5-1.5b-instruct", "source": "hf://org/sql-lora"}]}, "spec.model.adapters"),
    ("adapter-from-s3", {"spec.model.maxLoras": 2, "spec.model.adapters": [
        {"name": "sql", "source": "s3://bucket/sql-lora"}]}, "spec.model.adapters[0].source"),
    ("adapter-rank-not-vllms", {"spec.model.maxLoras": 2, "spec.model.maxLoraRank": 12},
     "spec.model.maxLoraRank"),
]


def invalid(edits):
    doc = copy.deepcopy(EXAMPLE)
    for path, value in edits.items():
        _set(doc, path, value)
    return doc


@pytest.mark.parametrize("case,edits,field", INVALID, ids=[c[0] for c in INVALID])
def test_api_server_refuses_naming_the_field(case, edits, field, cluster, crd_installed, namespace):
    doc = invalid(edits)
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert out.returncode != 0, f"{case}: accepted but should have been refused"
    assert field in out.stderr, f"{case}: message does not name {field}: {out.stderr}"
    got = cluster.kubectl("get", "dd", "-n", namespace, "-o", "name", check=False)
    assert got.stdout.strip() == "", "nothing may be stored for a refused spec"


@pytest.mark.parametrize("case,edits,field", INVALID, ids=[c[0] for c in INVALID])
def test_models_refuse_the_same_specs(case, edits, field):
    with pytest.raises(ValidationError):
        api.DisaggDeployment.model_validate(invalid(edits))


# Replicas of several pods: (id, edits, the field the API server names, the message both it and the
# models give). examples/small.yaml sets tensorParallelSize: 1 on both roles.
LAYOUT_INVALID = [
    ("tensor-both-different", {"spec.prefill.parallelism": {"tensor": 2}}, "spec.prefill.parallelism.tensor",
     par.TENSOR_CONFLICT),
    ("data-without-expert", {"spec.decode.parallelism": {"data": 2}}, "spec.decode.parallelism.data",
     par.DATA_NEEDS_EXPERT),
    ("pods-split-ranks-unevenly", {"spec.prefill.tensorParallelSize": 3, "spec.prefill.podsPerReplica": 2},
     "spec.prefill.podsPerReplica", par.PODS_DIVIDE_RANKS),
    ("pods-split-data-unevenly", {"spec.prefill.parallelism": {"data": 3, "expert": True},
                                  "spec.prefill.podsPerReplica": 2}, "spec.prefill.podsPerReplica",
     par.PODS_DIVIDE_DATA),
    ("data-local-wrong", {"spec.prefill.parallelism": {"data": 16, "dataLocal": 4, "expert": True},
                          "spec.prefill.podsPerReplica": 2}, "spec.prefill.parallelism.dataLocal",
     par.DATA_LOCAL_MISMATCH),
    ("gpus-per-pod-wrong", {"spec.prefill.parallelism": {"tensor": 2}, "spec.prefill.tensorParallelSize": _DELETE,
                            "spec.prefill.podsPerReplica": 2,
                            "spec.prefill.resources": {"limits": {"nvidia.com/gpu": 2}}},
     "spec.prefill.resources.limits", "nvidia.com/gpu must equal the GPUs of each pod of a replica"),
    ("decode-pipeline", {"spec.decode.parallelism": {"pipeline": 2}, "spec.decode.podsPerReplica": 2},
     "spec.decode.parallelism.pipeline", par.PIPELINE),
    ("prefill-pipeline", {"spec.prefill.parallelism": {"pipeline": 2}, "spec.prefill.podsPerReplica": 2},
     "spec.prefill.parallelism.pipeline", par.PIPELINE),
    ("group-names-too-long", {"spec.prefill.tensorParallelSize": 2, "spec.prefill.podsPerReplica": 2,
                              "spec.prefill.maxReplicas": MAX_GROUP_REPLICAS + 1}, "spec.prefill.replicas",
     f"maxReplicas may be at most {MAX_GROUP_REPLICAS} when podsPerReplica is above 1"),
    ("pods-per-replica-zero", {"spec.prefill.podsPerReplica": 0}, "spec.prefill.podsPerReplica", None),
    ("gpu-budget-counts-every-pod", {"spec.prefill.tensorParallelSize": _DELETE,
                                     "spec.prefill.parallelism": {"tensor": 8},
                                     "spec.prefill.podsPerReplica": 2, "spec.slo": {"ttftMs": 500, "itlMs": 50},
                                     "spec.planner": {"enabled": True, "gpuBudget": 8}},
     "spec.planner.gpuBudget", "planner.gpuBudget is below the GPUs the gang minimum needs"),
]


@pytest.mark.parametrize("case,edits,field,message", LAYOUT_INVALID, ids=[c[0] for c in LAYOUT_INVALID])
def test_layouts_refused_at_admission_and_by_the_models_alike(case, edits, field, message, cluster,
                                                               crd_installed, namespace):
    doc = invalid(edits)
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert out.returncode != 0, f"{case}: accepted but should have been refused"
    assert field in out.stderr, f"{case}: message does not name {field}: {out.stderr}"
    with pytest.raises(ValidationError) as err:
        api.DisaggDeployment.model_validate(doc)
    if message:
        assert message in out.stderr and message in str(err.value)


# Layouts admission takes, with the GPUs each pod and each replica gets.
LAYOUT_VALID = [
    ("tp2-over-2-pods", {"parallelism": {"tensor": 2}, "podsPerReplica": 2}, 1, 2),
    ("tp16-over-4-pods", {"parallelism": {"tensor": 16}, "podsPerReplica": 4,
                          "resources": {"limits": {"nvidia.com/gpu": "4"}}}, 4, 16),
    ("dp16-ep-over-2-pods", {"parallelism": {"data": 16, "dataLocal": 8, "expert": True}, "podsPerReplica": 2}, 8, 16),
]


@pytest.mark.parametrize("case,prefill,per_pod,per_replica", LAYOUT_VALID, ids=[c[0] for c in LAYOUT_VALID])
def test_multi_pod_layouts_are_accepted(case, prefill, per_pod, per_replica, cluster, crd_installed, namespace):
    """Set with parallelism alone (no tensorParallelSize anywhere), with a GPU budget whose rule reads the
    sizes: the API server defaults, validates and stores it, and the models read back the same layout."""
    doc = copy.deepcopy(EXAMPLE)
    doc["spec"]["prefill"] = {"replicas": 1, **prefill}
    del doc["spec"]["decode"]["tensorParallelSize"]
    doc["spec"]["slo"] = {"ttftMs": 500, "itlMs": 50}
    doc["spec"]["planner"] = {"enabled": True, "gpuBudget": per_replica + 1}
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert out.returncode == 0, out.stderr
    got = yaml.safe_load(cluster.kubectl("get", "dd", "qwen-small", "-n", namespace, "-o", "yaml").stdout)
    assert "tensorParallelSize" not in got["spec"]["prefill"]  # no default contradicts parallelism.tensor
    assert got["spec"]["decode"]["parallelism"] == {"pipeline": 1, "data": 1, "expert": False}
    stored = api.DisaggDeployment.model_validate({k: v for k, v in got.items() if k != "status"})
    lay = stored.spec.prefill.layout()
    assert (lay.gpus_per_pod, lay.gpus_per_replica) == (per_pod, per_replica)
    assert stored.spec.decode.layout().gpus_per_replica == 1 and stored.spec.decode.tensor_parallel_size == 1


@pytest.mark.parametrize("gpus", [2, "2"])
def test_cross_field_message_explains_the_rule(gpus, cluster, crd_installed, namespace):
    doc = invalid({"spec.prefill.tensorParallelSize": 4, "spec.prefill.resources": {"limits": {"nvidia.com/gpu": gpus}}})
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert "spec.prefill.tensorParallelSize" in out.stderr
    assert "must equal the nvidia.com/gpu each replica requests in resources.limits" in out.stderr
    # the models say the same with the numbers
    with pytest.raises(ValidationError, match=r"tensorParallelSize \(4\) must equal .* \(2\)"):
        api.DisaggDeployment.model_validate(doc)


@pytest.mark.parametrize("gpus", [1, "1"])
def test_matching_gpu_request_is_accepted(gpus, cluster, crd_installed, namespace):
    doc = invalid({"spec.prefill.resources": {"limits": {"nvidia.com/gpu": gpus}}})
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert out.returncode == 0, out.stderr


# spec.flex (issue 31): a flex worker serves both roles with one engine, so prefill and decode must be one
# shape; (id, edits, what the message must name besides spec.flex)
FLEX = {"spec.flex": {"replicas": 1, "maxReplicas": 4}}
FLEX_INVALID = [
    ("flex-tensor-differs", {**FLEX, "spec.decode.tensorParallelSize": 2,
                             "spec.decode.resources": {"limits": {"nvidia.com/gpu": 2}}}, "tensor parallel size"),
    ("flex-pods-differ", {**FLEX, "spec.prefill.tensorParallelSize": 2, "spec.decode.tensorParallelSize": 2,
                          "spec.prefill.podsPerReplica": 2}, "podsPerReplica"),
    ("flex-resources-differ", {**FLEX, "spec.prefill.resources": {"limits": {"nvidia.com/gpu": 1, "memory": "64Gi"}}},
     "resources"),
    ("flex-extra-args-differ", {**FLEX, "spec.decode.extraArgs": ["--max-num-seqs", "64"]}, "extraArgs"),
    ("flex-multi-pod", {**FLEX, **{f"spec.{r}.{k}": v for r in ("prefill", "decode") for k, v in
                                   (("tensorParallelSize", 2), ("podsPerReplica", 2))}}, "podsPerReplica above 1"),
    ("flex-without-prefill-work", {**FLEX, "spec.router.disaggregation": "never"}, "router.disaggregation never"),
    ("flex-above-max", {"spec.flex": {"replicas": 5, "maxReplicas": 4}}, "spec.flex.replicas"),
    ("flex-min-above-replicas", {"spec.flex": {"replicas": 1, "minReplicas": 2}}, "spec.flex.minReplicas"),
]


@pytest.mark.parametrize("case,edits,names", FLEX_INVALID, ids=[c[0] for c in FLEX_INVALID])
def test_flex_pool_refused_unless_both_roles_share_its_shape(case, edits, names, cluster, crd_installed, namespace):
    doc = invalid(edits)
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    assert out.returncode != 0, f"{case}: accepted but should have been refused"
    assert "spec.flex" in out.stderr and names in out.stderr, f"{case}: {out.stderr}"
    with pytest.raises(ValidationError, match=names.removeprefix("spec.")):
        api.DisaggDeployment.model_validate(doc)


def test_flex_pool_of_the_shared_shape_is_accepted(cluster, crd_installed, namespace):
    doc = invalid({**FLEX, "spec.prefill.extraArgs": ["--max-num-seqs", "64"],
                   "spec.decode.extraArgs": ["--max-num-seqs", "64"]})
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    got = yaml.safe_load(cluster.kubectl("get", "dd", doc["metadata"]["name"], "-n", namespace, "-o",
                                         "yaml").stdout)
    assert got["spec"]["flex"] == {"replicas": 1, "maxReplicas": 4, "switchDrainSeconds": 120}
    assert api.DisaggDeployment.model_validate({k: v for k, v in got.items() if k != "status"}).spec.flex.replicas == 1
    # once set it stays: its Deployment and Service would outlive it (the operator deletes neither)
    out = cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "small.yaml"), check=False)
    assert out.returncode != 0 and "spec.flex" in out.stderr and "replicas to 0" in out.stderr, out.stderr
    cluster.kubectl("delete", "dd", doc["metadata"]["name"], "-n", namespace)
    # without spec.flex nothing is stored for it (the CEL rules can tell it was not written)
    plain = yaml.safe_load(cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "small.yaml"),
                                           "-o", "yaml").stdout)
    assert "flex" not in plain["spec"]


def test_valid_example_is_accepted_with_defaults(cluster, crd_installed, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "small.yaml"))
    got = yaml.safe_load(cluster.kubectl("get", "dd", "qwen-small", "-n", namespace, "-o", "yaml").stdout)
    spec = got["spec"]
    assert spec["scheduling"]["gang"]["backend"] == "workload-api"  # defaulted by the schema
    assert spec["router"]["policy"] == "kv-aware" and spec["kvTransfer"]["backends"] == ["UCX"]
    # what the server stored parses back into the models
    api.DisaggDeployment.model_validate({k: v for k, v in got.items() if k != "status"})


def test_picker_settings_stay_absent_unless_written(cluster, crd_installed, namespace):
    """spec.router.picker has no default (so admission can refuse it outside picker mode): a proxy deployment
    is stored without it, a picker deployment that leaves it out too (the models fill in its defaults)."""
    for mode in ("proxy", "picker"):
        doc = invalid({"metadata.name": f"m-{mode}", "spec.router.mode": mode})
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
        got = yaml.safe_load(cluster.kubectl("get", "dd", f"m-{mode}", "-n", namespace, "-o", "yaml").stdout)
        assert got["spec"]["router"]["mode"] == mode and "picker" not in got["spec"]["router"]
        stored = api.DisaggDeployment.model_validate({k: v for k, v in got.items() if k != "status"})
        assert (stored.spec.router.picker_settings() == api.PickerSpec()) is (mode == "picker")


def test_explain_prints_the_descriptions(cluster, crd_installed):
    out = " ".join(cluster.kubectl("explain", "dd.spec.prefill").stdout.split())  # as read, not as wrapped
    assert "Prefill workers." in out
    assert "tensorParallelSize" in out and "the GPUs each layer is sharded over" in out
    out = cluster.kubectl("explain", "dd.spec.scheduling.gang.backend").stdout
    assert "workload-api" in out
    out = cluster.kubectl("explain", "dd.spec.prefill.parallelism").stdout
    for field in ("tensor", "pipeline", "data", "dataLocal", "expert"):
        assert f"{field}\t" in out, out
    out = " ".join(cluster.kubectl("explain", "dd.spec.prefill.parallelism.tensor").stdout.split())
    assert "The same setting as tensorParallelSize, its older spelling" in out
    out = " ".join(cluster.kubectl("explain", "dd.spec.decode.podsPerReplica").stdout.split())
    assert "Pod 0 is the leader: it serves HTTP" in out


def test_printer_columns_show(cluster, crd_installed, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "small.yaml"))
    header = cluster.kubectl("get", "dd", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "PREFILL", "DECODE", "PHASE", "TTFT-MS", "ITL-MS", "AGE"]
