"""`disagg serve --local` brings up prefill + decode + router, answers a chat request and reports
TTFT, tokens/s and the bytes NIXL moved (all real: vLLM CPU build, NIXL over UCX/TCP)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from disagg.workers.local import free_port
from disagg.workers.testing import tiny_model, worker_python  # noqa: F401  (fixtures)


def test_serve_local_answers_and_reports(tiny_model, worker_python, tmp_path):
    exe = shutil.which("disagg", path=str(Path(sys.executable).parent))
    out = subprocess.run([exe, "serve", "--local", "--once", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=400, cwd=tmp_path,
                         env={"DISAGG_WORKER_PYTHON": worker_python, "PATH": "/usr/bin:/bin",
                              "HOME": str(Path.home())})
    assert out.returncode == 0, out.stdout + out.stderr
    stats = re.search(r"TTFT: ([\d.]+) ms\s+tokens/s: ([\d.]+)\s+NIXL moved: (\d+) bytes", out.stdout)
    assert stats, out.stdout
    ttft, rate, moved = float(stats[1]), float(stats[2]), int(stats[3])
    assert ttft > 0 and rate > 0 and moved > 0
    assert re.search(r"^answer: ['\"]", out.stdout, re.M)
    assert re.search(r"^path: remote_prefill \(prefill http://\S+ -> decode http://\S+\)$", out.stdout, re.M)
