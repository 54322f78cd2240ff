"""The engine's sitecustomize (workers/engine_site) in the real worker environment: NIXL agents created
the way vLLM's NixlConnector creates them get a progress-thread poll timeout, and stop busy-polling.

nixl 1.5's Python agent sets the thread's timeout to 0 (a busy poll, one core per idle engine); on a
2-core machine two idle engines' threads starved a third engine's start-up for minutes."""

from __future__ import annotations

import os
import subprocess

from disagg.workers.command import CPU_NIXL_PROGRESS_DELAY_US, build
from disagg.workers.settings import WorkerSettings
from disagg.workers.testing import worker_python  # noqa: F401  (fixture)

# Runs in the worker environment: a NIXL agent as vLLM creates one, then the delay its config carried
# and the CPU its progress thread used while idle (ticks of every thread but the main one, over 2 s).
PROBE = r"""
import os, time
from nixl._api import nixl_agent, nixl_agent_config
from nixl import _api
seen = []
real_agent = _api.nixlBind.nixlAgent
def recording_agent(name, config):
    seen.append(config.pthrDelay)
    return real_agent(name, config)
_api.nixlBind.nixlAgent = recording_agent
agent = nixl_agent("probe", nixl_agent_config(num_threads=4, capture_telemetry=True))
def ticks():
    main, total = str(os.getpid()), 0
    for t in os.listdir("/proc/self/task"):
        if t != main:
            fields = open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total
before = ticks(); time.sleep(2)
print(seen[0], ticks() - before)
"""


def _probe(python: str, env: dict[str, str]) -> tuple[int, int]:
    keep = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DISAGG_NIXL_PROGRESS_DELAY_US")}
    out = subprocess.run([python, "-B", "-P", "-c", PROBE], env={**keep, "UCX_TLS": "tcp,self", **env},
                         capture_output=True, text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    delay, idle_ticks = out.stdout.split()[-2:]
    return int(delay), int(idle_ticks)


def test_cpu_engines_nixl_progress_thread_polls_with_a_timeout_and_idles(worker_python):
    env = build(WorkerSettings(role="prefill", model="/m", cpu=True)).env
    delay, idle_ticks = _probe(worker_python, {k: env[k] for k in ("PYTHONPATH", "DISAGG_NIXL_PROGRESS_DELAY_US")})
    assert delay == CPU_NIXL_PROGRESS_DELAY_US
    # 2 s of a busy poll is ~200 ticks (fewer only when the machine is saturated); idle with the
    # timeout, its 1,000 wake-ups a second cost a few
    assert idle_ticks < 40, idle_ticks


def test_without_the_setting_nixl_keeps_its_busy_poll(worker_python):
    """The control: the same probe without the sitecustomize sees NIXL's own 0. (Its CPU is not asserted:
    how much a spinning thread gets depends on the machine's load.)"""
    delay, _ = _probe(worker_python, {})
    assert delay == 0
