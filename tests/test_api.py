"""The API models and the CRD generated from them (no cluster needed)."""

import copy
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from disagg.api import crd
from disagg.api import v1alpha1 as api
from disagg.api.names import MAX_NAME_LENGTH, child_name

REPO = Path(__file__).resolve().parent.parent


def test_crds_folder_matches_the_models():
    for name, content in crd.render().items():
        path = REPO / "crds" / name
        assert path.exists(), f"{path} missing: run `make crds`"
        assert path.read_text() == content, f"{path} drifted from disagg/api: run `make crds`"


def _walk(schema, path="<root>"):
    yield path, schema
    for name, prop in schema.get("properties", {}).items():
        yield from _walk(prop, f"{path}.{name}")
    if "items" in schema:
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural_and_documented():
    schema = crd.openapi_schema()
    for path, node in _walk(schema):
        assert "$ref" not in node and "allOf" not in node and "title" not in node, path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"{path} has no type"
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), f"{path}: anyOf only for int-or-string"
    spec = schema["properties"]["spec"]
    for path, node in _walk(spec, "spec"):
        if path.endswith(("{}", "[]")):  # list items and map values: their field has the description
            continue
        assert node.get("description"), f"{path} has no description"


def test_printer_columns_and_status_subresource():
    version = crd.crd()["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    names = [c["name"] for c in version["additionalPrinterColumns"]]
    assert names[:5] == ["Prefill", "Decode", "Phase", "TTFT-ms", "ITL-ms"] and "Age" in names
    assert crd.crd()["spec"]["names"]["shortNames"] == ["dd"]


def test_example_parses_and_defaults_apply():
    doc = yaml.safe_load((REPO / "examples" / "small.yaml").read_text())
    dd = api.DisaggDeployment.model_validate(doc)
    assert dd.spec.scheduling.gang.backend == "workload-api"
    assert dd.spec.router.policy == "kv-aware"
    assert dd.spec.kv_transfer.backends == ["UCX"]
    assert dd.spec.prefill.gpus() == 1
    # round-trips to the same wire form
    assert api.DisaggDeployment.model_validate(dd.to_manifest()) == dd


def test_child_names_stay_valid_and_stable():
    longest = "a" * MAX_NAME_LENGTH
    assert child_name(longest, "prefill") == f"{longest}-prefill"
    too_long = "b" * 80
    short = child_name(too_long, "decode")
    assert len(short) <= 63 and short.endswith("-decode") and short == child_name(too_long, "decode")
    assert child_name("b" * 79 + "c", "decode") != short


def base_spec():
    return copy.deepcopy(yaml.safe_load((REPO / "examples" / "small.yaml").read_text()))


@pytest.mark.parametrize("gpus,ok", [(1, True), ("1", True), (2, False)])
def test_tensor_parallel_must_match_gpus(gpus, ok):
    doc = base_spec()
    doc["spec"]["prefill"]["resources"] = {"limits": {"nvidia.com/gpu": gpus}}
    if ok:
        api.DisaggDeployment.model_validate(doc)
    else:
        with pytest.raises(ValidationError, match="tensorParallelSize"):
            api.DisaggDeployment.model_validate(doc)


@pytest.mark.parametrize("tracing, ok", [
    ({"otlpEndpoint": "http://otel-collector.monitoring:4317"}, True),
    ({"otlpEndpoint": "https://tempo.example.com:443", "samplingRatio": 0.01}, True),
    ({"otlpEndpoint": "otel-collector:4317"}, False),                 # no scheme: gRPC exporters need one
    ({"otlpEndpoint": "http://otel:4317/v1/traces"}, False),          # a path: OTLP/HTTP's, not gRPC's
    ({"otlpEndpoint": "http://otel:4317", "samplingRatio": 1.5}, False),
    ({"samplingRatio": 0.5}, False),
])
def test_spec_tracing_is_checked_by_the_models_and_the_crds_schema(tracing, ok):
    """spec.tracing: the same endpoints and ratios refused by the models and by the CRD's own schema (what
    the API server checks at admission)."""
    from disagg.configurator.manifest import _validator
    from disagg.e2e.testing import dd_manifest

    manifest = dd_manifest(tracing=tracing)
    if ok:
        assert api.DisaggDeployment.model_validate(manifest).spec.tracing.otlp_endpoint == tracing["otlpEndpoint"]
    else:
        with pytest.raises(ValidationError, match="tracing"):
            api.DisaggDeployment.model_validate(manifest)
    assert (not list(_validator().iter_errors(manifest))) == ok
