"""A real Prometheus (the distribution's ``prometheus`` binary) on loopback, for tests.

It scrapes the ``/metrics`` endpoints it is given every second and keeps its data
in a temporary directory. ``stop()`` and ``start()`` let a test take it away and
bring it back (the same data directory and port).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import yaml

from .localcluster.controlplane import free_port


class PrometheusNotInstalled(RuntimeError):
    pass


class LocalPrometheus:
    def __init__(self, state_dir: Path, targets: list[str], scrape_interval: str = "1s"):
        binary = shutil.which("prometheus") or ("/usr/bin/prometheus" if Path("/usr/bin/prometheus").exists()
                                                 else None)
        if not binary:
            raise PrometheusNotInstalled("prometheus is not installed: `make prometheus` installs Debian's package")
        self.binary = binary
        self.dir = Path(state_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.targets = targets
        self.scrape_interval = scrape_interval
        self._proc: subprocess.Popen | None = None

    def _config(self) -> Path:
        path = self.dir / "prometheus.yml"
        path.write_text(yaml.safe_dump({
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": [{"job_name": "exporters", "static_configs": [{"targets": self.targets}]}],
        }))
        return path

    def start(self, timeout: float = 60) -> LocalPrometheus:
        log = (self.dir / "prometheus.log").open("ab")
        self._proc = subprocess.Popen(
            [self.binary, f"--config.file={self._config()}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self._proc.returncode}: {self.tail()}")
            if self.ready():
                return self
            time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready after {timeout:.0f}s: {self.tail()}")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            os.killpg(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        self._proc = None

    def tail(self, lines: int = 20) -> str:
        path = self.dir / "prometheus.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""
