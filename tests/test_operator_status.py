"""Status from observed state (operator/status.py), without a cluster: what a condition says about
pods the kubelet cannot start."""

from __future__ import annotations

from disagg.api.v1alpha1 import DisaggDeployment
from disagg.e2e.testing import dd_manifest
from disagg.operator import status as statuses


def _dd(**spec) -> DisaggDeployment:
    return DisaggDeployment.model_validate({**dd_manifest("s", **spec), "metadata": {"name": "s", "namespace": "n",
                                                                                  "generation": 1}})


def _degraded(dd: DisaggDeployment, pods: list[statuses.PodView]) -> dict:
    status, _ = statuses.compute(dd, 1, {}, statuses.Observed(pods=pods), "s.n.svc:80")
    return next(c for c in status["conditions"] if c["type"] == "Degraded")


def test_a_missing_model_secret_is_the_kubelets_config_error_named_in_degraded():
    dd = _dd(model={"secretRef": {"name": "hf-token"}})
    pod = statuses.PodView(name="s-decode-1", role="decode", node="n1", ready=False, phase="Pending",
                           waiting_reason="CreateContainerConfigError",
                           waiting_message='secret "hf-token" not found')
    cond = _degraded(dd, [pod])
    assert cond["status"] == "True" and cond["reason"] == "CreateContainerConfigError"
    assert cond["message"] == ('CreateContainerConfigError on decode pod s-decode-1: secret "hf-token" not found '
                               '(spec.model.secretRef)')


def test_other_config_errors_are_not_blamed_on_the_secret_ref():
    dd = _dd(model={"secretRef": {"name": "hf-token"}})
    pod = statuses.PodView(name="s-decode-1", role="decode", node="n1", ready=False, phase="Pending",
                           waiting_reason="CreateContainerConfigError",
                           waiting_message='configmap "other" not found')
    assert _degraded(dd, [pod])["message"] == \
        'CreateContainerConfigError on decode pod s-decode-1: configmap "other" not found'
