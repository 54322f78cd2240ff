"""operator/essence.py: the diff base kopf stores and compares is exactly kopf's own, built from a
trimmed body (no deep copy of managedFields and status)."""

from __future__ import annotations

import copy

import kopf

from disagg.operator.essence import LeanDiffBaseStorage

BODY = {
    "apiVersion": "serving.disagg.dev/v1alpha1", "kind": "DisaggDeployment",
    "metadata": {
        "name": "d1", "namespace": "ops", "uid": "u-1", "resourceVersion": "42", "generation": 3,
        "labels": {"team": "a"},
        "annotations": {"note": "kept", "kubectl.kubernetes.io/last-applied-configuration": "{}",
                        "kopf.zalando.org/last-handled-configuration": '{"spec":{"model":"old"}}'},
        "finalizers": ["serving.disagg.dev/operator"],
        "managedFields": [{"manager": "disagg-operator", "operation": "Apply", "subresource": "status",
                           "fieldsV1": {"f:status": {"f:conditions": {}}}}],
    },
    "spec": {"model": "m", "prefill": {"replicas": 2, "nodeSelector": {"gpu": "h800"}}},
    "status": {"phase": "Ready", "conditions": [{"type": "Ready", "status": "True"}]},
}


def test_the_essence_and_the_stored_annotation_are_kopfs():
    for extra in ([], [("spec",)], ["spec.prefill"]):
        ours = LeanDiffBaseStorage().build(body=kopf.Body(copy.deepcopy(BODY)), extra_fields=extra)
        theirs = kopf.AnnotationsDiffBaseStorage().build(body=kopf.Body(copy.deepcopy(BODY)), extra_fields=extra)
        assert ours == theirs
        assert ours["spec"] == BODY["spec"] and ours["metadata"] == {"labels": {"team": "a"},
                                                                      "annotations": {"note": "kept"}}
        ours_patch, theirs_patch = kopf.Patch(), kopf.Patch()
        LeanDiffBaseStorage().store(body=kopf.Body(BODY), patch=ours_patch, essence=ours)
        kopf.AnnotationsDiffBaseStorage().store(body=kopf.Body(BODY), patch=theirs_patch, essence=theirs)
        assert ours_patch == theirs_patch


def test_a_handler_on_a_status_field_still_sees_it():
    extra = ["status.phase", "metadata.generation"]
    ours = LeanDiffBaseStorage().build(body=kopf.Body(copy.deepcopy(BODY)), extra_fields=extra)
    assert ours == kopf.AnnotationsDiffBaseStorage().build(body=kopf.Body(copy.deepcopy(BODY)), extra_fields=extra)
    assert ours["status"] == {"phase": "Ready"} and ours["metadata"]["generation"] == 3


def test_the_essence_is_not_a_view_of_the_body():
    body = copy.deepcopy(BODY)
    essence = LeanDiffBaseStorage().build(body=kopf.Body(body), extra_fields=[("spec",)])
    body["spec"]["prefill"]["replicas"] = 9
    body["metadata"]["labels"]["team"] = "b"
    assert essence["spec"]["prefill"]["replicas"] == 2 and essence["metadata"]["labels"]["team"] == "a"
