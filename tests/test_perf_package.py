"""disagg.perf is the ground floor: the planner, the configurator, the simulator and the benchmarks import it,
and it imports none of them (only disagg.api and third-party libraries). Read from the source with ast,
nothing executed; and its data files are all shipped (package-data)."""

import ast
import fnmatch
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PERF = REPO / "perf"
ALLOWED = ("disagg.perf", "disagg.api")   # the package itself and the shared API models


def _allowed(name: str) -> bool:
    return not (name == "disagg" or name.startswith("disagg.")) or any(
        name == a or name.startswith(a + ".") for a in ALLOWED)


def forbidden_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every import in ``source`` (at any depth, inside functions and ``try`` too) that leaves the allowed
    set, as ``line: module``. Relative imports must stay inside the package (one dot)."""
    bad = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            bad += [f"{node.lineno}: {a.name}" for a in node.names if not _allowed(a.name)]
        elif isinstance(node, ast.ImportFrom):
            if node.level > 1:
                bad.append(f"{node.lineno}: {'.' * node.level}{node.module or ''} (leaves the package)")
            elif node.level == 0 and node.module == "disagg":   # from disagg import planner
                bad += [f"{node.lineno}: disagg.{a.name}" for a in node.names if not _allowed(f"disagg.{a.name}")]
            elif node.level == 0 and not _allowed(node.module or ""):
                bad.append(f"{node.lineno}: {node.module}")
    return bad


def test_perf_imports_no_component():
    files = sorted(PERF.rglob("*.py"))
    assert {f.name for f in files} >= {"__init__.py", "model.py", "serving.py"}
    bad = {str(f.relative_to(REPO)): found for f in files if (found := forbidden_imports(f.read_text(), str(f)))}
    assert not bad, f"disagg.perf must import only {ALLOWED} and third-party libraries: {bad}"


def test_the_check_catches_component_imports():
    for line in ("import disagg.planner.decide", "from disagg.planner import decide", "from disagg import router",
                 "from disagg.configurator.estimate import x", "import disagg.operator as op", "from ..planner import x",
                 "def f():\n    from disagg.simulator import simulate"):
        assert forbidden_imports(line), line
    for line in ("from disagg.api import metrics", "import disagg.api.v1alpha1", "from .model import PerfModel",
                 "from disagg.perf import serving", "import numpy as np", "import yaml"):
        assert not forbidden_imports(line), line


def test_data_files_are_package_data_and_load():
    """Every file under perf/data is matched by disagg.perf's package-data (so wheels and images ship it),
    and the model reads the shipped models, GPUs and calibration."""
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["disagg.perf"]
    files = [p.relative_to(PERF).as_posix() for p in (PERF / "data").rglob("*") if p.is_file()]
    assert any(f.endswith(".json") for f in files) and any(f.endswith(".yaml") for f in files)
    assert not [f for f in files if not any(fnmatch.fnmatch(f, pat) for pat in patterns)]

    from disagg.perf import model
    assert "H100-SXM" in model.known_gpus() and model.known_models()
    calibration = model.planning_calibration(model.gpu("H100-SXM"), 2)
    assert calibration is not None and calibration.gpu == "H100-SXM"
