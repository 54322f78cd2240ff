"""The worker entrypoint's settings -> vLLM command line, without running vLLM."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from pydantic import ValidationError

from disagg.api.names import DISK_OFFLOAD_PATH
from disagg.workers.command import build, kv_events_config
from disagg.workers.settings import WorkerSettings


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer"), ("flex", "kv_both")])
def test_role_sets_nixl_connector_side_channel_and_kv_events(role, kv_role):
    s = WorkerSettings(role=role, model="/m", served_model_name="tiny", port=8100, advertise_host="10.1.2.3",
                       nixl_port=5611, kv_events_port=5571, kv_replay_port=5572, kv_buffer_device="cpu", cpu=True,
                       cpu_cores="1")
    cmd = build(s, python="/env/bin/python")
    assert cmd.argv[:4] == ["/env/bin/python", "-P", "-m", "vllm.entrypoints.openai.api_server"]
    kv = json.loads(_flag(cmd.argv, "--kv-transfer-config"))
    assert kv["kv_connector"] == "NixlConnector" and kv["kv_role"] == kv_role
    assert kv["kv_buffer_device"] == "cpu"
    events = json.loads(_flag(cmd.argv, "--kv-events-config"))
    assert events["enable_kv_cache_events"] and events["endpoint"] == "tcp://*:5571"
    assert events["replay_endpoint"] == "tcp://*:5572"      # where the router asks for batches it missed
    assert cmd.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.1.2.3"
    assert cmd.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5611"
    assert cmd.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert "tcp" in cmd.env["UCX_TLS"].split(",")
    assert {"--enforce-eager", "--enable-prefix-caching"} <= set(cmd.argv)
    assert _flag(cmd.argv, "--dtype") == "float32" and _flag(cmd.argv, "--served-model-name") == "tiny"


def test_cpu_offload_tier_combines_nixl_and_offloading_connectors():
    cmd = build(WorkerSettings(role="decode", model="/m", offload_cpu_gib=2))
    kv = json.loads(_flag(cmd.argv, "--kv-transfer-config"))
    assert kv["kv_connector"] == "MultiConnector"
    inner = kv["kv_connector_extra_config"]["connectors"]
    assert [c["kv_connector"] for c in inner] == ["NixlConnector", "OffloadingConnector"]
    assert inner[1]["kv_connector_extra_config"]["cpu_bytes_to_use"] == 2 * 2**30


def test_disk_tier_sits_behind_a_cpu_tier_in_vllms_tiering_offload():
    cmd = build(WorkerSettings(role="prefill", model="/m", offload_disk_gib=100))
    kv = json.loads(_flag(cmd.argv, "--kv-transfer-config"))
    offload = kv["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]
    assert offload["spec_name"] == "TieringOffloadingSpec"
    assert offload["secondary_tiers"] == [{"type": "fs", "root_dir": DISK_OFFLOAD_PATH}]
    assert offload["cpu_bytes_to_use"] == 2**30               # a staging CPU tier when none was asked for
    both = build(WorkerSettings(role="prefill", model="/m", offload_disk_gib=100, offload_cpu_gib=8))
    kv = json.loads(_flag(both.argv, "--kv-transfer-config"))
    assert kv["kv_connector_extra_config"]["connectors"][1]["kv_connector_extra_config"]["cpu_bytes_to_use"] == 8 * 2**30


def test_settings_round_trip_through_the_environment_and_engine_args_go_last():
    s = WorkerSettings(role="prefill", model="/m", engine_args=["--max-num-seqs", "4"], cpu=True,
                       drain_seconds=7)
    assert WorkerSettings.from_env(s.to_env()) == s
    argv = build(s).argv
    assert argv[-2:] == ["--max-num-seqs", "4"] and _flag(argv, "--shutdown-timeout") == "7"


def test_bad_settings_name_the_field():
    with pytest.raises(ValidationError, match="role"):
        WorkerSettings.from_env({"DISAGG_ROLE": "router", "DISAGG_MODEL": "/m"})
    with pytest.raises(ValidationError, match="nixl_port"):
        WorkerSettings.from_env({"DISAGG_ROLE": "decode", "DISAGG_MODEL": "/m", "DISAGG_NIXL_PORT": "0"})


def test_entrypoint_prints_the_command():
    out = subprocess.run([sys.executable, "-m", "disagg.workers", "command", "--role", "decode", "--model", "/m"],
                         capture_output=True, text=True, check=True)
    assert "kv_consumer" in json.loads(out.stdout)["argv"]


def test_operator_flags_and_engine_args_after_the_separator():
    """The flags the operator renders into worker pods (operator/render.py worker_args)."""
    env = {"POD_IP": "10.9.8.7", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-m", "disagg.workers", "command", "--role", "prefill", "--model", "hf://org/m",
         "--served-model-name", "m", "--tensor-parallel-size", "2", "--port", "8000",
         "--kv-connector", "NixlConnector", "--kv-buffer-device", "cuda", "--nixl-backends", "UCX,GDS",
         "--nixl-side-channel-port", "5600", "--kv-events-port", "5557", "--kv-offload-cpu-gib", "0",
         "--kv-offload-disk-gib", "0", "--", "--max-num-seqs", "8"],
        capture_output=True, text=True, check=True, env=env)
    cmd = json.loads(out.stdout)
    argv = cmd["argv"]
    assert "--model org/m" in argv and "--served-model-name m" in argv
    assert argv.endswith("--tensor-parallel-size 2 --max-num-seqs 8")
    assert '"backends":["UCX","GDS"]' in argv and "tcp://*:5557" in argv
    assert cmd["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.9.8.7"
    assert cmd["env"]["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "5600"


@pytest.mark.parametrize("source,model,load_format", [
    ("pvc://weights/llama", "/models/weights/llama", False),
    ("s3://bucket/llama", "s3://bucket/llama", True),
])
def test_pvc_and_s3_sources_reach_vllm_as_it_reads_them(source, model, load_format):
    out = subprocess.run([sys.executable, "-m", "disagg.workers", "command", "--role", "decode", "--model", source,
                          "--tokenizer", "pvc://toks/llama"], capture_output=True, text=True, check=True)
    argv = json.loads(out.stdout)["argv"]
    assert f"--model {model} " in argv and "--tokenizer /models/toks/llama" in argv
    assert ("--load-format runai_streamer" in argv) is load_format


def test_cpu_build_binds_openmp_to_the_cores_it_may_use():
    """Without cores named (a pod), vLLM's OpenMP threads bind to the process's own CPUs, in the list form
    vLLM 0.32 parses ("all" made its engine fail at start)."""
    import os

    from disagg.workers.command import build
    from disagg.workers.settings import WorkerSettings

    cmd = build(WorkerSettings(role="decode", model="/m", cpu=True))
    cores = cmd.env["VLLM_CPU_OMP_THREADS_BIND"]
    assert [int(c) for c in cores.split(",")] == sorted(os.sched_getaffinity(0))
    assert build(WorkerSettings(role="decode", model="/m", cpu=True, cpu_cores="1")).env[
        "VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_cpu_build_gives_nixls_progress_thread_a_poll_timeout(monkeypatch):
    """NIXL's progress thread busy-polls by default; on the CPU build the engine gets a timeout and the
    folder whose sitecustomize applies it, ahead of any PYTHONPATH it had. GPU workers keep NIXL's
    default unless the setting asks; an aggregated server (no NIXL) gets neither."""
    import os

    from disagg.workers.command import CPU_NIXL_PROGRESS_DELAY_US, ENGINE_SITE_DIR

    monkeypatch.setenv("PYTHONPATH", "/opt/extra")
    env = build(WorkerSettings(role="prefill", model="/m", cpu=True)).env
    assert env["DISAGG_NIXL_PROGRESS_DELAY_US"] == str(CPU_NIXL_PROGRESS_DELAY_US)
    assert env["PYTHONPATH"].split(os.pathsep) == [ENGINE_SITE_DIR, "/opt/extra"]
    assert os.path.isfile(os.path.join(ENGINE_SITE_DIR, "sitecustomize.py"))
    gpu = build(WorkerSettings(role="prefill", model="/m")).env
    assert "DISAGG_NIXL_PROGRESS_DELAY_US" not in gpu and "PYTHONPATH" not in gpu
    assert build(WorkerSettings(role="decode", model="/m", nixl_progress_delay_us=250)).env[
        "DISAGG_NIXL_PROGRESS_DELAY_US"] == "250"
    aggregated = build(WorkerSettings(role="decode", model="/m", cpu=True, kv_transfer=False)).env
    assert "DISAGG_NIXL_PROGRESS_DELAY_US" not in aggregated
    assert "DISAGG_NIXL_PROGRESS_DELAY_US" not in build(WorkerSettings(role="decode", model="/m", cpu=True,
                                                                       nixl_progress_delay_us=0)).env


def test_cpu_build_keeps_the_compute_on_its_cores_and_stops_vllms_queue_spin(monkeypatch):
    """The two other jobs of the engines' sitecustomize (bench/pd_path_timing.py has the figures): on the CPU
    build with NIXL, vLLM's NIXL worker may not move the compute thread to the machine's last core, and every
    CPU engine's shared-memory queue readers wait on a notification instead of spinning. GPU workers keep
    vLLM's behaviour unless the settings ask; with everything off, nothing goes on PYTHONPATH."""
    import os

    from disagg.workers.command import CPU_VLLM_SHM_WAIT_MS, ENGINE_SITE_DIR

    monkeypatch.delenv("PYTHONPATH", raising=False)
    cpu = build(WorkerSettings(role="prefill", model="/m", cpu=True)).env
    assert cpu["DISAGG_NIXL_KEEP_AFFINITY"] == "1"
    assert cpu["DISAGG_VLLM_SHM_WAIT_MS"] == str(CPU_VLLM_SHM_WAIT_MS)
    assert cpu["PYTHONPATH"] == ENGINE_SITE_DIR
    # an aggregated CPU server has no NIXL, but the same queues
    aggregated = build(WorkerSettings(role="decode", model="/m", cpu=True, kv_transfer=False)).env
    assert "DISAGG_NIXL_KEEP_AFFINITY" not in aggregated and aggregated["PYTHONPATH"] == ENGINE_SITE_DIR
    assert aggregated["DISAGG_VLLM_SHM_WAIT_MS"] == str(CPU_VLLM_SHM_WAIT_MS)
    gpu = build(WorkerSettings(role="prefill", model="/m")).env
    assert "DISAGG_NIXL_KEEP_AFFINITY" not in gpu and "DISAGG_VLLM_SHM_WAIT_MS" not in gpu
    asked = build(WorkerSettings(role="decode", model="/m", nixl_keep_affinity=True, vllm_shm_wait_ms=2)).env
    assert asked["DISAGG_NIXL_KEEP_AFFINITY"] == "1" and asked["DISAGG_VLLM_SHM_WAIT_MS"] == "2"
    off = build(WorkerSettings(role="decode", model="/m", cpu=True, nixl_keep_affinity=False, vllm_shm_wait_ms=0,
                               nixl_progress_delay_us=0)).env
    assert not {"DISAGG_NIXL_KEEP_AFFINITY", "DISAGG_VLLM_SHM_WAIT_MS", "PYTHONPATH"} & set(off)
    # as the operator passes them: DISAGG_* variables, read back by the worker entrypoint
    env = WorkerSettings(role="decode", model="/m", cpu=True, nixl_keep_affinity=False, vllm_shm_wait_ms=0).to_env()
    assert WorkerSettings.from_env(env).nixl_keep_affinity is False
    assert WorkerSettings.from_env({**env, "DISAGG_NIXL_KEEP_AFFINITY": "false"}).nixl_keep_affinity is False
    assert os.path.isfile(os.path.join(ENGINE_SITE_DIR, "sitecustomize.py"))


