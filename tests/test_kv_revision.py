"""The KV revision (disagg.api.contract.kv_revision): what changes it, where the operator renders it,
how its generation is kept, and when a rollout holds the old pods (operator/revisions.py)."""

from __future__ import annotations

from disagg.api import contract
from disagg.api.names import ROLE_DECODE, ROLE_PREFILL
from disagg.api.v1alpha1 import DisaggDeployment
from disagg.e2e.testing import dd_manifest
from disagg.operator import render, revisions
from disagg.operator.status import DeploymentView, PodView


def _dd(generation: int = 3, **spec) -> DisaggDeployment:
    m = dd_manifest("rev", **spec)
    m["metadata"].update(namespace="ns", generation=generation)
    return DisaggDeployment.model_validate(m)


def test_what_changes_the_revision():
    base = render.kv_revision(_dd())
    same = [dict(engine={"args": ["--max-model-len", "512", "--max-num-seqs", "8"]}),
            dict(decode={"replicas": 4}), dict(prefill={"extraArgs": ["--max-num-batched-tokens", "4096"]}),
            dict(model={"name": "other-name", "source": "hf://example/tiny"}), dict(router={"replicas": 2}),
            dict(engine={"env": [{"name": "VLLM_LOGGING_LEVEL", "value": "DEBUG"}]})]
    for spec in same:
        assert render.kv_revision(_dd(**spec)) == base, spec
    changed = [dict(engine={"args": ["--kv-cache-dtype", "fp8"]}), dict(engine={"args": ["--dtype=bfloat16"]}),
               dict(engine={"args": ["--quantization", "fp8"]}), dict(engine={"args": ["--block-size", "64"]}),
               dict(engine={"image": "disagg/worker:0.2.0"}), dict(model={"name": "tiny", "source": "hf://x/y"}),
               dict(model={"name": "tiny", "source": "hf://example/tiny", "revision": "v2"}),
               dict(decode={"extraArgs": ["--kv_cache_dtype=fp8"]}),
               dict(kvTransfer={"bufferDevice": "cpu"}),
               # an environment variable that changes the KV layout splits pairing like a flag does
               dict(engine={"env": [{"name": "VLLM_KV_CACHE_LAYOUT", "value": "HND"}]}),
               dict(engine={"env": [{"name": "VLLM_KV_CACHE_LAYOUT", "value": "NHD"}]})]
    seen = {base}
    for spec in changed:
        rev = render.kv_revision(_dd(**spec))
        assert rev not in seen, spec
        seen.add(rev)
    # both spellings of a flag are one argument
    assert contract.kv_layout_args(["--kv_cache_dtype", "fp8"]) == contract.kv_layout_args(["--kv-cache-dtype=fp8"])


def test_operator_renders_revision_and_generation_on_both_roles():
    dd = _dd(generation=3)
    manifests, _ = render.children(dd, "uid")
    workers = {m["metadata"]["name"]: m for m in manifests if m["kind"] == "Deployment"}
    for role in (ROLE_PREFILL, ROLE_DECODE):
        spec = workers[f"rev-{role}"]["spec"]
        labels = spec["template"]["metadata"]["labels"]
        assert labels[contract.KV_REVISION_LABEL] == render.kv_revision(dd)
        assert labels[contract.KV_REVISION_GENERATION_LABEL] == "3"
        env = {e["name"]: e.get("value") for e in spec["template"]["spec"]["containers"][0]["env"]}
        assert env[contract.KV_REVISION_ENV] == render.kv_revision(dd)
        assert spec["minReadySeconds"] == 0
    # the running revision keeps the generation that introduced it; a new revision takes this one
    assert render.revision_generation(dd, (render.kv_revision(dd), 1)) == 1
    assert render.revision_generation(dd, ("0123456789abcdef", 1)) == 3
    held, _ = render.children(dd, "uid", 1, hold=True)
    for m in held:
        if m["kind"] == "Deployment" and m["metadata"]["name"] != "rev-router":
            assert m["spec"]["minReadySeconds"] == contract.ROLLOUT_HOLD_SECONDS
            assert m["spec"]["progressDeadlineSeconds"] > m["spec"]["minReadySeconds"]
            assert m["spec"]["template"]["metadata"]["labels"][contract.KV_REVISION_GENERATION_LABEL] == "1"


def _pod(role: str, rev: str, ready: bool = True, terminating: bool = False) -> PodView:
    return PodView(name=f"{role}-{rev}", role=role, node="n", ready=ready, phase="Running", revision=rev,
                   terminating=terminating)


def test_hold_until_the_new_revision_has_a_ready_pair():
    old = [_pod(ROLE_PREFILL, "a"), _pod(ROLE_DECODE, "a")]
    assert not revisions.hold(old, "a")                        # nothing rolling
    assert revisions.hold(old, "b")                            # new revision, no pod yet
    assert revisions.hold(old + [_pod(ROLE_PREFILL, "b")], "b")  # only its prefill ready
    assert revisions.hold(old + [_pod(ROLE_PREFILL, "b"), _pod(ROLE_DECODE, "b", ready=False)], "b")
    assert not revisions.hold(old + [_pod(ROLE_PREFILL, "b"), _pod(ROLE_DECODE, "b")], "b")
    # no complete old pair to protect (first creation, or it is already broken): no hold
    assert not revisions.hold([], "b")
    assert not revisions.hold([_pod(ROLE_PREFILL, "a"), _pod(ROLE_DECODE, "a", terminating=True)], "b")


def test_live_revision_of_the_worker_deployments():
    def view(rev, gen):
        return DeploymentView(desired=1, updated=1, ready=1, revision=rev, revision_generation=gen)
    router = DeploymentView(desired=1, updated=1, ready=1)
    assert revisions.live([view("a", 2), view("a", 2), router]) == ("a", 2)
    assert revisions.live([view("a", 2), view("b", 5), router]) == (None, None)   # half applied
    assert revisions.live([router]) == (None, None)


def test_local_mode_pair_shares_one_revision(tmp_path):
    from disagg.workers.local import cpu_settings, kv_revision

    p, d = cpu_settings("prefill", "/m", "0"), cpu_settings("decode", "/m", "1")
    rev = kv_revision(p, d, "/py")
    assert len(rev) == 16 and rev == kv_revision(p, d, "/py")
    assert kv_revision(p, cpu_settings("decode", "/m", "1", engine_args=["--kv-cache-dtype", "fp8"]), "/py") != rev
