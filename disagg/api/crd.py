"""Generates the CustomResourceDefinition in ``crds/`` from the pydantic models.

Pydantic's JSON schema is turned into a Kubernetes structural schema: references
inlined, ``Optional`` collapsed to an omittable field, nested objects given a
``{}`` default so their own defaults apply, titles dropped, int-or-string kept.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from . import v1alpha1 as api
from .names import GROUP

CRD_FILE = f"{GROUP}_{api.PLURAL}.yaml"

_DROP = {"title", "discriminator"}


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_resolve(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    if "$ref" in node:
        target = copy.deepcopy(defs[node.pop("$ref").rsplit("/", 1)[-1]])
        node = {**target, **node}  # a field's own description and default win
    if "allOf" in node and len(node["allOf"]) == 1:
        inner = node.pop("allOf")[0]
        node = {**_resolve(inner, defs), **node}
    if "anyOf" in node:
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) == 1:  # Optional[X]: omitted rather than null
            del node["anyOf"]
            node = {**_resolve(options[0], defs), **node}
            if node.get("default", 0) is None:
                del node["default"]
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: _resolve(prop, defs) for name, prop in value.items()}
        else:
            out[key] = _resolve(value, defs)
    return out


def _structural(node: Any) -> Any:
    """Kubernetes specifics on top of the resolved JSON schema."""
    if isinstance(node, list):
        return [_structural(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: _structural(v) for k, v in node.items()}
    if node.get("x-kubernetes-int-or-string"):
        node.pop("anyOf", None)
        node.pop("type", None)
    for bound in ("Minimum", "Maximum"):  # JSON Schema's numeric form -> OpenAPI v3.0's boolean form
        value = node.get(f"exclusive{bound}")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            node[bound.lower()] = value
            node[f"exclusive{bound}"] = True
    if "enum" in node and "type" not in node:
        node["type"] = "string"
    if node.get("type") == "object" and "properties" in node:
        node.pop("additionalProperties", None)
        for prop in node["properties"].values():
            if prop.pop(api.NO_DEFAULT, False):
                continue    # stays absent unless written (a CEL rule tells whether it was)
            # A nested object whose fields all have defaults gets `default: {}`,
            # so the API server fills in its defaults when the user omits it.
            if prop.get("type") == "object" and "properties" in prop and "default" not in prop \
                    and not prop.get("required"):
                prop["default"] = {}
    return node


def structural(model: type) -> dict[str, Any]:
    """A model's JSON schema as a Kubernetes structural schema."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(_resolve(raw, defs))


def openapi_schema(model: type = api.DisaggDeployment) -> dict[str, Any]:
    schema = structural(model)
    props = schema["properties"]
    # apiVersion, kind and metadata are the API server's; only describe them.
    props["apiVersion"] = {"type": "string", "description": "serving.disagg.dev/v1alpha1"}
    props["kind"] = {"type": "string", "description": "DisaggDeployment"}
    props["metadata"] = {"type": "object"}
    props["status"].pop("default", None)
    schema["required"] = ["spec"]
    schema["description"] = (
        "A disaggregated LLM deployment: prefill and decode vLLM workers placed as one gang in one "
        "fast-interconnect domain, KV cache moved with NIXL, an OpenAI-compatible KV-aware router in front, "
        "and an optional SLO planner sizing both roles.")
    schema["x-kubernetes-validations"] = [api.NAME_RULE]
    return schema


PRINTER_COLUMNS = [
    {"name": "Prefill", "type": "string", "jsonPath": ".status.prefill.summary",
     "description": "Prefill replicas ready/desired"},
    {"name": "Decode", "type": "string", "jsonPath": ".status.decode.summary",
     "description": "Decode replicas ready/desired"},
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "TTFT-ms", "type": "number", "jsonPath": ".status.latency.ttftMs",
     "description": "Observed time to first token at the SLO percentile, ms"},
    {"name": "ITL-ms", "type": "number", "jsonPath": ".status.latency.itlMs",
     "description": "Observed inter-token latency at the SLO percentile, ms"},
    {"name": "Endpoint", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"kind": api.KIND, "listKind": f"{api.KIND}List", "plural": api.PLURAL,
                      "singular": api.SINGULAR, "shortNames": api.SHORT_NAMES, "categories": ["all", "disagg"]},
            "versions": [{
                "name": api.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": openapi_schema()},
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
            }],
        },
    }


HEADER = "# Generated from disagg/api by `disagg crds`; do not edit by hand.\n"


def render() -> dict[str, str]:
    """File name -> content of every file in crds/."""
    body = yaml.safe_dump(crd(), sort_keys=False, width=120)
    return {CRD_FILE: HEADER + body}


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name, content in render().items():
        path = directory / name
        path.write_text(content)
        written.append(path)
    return written


# ---------------------------------------------------------------- the InferencePool CRD of the chart

# Where the chart keeps it: a template, not crds/, since Helm installs crds/ unconditionally and this one
# only with inferencePool.installCRD (a cluster whose gateway brought the Inference Extension's own CRD
# must not get a second).
INFERENCE_POOL_TEMPLATE = "inferencepool-crd.yaml"
CHART_TEMPLATES = Path(__file__).resolve().parent.parent.parent / "charts" / "disagg" / "templates"


def inference_pool_crd() -> dict[str, Any]:
    """The InferencePool v1 CRD (inference.networking.k8s.io), from disagg.api.inferencepool."""
    from . import inferencepool as pool

    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": pool.CRD_NAME, "annotations": {
            # *.k8s.io is a protected group: the API server takes a CRD of it only with the approval of its API,
            # the one the Inference Extension's own CRD carries (this is that API, the fields disagg writes)
            "api-approved.kubernetes.io": pool.API_APPROVAL,
            # kept on helm uninstall: deleting a CRD deletes every object of it, in every namespace, which
            # may be other releases' or other tools' pools too
            "helm.sh/resource-policy": "keep"}},
        "spec": {
            "group": pool.GROUP,
            "scope": "Namespaced",
            "names": {"kind": pool.KIND, "listKind": f"{pool.KIND}List", "plural": pool.PLURAL,
                      "singular": pool.SINGULAR, "shortNames": pool.SHORT_NAMES},
            "versions": [{
                "name": pool.VERSION,
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": pool.crd_schema()},
                "subresources": {"status": {}},
            }],
        },
    }


def render_chart_templates() -> dict[str, str]:
    """File name -> content of each chart template generated from the models."""
    body = yaml.safe_dump(inference_pool_crd(), sort_keys=False, width=120)
    # the chart's labels on it, like every object the chart renders
    body = body.replace("metadata:\n", "metadata:\n  labels:\n    {{- include \"disagg.labels\" . | nindent 4 }}\n", 1)
    assert "{{" not in yaml.safe_dump(inference_pool_crd()), "a template delimiter in the generated CRD"
    text = ("{{- /* Generated from disagg/api/inferencepool.py by `disagg crds`; do not edit by hand. */}}\n"
            "{{- if .Values.inferencePool.installCRD }}\n" + body + "{{- end }}\n")
    return {INFERENCE_POOL_TEMPLATE: text}


def write_chart_templates(directory: Path = CHART_TEMPLATES) -> list[Path]:
    written = []
    for name, content in render_chart_templates().items():
        path = directory / name
        path.write_text(content)
        written.append(path)
    return written
