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


def test_the_product_packages_carry_no_test_harness():
    """What the images install (every package of pyproject.toml but disagg.e2e, which the Dockerfile strips)
    imports neither pytest nor the test harness (disagg.e2e): the tests' fixtures live in tests/conftest.py, and
    the CLI's `cluster` and `demo` load the harness only when run, saying so where it is absent."""
    import ast
    import tomllib

    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = [REPO / setup["package-dir"].get(p, p.replace(".", "/")) if p in setup["package-dir"] else None
               for p in setup["packages"] if not p.startswith("disagg.e2e")]
    folders = {f for f in shipped if f is not None} | {REPO / setup["package-dir"]["disagg"]}
    offenders = []
    for folder in sorted(folders):
        for path in folder.glob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
                offenders += [f"{path.relative_to(REPO)}: {n}" for n in names
                              if n.split(".")[0] == "pytest" or n.startswith("disagg.e2e")]
    assert len(folders) >= 8, folders
    assert not offenders, offenders


def test_the_cli_without_the_harness_says_what_is_missing(tmp_path):
    """As in the images: disagg.e2e absent (a stand-in package that hides it), `disagg demo` exits with the
    reason instead of a traceback, and the rest of the CLI works."""
    hide = tmp_path / "sitecustomize.py"
    hide.write_text("import sys, importlib.abc\n"
                    "class Hide(importlib.abc.MetaPathFinder):\n"
                    "    def find_spec(self, name, path, target=None):\n"
                    "        if name == 'disagg.e2e' or name.startswith('disagg.e2e.'):\n"
                    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
                    "sys.meta_path.insert(0, Hide())\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "disagg.cli", "demo"], cwd="/", env=env, capture_output=True,
                         text=True)
    assert out.returncode == 1 and "does not include; run it from a source checkout" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    ok = subprocess.run([sys.executable, "-m", "disagg.cli", "crds", "--check"], cwd="/", env=env,
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
