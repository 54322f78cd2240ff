"""The engine's sitecustomize (workers/engine_site) in the real worker environment: NIXL agents created
the way vLLM's NixlConnector creates them get a progress-thread poll timeout, and stop busy-polling.

nixl 1.5's Python agent sets the thread's timeout to 0 (a busy poll, one core per idle engine); on a
2-core machine two idle engines' threads starved a third engine's start-up for minutes."""

from __future__ import annotations

import os
import subprocess

from disagg.workers.command import CPU_NIXL_PROGRESS_DELAY_US, build
from disagg.workers.settings import WorkerSettings

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


# Runs in the worker environment: vLLM's CPU platform's core reservation for NIXL, and a reader of its
# shared-memory queues in the second after a read (where vLLM spins): its CPU over 0.5 s, and how soon a
# writer's notification wakes it.
VLLM_PROBE = r"""
import threading, time
import zmq
from vllm.platforms.cpu import CpuPlatform
from vllm.distributed.device_communicators import shm_broadcast as shm
ctx = zmq.Context()
addr = "ipc:///tmp/disagg-shm-probe-%d" % __import__("os").getpid()
writer, reader = shm.SpinCondition(False, ctx, addr), shm.SpinCondition(True, ctx, addr)
# PUB/SUB's slow joiner: until the subscription is in place a notification is dropped, so notify until
# one arrives (then the wake-up measured below cannot be lost)
deadline = time.monotonic() + 10
while not reader.local_notify_socket.poll(10):
    assert time.monotonic() < deadline, "the reader never received a notification"
    writer.notify()
reader.local_notify_socket.recv()
reader.record_read()
cpu, start = time.process_time(), time.monotonic()
while time.monotonic() - start < 0.5:
    reader.wait()
cpu = time.process_time() - cpu
reader.record_read()
threading.Timer(0.05, writer.notify).start()
start = time.monotonic()
reader.wait()
print(CpuPlatform.discover_numa_topology() == [], round(cpu, 3), round(time.monotonic() - start, 4))
"""


def _vllm_probe(python: str, env: dict[str, str]) -> tuple[bool, float, float]:
    keep = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",) and not k.startswith("DISAGG_")}
    out = subprocess.run([python, "-B", "-P", "-c", VLLM_PROBE], env={**keep, **env}, capture_output=True,
                         text=True, timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    reserved, cpu, woke = out.stdout.split()[-3:]
    return reserved == "True", float(cpu), float(woke)


def test_cpu_engines_keep_their_compute_core_and_do_not_spin_on_vllms_queues(worker_python):
    """bench/pd_path_timing.py: with vLLM's behaviour a lone request's TTFT through the local P/D pair
    had a p50 of ~450 ms (the prefill's compute moved to the decode's core, beside spinning readers); with
    these, ~45 ms."""
    env = build(WorkerSettings(role="prefill", model="/m", cpu=True)).env
    env = {k: v for k, v in env.items() if k == "PYTHONPATH" or k.startswith("DISAGG_")}
    no_reservation, cpu, _ = _vllm_probe(worker_python, env)
    assert no_reservation
    assert cpu < 0.15, cpu            # a spin takes ~0.5 s of CPU in 0.5 s; ~500 short waits, a few ms
    # a wait is cut short by the writer's notification (50 ms in), not only by its timeout
    _, _, woke = _vllm_probe(worker_python, {**env, "DISAGG_VLLM_SHM_WAIT_MS": "400"})
    assert 0.04 < woke < 0.3, woke


def test_without_the_settings_vllm_reserves_the_last_core(worker_python):
    """The control: vLLM's own behaviour, the probe without the sitecustomize. (Its CPU is not asserted:
    how much a spinning process gets depends on the machine's load.)"""
    no_reservation, _, _ = _vllm_probe(worker_python, {})
    assert not no_reservation


# Runs in the worker environment: a later pipeline stage's model runner as vLLM's eager CPU engine leaves
# it (no warm-up run, so no activation buffer), asked for the activations of its first batch.
PP_PROBE = r"""
import types, torch
from vllm.sequence import IntermediateTensors
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
class Model:
    def make_empty_intermediate_tensors(self, batch_size, dtype, device):
        return IntermediateTensors({"hidden_states": torch.zeros(batch_size, 4, dtype=dtype, device=device)})
runner = object.__new__(CPUModelRunner)
runner.intermediate_tensors, runner.model, runner.max_num_tokens = None, Model(), 64
runner.model_config, runner.device = types.SimpleNamespace(dtype=torch.float32), torch.device("cpu")
try:
    got = runner.sync_and_gather_intermediate_tensors(5, None, False)
    print("allocated", tuple(runner.intermediate_tensors["hidden_states"].shape), tuple(got["hidden_states"].shape))
except AssertionError:
    print("assertion")
"""


def _pp_probe(python: str, env: dict[str, str]) -> str:
    keep = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("DISAGG_")}
    out = subprocess.run([python, "-B", "-P", "-c", PP_PROBE], env={**keep, **env}, capture_output=True, text=True,
                         timeout=300, cwd="/")
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_a_cpu_pipeline_stage_gets_its_activation_buffer_without_a_warm_up_run(worker_python):
    """vLLM 0.32's eager CPU engine skips the warm-up run that allocates a later pipeline stage's activation
    buffer, and the stage fails its first request (the engine died: KeyError in the scheduler); the
    sitecustomize allocates it at first use, as that run would. Only engines with pipeline stages get it."""
    env = build(WorkerSettings(role="prefill", model="/m", cpu=True,
                               engine_args=["--pipeline-parallel-size", "2"])).env
    assert env["DISAGG_VLLM_PP_BUFFERS"] == "1"
    env = {k: v for k, v in env.items() if k == "PYTHONPATH" or k.startswith("DISAGG_")}
    assert _pp_probe(worker_python, env) == "allocated (64, 4) (5, 4)"
    # the control: vLLM's own behaviour
    assert _pp_probe(worker_python, {}) == "assertion"
    for args in ([], ["--tensor-parallel-size", "2"], ["--pipeline-parallel-size=1"]):
        assert "DISAGG_VLLM_PP_BUFFERS" not in build(WorkerSettings(role="prefill", model="/m", cpu=True,
                                                                    engine_args=args)).env, args
    assert build(WorkerSettings(role="prefill", model="/m", cpu=True, engine_args=["-pp", "2"])).env[
        "DISAGG_VLLM_PP_BUFFERS"] == "1"
