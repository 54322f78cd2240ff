"""A layout as a DisaggDeployment, checked against the API before anyone applies it.

:func:`validate` runs the pydantic models (the single source of truth, whose cross-field validators
mirror the CRD's CEL rules) and then ``jsonschema`` against the CRD's own ``openAPIV3Schema`` (what
``crds/`` and the chart ship; tests hold them equal): types, required fields, enums, bounds, patterns,
unknown fields, which pydantic's lax mode lets through ("3" for an integer, an enum it only documents).
The CEL rules themselves are checked by the API server (tests create every frontier point on a real one).
"""

from __future__ import annotations

import copy
import math
import re
from functools import cache
from typing import Any

import jsonschema
import yaml

from disagg.api import crd
from disagg.api import v1alpha1 as api
from disagg.api.names import MAX_NAME_LENGTH
from disagg.perf.parallel import NVLINK_DOMAIN_KEY

from .estimate import Estimate, Result

TOPOLOGY_KEY = NVLINK_DOMAIN_KEY           # one NVLink domain (GPU Feature Discovery's label)


def default_name(result: Result, estimate: Estimate) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", result.setup.shape.name.split("/")[-1].lower()).strip("-") or "model"
    if not base[0].isalpha():
        base = "m-" + base
    suffix = "-agg" if estimate.mode == "aggregated" else "-disagg"
    return base[:MAX_NAME_LENGTH - len(suffix)].rstrip("-") + suffix


