"""One vLLM engine across two workers, as a replica larger than one pod runs it (issue: replicas larger than
one node): the leader serves the API, the other runs its tensor-parallel rank headless through the
project's launcher (workers/headless.py), the two joined by torch.distributed over gloo/TCP, each started
by the worker entrypoint with the flags disagg.api.parallelism renders for its pod and the leader named
by host name (resolved by the supervisor, workers/leader.py). The tiny model at temperature 0 answers
token for token as one ordinary engine does.

On this machine both "pods" are processes on loopback, one core each: what crosses between pods in a
cluster (the TCP of gloo and vLLM's ZMQ) crosses here too; the real node's pods run the same entrypoint."""

from __future__ import annotations

import pytest
from openai import OpenAI

from disagg.api import parallelism
from disagg.workers.command import HEADLESS_LAUNCHER, build
from disagg.workers.leader import resolve, resolve_leader_flags
from disagg.workers.local import cpu_settings, free_port, stop_all, worker
from disagg.workers.settings import WorkerSettings
from disagg.workers.testing import tiny_model, worker_python  # noqa: F401  (fixtures)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
MAX_TOKENS = 12


def _answers(url: str) -> list[str]:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
            for p in PROMPTS]


def test_a_leader_name_is_resolved_and_a_missing_one_waits_then_fails():
    assert resolve("127.0.0.1", 1) == "127.0.0.1"
    assert resolve("localhost", 5) in ("127.0.0.1", "::1")
    args = ["--nnodes", "2", "--master-addr", "localhost", "--data-parallel-address=localhost", "--x", "localhost"]
    resolved = resolve_leader_flags(args, 5)
    assert resolved[3] in ("127.0.0.1", "::1") and resolved[4].split("=")[1] in ("127.0.0.1", "::1")
    assert resolved[-1] == "localhost", "only the leader flags are resolved"
    with pytest.raises(TimeoutError, match="did not resolve within 2 s"):
        resolve("leader.never.invalid", 2, interval=0.5)   # .invalid never resolves (RFC 6761)


def test_a_non_leader_pod_runs_the_headless_launcher():
    lay = parallelism.Layout(tensor=2, pods=2)
    leader = WorkerSettings(role="prefill", model="/m", engine_args=parallelism.engine_flags(lay, 0, "10.0.0.1"))
    rank = WorkerSettings(role="prefill", model="/m", engine_args=parallelism.engine_flags(lay, 1, "10.0.0.1"))
    assert HEADLESS_LAUNCHER not in build(leader).argv and "vllm.entrypoints.openai.api_server" in build(leader).argv
    assert build(rank).argv[2] == HEADLESS_LAUNCHER


@pytest.mark.timeout(1200)
def test_tensor_parallel_across_two_workers_answers_as_one_engine(tiny_model, worker_python, tmp_path):
    reference = worker("reference", cpu_settings("decode", tiny_model, "0-1", kv_transfer=False), worker_python,
                       tmp_path)
    try:
        reference.start().wait_ready()
        want = _answers(reference.url)
    finally:
        reference.stop()

    lay = parallelism.Layout(tensor=2, pods=2)
    master_port = str(free_port())
    procs = []
    for index in range(lay.pods):
        flags = parallelism.engine_flags(lay, index, "localhost")   # a name, as a pod's leader is named
        flags[flags.index("--master-port") + 1] = master_port          # one machine: a free port, not 29501
        settings = cpu_settings("decode", tiny_model, str(index), kv_transfer=False,
                                engine_args=["--max-num-seqs", "64", *flags])
        procs.append(worker(f"rank-{index}", settings, worker_python, tmp_path))
    try:
        for p in reversed(procs):   # the headless rank first: it waits for the leader's rendezvous
            p.start()
        leader, rank = procs
        leader.wait_ready(timeout=600)
        assert rank.proc.poll() is None, f"the headless rank exited; its log:\n{rank.tail()}"
        assert _answers(leader.url) == want
        assert "world_size=2" in (leader.log_path.read_text(errors="replace") + rank.log_path.read_text(
            errors="replace")), "one engine of two ranks"
    finally:
        stop_all(procs)
