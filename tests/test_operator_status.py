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


def _pod(role: str, i: int, node: str | None, ready: bool) -> statuses.PodView:
    return statuses.PodView(name=f"s-{role}-{i}", role=role, node=node, ready=ready,
                            phase="Running" if node else "Pending")


def test_events_mark_turns_and_warnings_not_every_first_value_or_reworded_state():
    """A new deployment's first status posts no event (its conditions' first values are unremarkable);
    a reason that changes within the same state posts none; a condition that turns posts one."""
    dd = _dd()
    status, events = statuses.compute(dd, 1, {}, statuses.Observed(pods=[]), "s.n.svc:80")
    assert events == []
    ready = {c["type"]: c for c in status["conditions"]}["Ready"]
    assert ready["status"] == "False"
    # some pods bound and ready, the rest not: Ready's reason may change, its state does not
    some = [_pod("prefill", 0, "n1", True), _pod("decode", 0, None, False), _pod("router", 0, "n2", True)]
    status2, events = statuses.compute(dd, 1, status, statuses.Observed(pods=some), "s.n.svc:80")
    assert {c["type"]: c for c in status2["conditions"]}["Ready"]["status"] == "False"
    assert not [e for e in events if e[1].startswith("NoReady")]
    everyone = [_pod(role, 0, "n1", True) for role in ("prefill", "decode", "router")]
    status3, events = statuses.compute(dd, 1, status2, statuses.Observed(pods=everyone), "s.n.svc:80")
    assert {c["type"]: c for c in status3["conditions"]}["Ready"]["status"] == "True"
    assert ("Normal", "Serving") in [(kind, reason) for kind, reason, _ in events]


def test_a_warning_is_an_event_from_its_first_value():
    dd = _dd(model={"secretRef": {"name": "hf-token"}})
    pod = statuses.PodView(name="s-decode-1", role="decode", node="n1", ready=False, phase="Pending",
                           waiting_reason="CreateContainerConfigError",
                           waiting_message='secret "hf-token" not found')
    _, events = statuses.compute(dd, 1, {}, statuses.Observed(pods=[pod]), "s.n.svc:80")
    assert [(kind, reason) for kind, reason, _ in events] == [("Warning", "CreateContainerConfigError")]


def test_picker_mode_says_whether_its_inference_pool_exists():
    """spec.router.mode picker: InferencePoolApplied and status.router.inferencePool once the pool exists;
    while its CRD is missing, False with the reason (and Degraded says it, posted as a warning), every role
    otherwise reported as ever; in proxy mode neither appears."""
    dd = _dd(router={"mode": "picker"})
    everyone = [_pod(role, 0, "n1", True) for role in ("prefill", "decode", "router")]
    missing = statuses.PoolState(None, "InferencePoolCRDMissing", "install it (inferencePool.installCRD=true)")
    status, events = statuses.compute(dd, 1, {}, statuses.Observed(pods=everyone, inference_pool=missing), "e")
    conds = {c["type"]: c for c in status["conditions"]}
    assert conds["InferencePoolApplied"]["status"] == "False"
    assert conds["InferencePoolApplied"]["reason"] == conds["Degraded"]["reason"] == "InferencePoolCRDMissing"
    assert conds["Ready"]["status"] == "True" and status["phase"] == "Degraded"
    assert "inferencePool" not in status["router"] and status["router"]["ready"] == 1
    assert [(kind, reason) for kind, reason, _ in events] == [("Warning", "InferencePoolCRDMissing")]
    assert "installCRD" in events[0][2]

    status2, events = statuses.compute(dd, 1, status, statuses.Observed(pods=everyone,
                                                                        inference_pool=statuses.PoolState("s")), "e")
    conds = {c["type"]: c for c in status2["conditions"]}
    assert conds["InferencePoolApplied"]["status"] == "True" and conds["Degraded"]["status"] == "False"
    assert status2["router"]["inferencePool"] == "s" and status2["phase"] == "Ready"
    assert "Service s port 9002 (failureMode FailClose)" in conds["InferencePoolApplied"]["message"]
    assert ("Normal", "Applied") in [(kind, reason) for kind, reason, _ in events]

    proxy, _ = statuses.compute(_dd(), 1, status2, statuses.Observed(pods=everyone,
                                                                      inference_pool=statuses.PoolState("s")), "e")
    assert "InferencePoolApplied" not in {c["type"] for c in proxy["conditions"]}
    assert "inferencePool" not in proxy["router"] and statuses.changed(status2, proxy)


def test_a_new_flex_pod_takes_the_role_the_planners_split_is_short_of_and_waits_while_the_split_lags():
    from disagg.operator import flex

    def pod(name, serving=None, ready=False):
        return statuses.PodView(name, "flex", None, ready, "Running", serving_role=serving)

    pool = [pod("a", "prefill", True), pod("b", "prefill", True), pod("c")]
    obj = {"status": {"planner": {"flexPrefill": 3, "flexDecode": 0, "flexReplicas": 3}}}
    split = flex.planned_split(obj, planner_enabled=True)
    # the planner grew the pool for prefill: the new pod takes prefill, where the even split would say decode
    assert flex.initial_role(pool, split) == ("prefill", "the planner's split of the pool")
    assert flex.initial_role(pool, None) == ("decode", "the role fewer flex workers serve")
    # a split the pool already has (or a planner since disabled) leaves the even split
    assert flex.initial_role(pool, flex.Split(2, 0, 3))[0] == "decode"
    assert flex.planned_split(obj, planner_enabled=False) is None
    assert flex.planned_split({"status": {"planner": {"reason": "Steady"}}}, planner_enabled=True) is None
    # decode first where both are short alike
    assert flex.initial_role([pod("c")], flex.Split(1, 1, 2))[0] == "decode"
    # a fourth pod, before the planner's status for it: the split lags the pool
    assert not flex.split_lags(pool, split) and flex.split_lags([*pool, pod("d")], split)
