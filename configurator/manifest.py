"""A layout as a DisaggDeployment, checked against the API before anyone applies it.

:func:`validate` runs the pydantic models (the single source of truth, whose cross-field validators
mirror the CRD's CEL rules) and then the structural OpenAPI schema generated from them for ``crds/``
(types, required fields, enums, bounds, patterns, unknown fields), so what it accepts the API server
accepts.
"""

from __future__ import annotations

import copy
import math
import re
from functools import cache
from typing import Any

import yaml

from disagg.api import crd
from disagg.api import v1alpha1 as api
from disagg.api.names import MAX_NAME_LENGTH

from .estimate import Estimate, Result

TOPOLOGY_KEY = "nvidia.com/gpu.clique"   # one NVLink domain (GPU Feature Discovery's label)


def default_name(result: Result, estimate: Estimate) -> str:
    base = re.sub(r"[^a-z0-9]+", "-", result.setup.shape.name.split("/")[-1].lower()).strip("-") or "model"
    if not base[0].isalpha():
        base = "m-" + base
    suffix = "-agg" if estimate.mode == "aggregated" else "-disagg"
    return base[:MAX_NAME_LENGTH - len(suffix)].rstrip("-") + suffix


def _role(replicas: int, tp: int, extra_args: list[str]) -> dict[str, Any]:
    return {"replicas": replicas, "tensorParallelSize": tp,
            "resources": {"limits": {api.GPU_RESOURCE: tp}}, "extraArgs": extra_args}


def manifest(result: Result, estimate: Estimate, name: str | None = None, namespace: str | None = None,
             source: str | None = None) -> dict[str, Any]:
    """The DisaggDeployment for ``estimate`` (a point of ``result``): roles, TP, replicas, engine limits
    matching what was estimated, placement for the interconnect, the SLO."""
    i = result.inputs
    setup = result.setup
    e = estimate
    b_max = math.ceil(e.batch + 2 * math.sqrt(e.batch))        # room for the batch's fluctuation
    engine_args = ["--max-model-len", str(i.isl + i.osl)]
    if i.precision == "fp8":
        engine_args += ["--quantization", "fp8", "--kv-cache-dtype", "fp8"]
    if e.mode == "aggregated":
        prefill = _role(0, 1, [])
        decode = _role(e.decode_workers * e.replicas, e.decode_tp,
                       ["--max-num-seqs", str(b_max), "--max-num-batched-tokens", str(e.chunk_tokens)])
        gang = {"minPrefill": 0, "minDecode": 1}
        router = {"disaggregation": "never"}
    else:
        # one prompt per prefill step (first come, first served: what the TTFT estimate assumes)
        budget = max(256, math.ceil(i.isl / 256) * 256)
        prefill = _role(e.prefill_workers * e.replicas, e.prefill_tp, ["--max-num-batched-tokens", str(budget)])
        decode = _role(e.decode_workers * e.replicas, e.decode_tp, ["--max-num-seqs", str(b_max)])
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
    if e.mode == "disaggregated" and setup.link.name == "nvlink":
        # KV moves over NVLink only inside one NVLink domain: the gang must be placed in one
        spec["scheduling"]["topology"] = {"key": TOPOLOGY_KEY, "mode": "required"}
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
        f"# layout {e.layout}, {e.batch} requests per decode worker: estimated "
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
    """Refuse what the API server would: the pydantic models (with the CEL rules' mirrors), then the
    generated structural schema. Returns the parsed object."""
    obj = api.DisaggDeployment.model_validate(doc)
    errors: list[str] = []
    _check(doc, _schema(), "", errors)
    if errors:
        raise SchemaError("; ".join(errors))
    return obj


@cache
def _schema_cached() -> dict[str, Any]:
    return crd.openapi_schema()


def _schema() -> dict[str, Any]:
    """The generated CRD schema (computed once; a copy, so no caller can alter the cached one)."""
    return copy.deepcopy(_schema_cached())


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def _check(value: Any, schema: dict[str, Any], path: str, errors: list[str]) -> None:
    where = path or "<root>"
    if schema.get("x-kubernetes-int-or-string"):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            errors.append(f"{where}: must be an integer or a string")
        return
    t = schema.get("type")
    if t == "integer":
        if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, float) and value.is_integer())):
            errors.append(f"{where}: must be an integer")
            return
    elif t == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            errors.append(f"{where}: must be a number")
            return
    elif t in _TYPES and not isinstance(value, _TYPES[t]):
        errors.append(f"{where}: must be of type {t}")
        return
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is not None and (value < lo or (schema.get("exclusiveMinimum") is True and value == lo)):
            errors.append(f"{where}: {value} is below its minimum {lo}")
        if hi is not None and (value > hi or (schema.get("exclusiveMaximum") is True and value == hi)):
            errors.append(f"{where}: {value} is above its maximum {hi}")
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", math.inf) or len(value) < schema.get("minLength", 0):
            errors.append(f"{where}: length {len(value)} is out of bounds")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            errors.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", math.inf) or len(value) < schema.get("minItems", 0):
            errors.append(f"{where}: {len(value)} items is out of bounds")
        for n, item in enumerate(value):
            _check(item, schema.get("items", {}), f"{path}[{n}]", errors)
    if isinstance(value, dict):
        if len(value) > schema.get("maxProperties", math.inf):
            errors.append(f"{where}: too many entries")
        for req in schema.get("required", ()):
            if req not in value:
                errors.append(f"{path + '.' if path else ''}{req}: required")
        props = schema.get("properties")
        for key, item in value.items():
            sub = f"{path}.{key}" if path else key
            if props is not None:
                if key not in props:
                    errors.append(f"{sub}: unknown field")
                else:
                    _check(item, props[key], sub, errors)
            elif isinstance(schema.get("additionalProperties"), dict):
                _check(item, schema["additionalProperties"], sub, errors)