def test_kv_event_sockets_bind_loopback_in_local_runs_and_every_interface_in_pods():
    """Local runs (vLLM's HTTP server on 127.0.0.1) publish KV events and answer replays on the loopback
    address alone: bound as vLLM binds them, nothing beyond the machine reaches either. In a pod (HTTP on
    every interface) both bind every interface, the pod IP being the only one besides loopback."""
    import zmq

    pod = kv_events_config(WorkerSettings(role="decode", model="/m", kv_events_port=5571, kv_replay_port=5572))
    assert (pod["endpoint"], pod["replay_endpoint"]) == ("tcp://*:5571", "tcp://*:5572")

    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        ports = [a.getsockname()[1], b.getsockname()[1]]
    local = kv_events_config(WorkerSettings(role="decode", model="/m", host="127.0.0.1", advertise_host="127.0.0.1",
                                            kv_events_port=ports[0], kv_replay_port=ports[1]))
    ctx = zmq.Context()
    try:
        for key, kind in (("endpoint", zmq.PUB), ("replay_endpoint", zmq.ROUTER)):
            endpoint = local[key]
            if kind == zmq.PUB:
                # vLLM binds its PUB socket only to an endpoint with '*' or '::' in it, and connects to any
                # other (vllm/distributed/kv_events.py, ZmqEventPublisher._is_bind_endpoint)
                assert "*" in endpoint or "::" in endpoint, endpoint
            sock = ctx.socket(kind)
            try:
                sock.bind(endpoint)
                # bound to the loopback address, not to every interface
                assert sock.getsockopt_string(zmq.LAST_ENDPOINT).startswith("tcp://127.0.0.1:"), endpoint
            finally:
                sock.close(linger=0)
    finally:
        ctx.term()