def _role(replicas: int, tp: int, extra_args: list[str], pods: int = 1, data: int = 1) -> dict[str, Any]:
    """A role of ``replicas`` replicas of TP ``tp``; wider than a node, each replica spans ``pods`` whole-node
    pods with tensor parallel across them (``podsPerReplica``, ``parallelism.tensor``; never pipeline).
    ``data`` > 1: ``data`` data-parallel engines of TP ``tp`` with expert parallel (``parallelism.data``,
    ``expert: true``), ``data / pods`` of them on each pod (dataLocal, derived)."""
    if data > 1:
        role: dict[str, Any] = {"replicas": replicas}
        if pods > 1:
            role["podsPerReplica"] = pods
        role.update({"parallelism": {"tensor": tp, "data": data, "expert": True},
                     "resources": {"limits": {api.GPU_RESOURCE: tp * data // pods}}, "extraArgs": extra_args})
        return role
    if pods <= 1:
        return {"replicas": replicas, "tensorParallelSize": tp,
                "resources": {"limits": {api.GPU_RESOURCE: tp}}, "extraArgs": extra_args}
    return {"replicas": replicas, "podsPerReplica": pods, "parallelism": {"tensor": tp},
            "resources": {"limits": {api.GPU_RESOURCE: tp // pods}}, "extraArgs": extra_args}


def manifest(result: Result, estimate: Estimate, name: str | None = None, namespace: str | None = None,
             source: str | None = None) -> dict[str, Any]:
    """The DisaggDeployment for ``estimate`` (a point of ``result``): roles, TP, replicas, engine limits
    matching what was estimated, placement for the interconnect, the SLO."""
    i = result.inputs
    setup = result.setup
    e = estimate
    b_rank = e.batch / e.decode_data                            # vLLM's --max-num-seqs is per engine (DP rank)
    b_max = math.ceil(b_rank + 2 * math.sqrt(b_rank))          # room for the batch's fluctuation
    engine_args = ["--max-model-len", str(i.isl + i.osl)]
    if i.precision == "fp8":
        engine_args += ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    if e.mode == "aggregated":
        prefill = _role(0, 1, [])
        decode = _role(e.decode_workers * e.replicas, e.decode_tp,
                       ["--max-num-seqs", str(b_max), "--max-num-batched-tokens", str(e.chunk_tokens)],
                       e.decode_pods)
        gang = {"minPrefill": 0, "minDecode": 1}
        router = {"disaggregation": "never"}
    else:
        # one prompt per prefill step (first come, first served: what the TTFT estimate assumes)
        budget = max(256, math.ceil(i.isl / 256) * 256)
        prefill = _role(e.prefill_workers * e.replicas, e.prefill_tp, ["--max-num-batched-tokens", str(budget)],
                        e.prefill_pods, e.prefill_data)
        decode = _role(e.decode_workers * e.replicas, e.decode_tp, ["--max-num-seqs", str(b_max)], e.decode_pods,
                       e.decode_data)
        gang = {"minPrefill": e.prefill_workers, "minDecode": e.decode_workers}
        router = {"disaggregation": "always"}
    spec: dict[str, Any] = {
        "model": {"name": setup.shape.name, "source": source or setup.source},
        "engine": {"args": engine_args},
        "prefill": prefill,
        "decode": decode,
        "router": router,
        "scheduling": {"gang": gang},
        "slo": {"ttftMs": i.ttft_ms, "itlMs": i.itl_ms, "percentile": i.percentile},
        "planner": {"enabled": False, "gpuBudget": i.gpus},
    }
    widest = max(e.prefill_gpus if e.mode == "disaggregated" else 0, e.decode_gpus)
    if (e.mode == "disaggregated" and setup.link.name == "nvlink") or max(e.prefill_pods, e.decode_pods) > 1:
        # KV moves over NVLink only inside one NVLink domain, and tensor parallel (or an expert all-to-all priced
        # over NVLink) across pods pays only inside one: the gang (each multi-pod replica, the operator's
        # per-replica PodGroup) must be placed in one. A data-parallel expert-parallel replica wider than a
        # domain was priced with its all-to-all over the network beyond the domain: packed where it can be.
        mode = "required" if widest <= i.domain else "preferred"
        spec["scheduling"]["topology"] = {"key": TOPOLOGY_KEY, "mode": mode}
    meta: dict[str, Any] = {"name": name or default_name(result, e)}
    if namespace:
        meta["namespace"] = namespace
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": meta, "spec": spec}


def to_yaml(result: Result, estimate: Estimate, **kwargs: Any) -> str:
    """The manifest with a header saying what was estimated for it (validated first)."""
    doc = manifest(result, estimate, **kwargs)
    validate(doc)
    i, e = result.inputs, estimate
    header = [
        f"# disagg configure: {result.setup.shape.name} on {e.gpus} x {result.setup.hw.name} "
        f"(budget {i.gpus}), ISL {i.isl} / OSL {i.osl}, prefix reuse {i.prefix_reuse:.0%}, "
        f"KV over {result.setup.link.name}",
        f"# layout {e.layout}, {e.batch} requests per decode worker"
        + (f" ({e.batch / e.decode_data:g} per data-parallel rank)" if e.decode_data > 1 else "") + ": estimated "
        f"{e.tokens_per_s_per_gpu:.1f} output tokens/s/GPU, {e.tokens_per_s_per_user:.1f} tokens/s/user,",
        f"# TTFT p{i.percentile:g} {e.ttft_s * 1000:.0f} ms (target {i.ttft_ms:g}), ITL p{i.percentile:g} "
        f"{e.itl_s * 1000:.1f} ms (target {i.itl_ms:g}), {e.request_rate:.2f} requests/s"
        + ("" if e.meets_slo else "  -- DOES NOT MEET THE SLO"),
        "# Set spec.planner.enabled: true (and leave replicas out) to let the planner resize it with the traffic.",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(doc, sort_keys=False)


# ---------------------------------------------------------------- validation

class SchemaError(ValueError):
    pass


def validate(doc: dict[str, Any]) -> api.DisaggDeployment:
    """Refuse what the API server would: the pydantic models (with the CEL rules' mirrors), then the CRD's
    schema. Returns the parsed object; a refusal names each offending field."""
    obj = api.DisaggDeployment.model_validate(doc)
    errors = sorted(_validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        raise SchemaError("; ".join(f"{_where(e)}: {e.message}" for e in errors))
    return obj


def _where(error: jsonschema.ValidationError) -> str:
    path = ".".join(str(p) for p in error.absolute_path) or "<root>"
    if error.validator == "additionalProperties":   # the unknown field is in the message, name it in the path
        extra = set(error.instance) - set(error.schema.get("properties", {}))
        path += "." + ",".join(sorted(extra)) if path != "<root>" else ",".join(sorted(extra))
    return path


@cache
def _validator() -> jsonschema.Draft4Validator:
    """A validator for the CRD's openAPIV3Schema. OpenAPI v3.0 is JSON Schema draft 4 (boolean
    exclusiveMinimum) plus Kubernetes' extensions, which jsonschema does not know: int-or-string becomes
    an ``anyOf``, and objects with declared fields refuse others (the API server's strict field validation,
    what ``kubectl apply`` asks for) unless marked ``x-kubernetes-preserve-unknown-fields``."""
    schema = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return jsonschema.Draft4Validator(_kubernetes_dialect(copy.deepcopy(schema)))


def _kubernetes_dialect(node: Any) -> Any:
    if isinstance(node, list):
        return [_kubernetes_dialect(n) for n in node]
    if not isinstance(node, dict):
        return node
    node = {k: (_kubernetes_dialect(v) if k in ("items", "additionalProperties", "anyOf", "allOf",
                                                 "oneOf", "not") else v) for k, v in node.items()}
    if "properties" in node:
        node["properties"] = {k: _kubernetes_dialect(v) for k, v in node["properties"].items()}
    if node.get("x-kubernetes-int-or-string"):
        node.pop("anyOf", None)
        node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if node.get("nullable") and "type" in node:
        node["type"] = [node["type"], "null"]
    if node.get("type") == "object" and "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        node.setdefault("additionalProperties", False)
    return node
