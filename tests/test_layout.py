"""The import root: `disagg.<component>` from any directory, the stdlib `operator` untouched."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CHECK = ("import operator, disagg.operator, disagg.perf.model, disagg.planner, disagg.simulator.simulate, disagg.router,"
         " disagg.workers, disagg.api.v1alpha1;"
         "assert operator.add(2, 3) == 5, 'stdlib operator shadowed';"
         "assert disagg.operator.__file__.endswith('operator/__init__.py');"
         "print(operator.__name__, disagg.operator.__name__)")


@pytest.mark.parametrize("cwd", [REPO, Path("/")], ids=["repo-root", "elsewhere"])
def test_stdlib_operator_and_disagg_operator_side_by_side(cwd):
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["operator", "disagg.operator"]


def test_console_command_lists_subcommands():
    exe = shutil.which("disagg", path=str(Path(sys.executable).parent))
    assert exe, "the disagg console script is not installed"
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True)
    for sub in ("crds", "cluster", "demo"):
        assert sub in out.stdout
