"""The Gateway API Inference Extension's InferencePool (inference.networking.k8s.io/v1): the fields of its v1
API (v1.0.0) that an InferencePool needs, as models.

The operator renders a DisaggDeployment's InferencePool (spec.router.mode picker) through these models, and
``disagg crds`` generates from them the CRD the chart installs with ``inferencePool.installCRD=true``
(charts/disagg/templates/inferencepool-crd.yaml): one source for both. The CRD carries the Inference
Extension's own names (``inferencepools.inference.networking.k8s.io``, short name ``infpool``), field names,
bounds, defaults and endpointPickerRef rule, so a gateway written against that API reads these pools, and the
Inference Extension's own CRD applied later replaces this one. Its status is kept as the gateways write it.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field

from .v1alpha1 import PickerFailureMode, _Model, _validations, cel

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferencePool"
PLURAL = "inferencepools"
SINGULAR = "inferencepool"
SHORT_NAMES = ["infpool"]
CRD_NAME = f"{PLURAL}.{GROUP}"
# The approval of this API (api-approved.kubernetes.io, which a CRD of a *.k8s.io group must carry), as the
# Gateway API Inference Extension's own v1.0.0 CRD has it.
API_APPROVAL = "https://github.com/kubernetes-sigs/gateway-api-inference-extension/pull/1173"

_GROUP_PATTERN = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_KIND_PATTERN = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


class Port(_Model):
    number: int = Field(ge=1, le=65535, description="The port number (1 to 65535).")


class LabelSelector(_Model):
    match_labels: dict[str, Annotated[str, Field(max_length=63, pattern=_LABEL_VALUE)]] = Field(
        min_length=1, max_length=64,
        description="Labels a pod must carry, all of them, to be a member of the pool (pods of the pool's "
                    "namespace only).")


class EndpointPickerRef(_Model):
    model_config = ConfigDict(json_schema_extra=_validations(
        cel("self.kind != 'Service' || has(self.port)",
            "port is required when kind is 'Service' or unspecified (defaults to 'Service')"),
    ))

    group: str = Field("", max_length=253, pattern=_GROUP_PATTERN,
                       description="API group of the endpoint picker's object; empty: the core group.")
    kind: str = Field("Service", min_length=1, max_length=63, pattern=_KIND_PATTERN,
                      description="Kind of the endpoint picker's object (a Service).")
    name: str = Field(min_length=1, max_length=253, description="Name of the endpoint picker's object.")
    port: Port | None = Field(None, description="The endpoint picker's port: for a Service, its service port "
                                                "(not the target port).")
    failure_mode: PickerFailureMode = Field(PickerFailureMode.FAIL_CLOSE,
                                            description="What the gateway does when the endpoint picker does not "
                                                        "answer: FailClose drops the request, FailOpen forwards it "
                                                        "to an endpoint of its own choosing.")


class InferencePoolSpec(_Model):
    selector: LabelSelector = Field(description="Which pods are members of the pool, by their labels.")
    target_ports: list[Port] = Field(min_length=1, max_length=1,
                                     json_schema_extra={"x-kubernetes-list-type": "atomic"},
                                     description="The port the pool's pods serve on (one).")
    endpoint_picker_ref: EndpointPickerRef = Field(description="The endpoint picker the gateway asks which pod "
                                                               "serves each request.")


class ObjectMeta(_Model):
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = None


class InferencePool(_Model):
    api_version: str = Field(API_VERSION, alias="apiVersion")
    kind: str = Field(KIND)
    metadata: ObjectMeta
    spec: InferencePoolSpec = Field(description="The pool's pods, their port and its endpoint picker.")
    status: dict[str, Any] | None = Field(None, description="Written by the gateways the pool is a backend of "
                                                            "(parents[]: their conditions); kept as written.")


def crd_schema() -> dict[str, Any]:
    """The CRD's openAPIV3Schema (structural, from the models; disagg.api.crd does the conversion)."""
    from . import crd

    schema = crd.structural(InferencePool)
    props = schema["properties"]
    props["apiVersion"] = {"type": "string", "description": API_VERSION}
    props["kind"] = {"type": "string", "description": KIND}
    props["metadata"] = {"type": "object"}
    props["status"] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                       "description": props["status"]["description"]}
    schema["required"] = ["spec"]
    schema["description"] = ("A pool of model server pods behind a Gateway API Inference Extension gateway, with "
                             "the endpoint picker that chooses a pod for each request (the Gateway API Inference "
                             "Extension's v1 API, the fields the disagg operator writes).")
    return schema
