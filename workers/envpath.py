"""Where the heavy worker environment (vLLM CPU build + NIXL) lives.

`make worker-env` (workers/env/build.sh) builds it into the cache outside the
repository; :func:`worker_python` builds or finds it and returns its Python.
``DISAGG_WORKER_PYTHON`` overrides (for example a container image's Python).
"""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().parent / "env" / "build.sh"


@cache
def worker_python() -> str:
    if os.environ.get("DISAGG_WORKER_PYTHON"):
        return os.environ["DISAGG_WORKER_PYTHON"]
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, capture_output=True, text=True)
    return str(Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python")
