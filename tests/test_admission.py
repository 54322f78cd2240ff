"""The API server refuses bad DisaggDeployments at admission, naming the field;
the pydantic models refuse the same specs for Python callers."""

import copy
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from disagg.api import v1alpha1 as api

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


def test_valid_example_is_accepted_with_defaults(cluster, crd_installed, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "small.yaml"))
    got = yaml.safe_load(cluster.kubectl("get", "dd", "qwen-small", "-n", namespace, "-o", "yaml").stdout)
    spec = got["spec"]
    assert spec["scheduling"]["gang"]["backend"] == "workload-api"  # defaulted by the schema
    assert spec["router"]["policy"] == "kv-aware" and spec["kvTransfer"]["backends"] == ["UCX"]
    # what the server stored parses back into the models
    api.DisaggDeployment.model_validate({k: v for k, v in got.items() if k != "status"})


def test_explain_prints_the_descriptions(cluster, crd_installed):
    out = cluster.kubectl("explain", "dd.spec.prefill").stdout
    assert "Prefill workers." in out
    assert "tensorParallelSize" in out and "GPUs one replica shards the model over" in out
    out = cluster.kubectl("explain", "dd.spec.scheduling.gang.backend").stdout
    assert "workload-api" in out


def test_printer_columns_show(cluster, crd_installed, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", str(REPO / "examples" / "small.yaml"))
    header = cluster.kubectl("get", "dd", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "PREFILL", "DECODE", "PHASE", "TTFT-MS", "ITL-MS", "AGE"]
