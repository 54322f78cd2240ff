"""One vLLM engine across two workers, as a replica larger than one pod runs it (issue: replicas larger than
one node): the leader serves the API, the other runs its tensor-parallel rank headless through the
project's launcher (workers/headless.py), the two joined by torch.distributed over gloo/TCP, each started
by the worker entrypoint with the flags disagg.api.parallelism renders for its pod and the leader named
by host name (resolved by the supervisor, workers/leader.py). The tiny model at temperature 0 answers
token for token as one ordinary engine does.

That engine is a prefill (NIXL producer, KV staged in host memory): behind the router, it hands the KV of
its two ranks, one KV head each (the tiny model has two), to an ordinary one-process decode worker at
tensor parallel 1, which reads each rank's shard from that rank's own NIXL agent (vLLM's heterogeneous TP,
prefill TP > decode TP) after one handshake with the leader, whose side channel serves both ranks'
metadata. The official openai client gets the aggregated engine's text.

On this machine every "pod" is a process on loopback, one core each: what crosses between pods in a
cluster (the TCP of gloo, vLLM's ZMQ, NIXL's UCX) crosses here too; the real node's pods run the same
entrypoint. Engine starts are the expensive part, so the module starts four: the reference (stopped
before the others start: two cores), the two-worker prefill (shared by both engine tests) and the decode."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from disagg.api import metrics as m
from disagg.api import parallelism
from disagg.e2e.testing import wait_for
from disagg.workers.command import HEADLESS_LAUNCHER, build
from disagg.workers.leader import resolve, resolve_leader_flags
from disagg.workers.local import cpu_settings, free_port, metric_sum, router, scrape, stop_all, worker
from disagg.workers.settings import WorkerSettings

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
# Two KV blocks (32 tokens) and more each, every one its own first block: NIXL moves whole blocks (a prompt
# shorter than one is recomputed by the decode, and nothing moves), and the decode holds no prefix of another
PD_PROMPTS = ["The capital of France is Paris, the capital of Italy is Rome, and the capital of Spain is " * 2,
              "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
              "    return fibonacci(n - 1) + fibonacci(n - 2)\n\ndef main(argv):\n",
              "Once upon a time, in a kingdom by the sea, there lived a parser who read every line of text twice " * 2]
MAX_TOKENS = 12
TP = 2
# The line each NIXL worker (one per tensor-parallel rank) logs as it registers its KV cache shard
NIXL_REGISTERED = "Registering KV_Caches"


def _answers(url: str, prompts: list[str]) -> list[str]:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    return [client.completions.create(model="tiny", prompt=p, max_tokens=MAX_TOKENS, temperature=0).choices[0].text
            for p in prompts]


def _log(p) -> str:
    return p.log_path.read_text(errors="replace")


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


@pytest.fixture(scope="module")
def reference(tiny_model, worker_python, tmp_path_factory) -> dict[str, str]:
    """What one ordinary engine (tensor parallel 1, aggregated, no NIXL) answers at temperature 0, for every
    prompt of the module: computed once, and the engine stopped before the others start (two cores)."""
    logs = tmp_path_factory.mktemp("reference")
    engine = worker("reference", cpu_settings("decode", tiny_model, "0-1", kv_transfer=False), worker_python, logs)
    try:
        engine.start().wait_ready()
        prompts = PROMPTS + PD_PROMPTS
        return dict(zip(prompts, _answers(engine.url, prompts)))
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def prefill_tp2(reference, tiny_model, worker_python, tmp_path_factory):
    """A prefill engine of tensor parallel 2 across two workers (cores 0 and 1): [leader, headless rank]."""
    logs = tmp_path_factory.mktemp("prefill-tp2")
    lay = parallelism.Layout(tensor=TP, pods=2)
    master_port = str(free_port())
    procs = []
    for index in range(lay.pods):
        flags = parallelism.engine_flags(lay, index, "localhost")   # a name, as a pod's leader is named
        flags[flags.index("--master-port") + 1] = master_port          # one machine: a free port, not 29501
        settings = cpu_settings("prefill", tiny_model, str(index), engine_args=["--max-num-seqs", "64", *flags])
        procs.append(worker(f"prefill-{index}", settings, worker_python, logs))
    try:
        for p in reversed(procs):   # the headless rank first: it waits for the leader's rendezvous
            p.start()
        leader, rank = procs
        leader.wait_ready(timeout=600)
        assert rank.proc.poll() is None, f"the headless rank exited; its log:\n{rank.tail()}"
        yield procs
    finally:
        stop_all(procs)


@pytest.mark.timeout(1200)
def test_tensor_parallel_across_two_workers_answers_as_one_engine(prefill_tp2, reference):
    leader, rank = prefill_tp2
    assert _answers(leader.url, PROMPTS) == [reference[p] for p in PROMPTS]
    assert "world_size=2" in _log(leader) + _log(rank), "one engine of two ranks"


@pytest.mark.timeout(1200)
def test_a_two_worker_prefill_hands_kv_to_a_one_process_decode(prefill_tp2, reference, tiny_model, worker_python,
                                                               tmp_path):
    """Prefill TP 2 over two workers -> decode TP 1, every request through the router's P/D path: the text is
    the aggregated engine's, and the decode read each request's KV from both prefill ranks."""
    leader, rank = prefill_tp2
    decode_s = cpu_settings("decode", tiny_model, "1")
    leader_s = WorkerSettings.from_env(leader.env)
    port = free_port()
    config = {"model": "tiny", "tokenizer": tiny_model, "block_size": decode_s.block_size, "port": port,
              "host": "127.0.0.1", "health_interval_s": 60,
              # a slow prefill on a loaded 2-core machine must not turn into a (correct) fallback
              "spec": {"disaggregation": "always", "prefillTimeoutSeconds": 120},
              "prefill": [{"url": leader.url, "kv_events": f"tcp://127.0.0.1:{leader_s.kv_events_port}"}],
              "decode": [{"url": f"http://127.0.0.1:{decode_s.port}",
                          "kv_events": f"tcp://127.0.0.1:{decode_s.kv_events_port}"}]}
    (tmp_path / "router.json").write_text(json.dumps(config))
    decode = worker("decode", decode_s, worker_python, tmp_path)
    front = router(tmp_path / "router.json", port, tmp_path)
    try:
        decode.start().wait_ready()
        front.start().wait_ready()
        client = OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)
        texts = []
        for prompt in PD_PROMPTS:
            raw = client.completions.with_raw_response.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                              temperature=0)
            assert raw.headers["x-disagg-path"] == m.PATH_REMOTE_PREFILL, dict(raw.headers)
            assert (raw.headers["x-disagg-prefill"], raw.headers["x-disagg-decode"]) == (leader.url, decode.url)
            texts.append(raw.parse().choices[0].text)
        assert texts == [reference[p] for p in PD_PROMPTS]

        routed = scrape(front.url)
        assert routed[f'{m.ROUTER_REQUESTS}{{outcome="{m.OUTCOME_SUCCESS}",path="{m.PATH_REMOTE_PREFILL}"}}'] \
            == len(PD_PROMPTS)
        # One NIXL READ per prefill rank and request: the decode's one rank reads its KV head from each
        # rank's agent (vLLM publishes these stats at its logging interval, hence the wait). A prefill
        # whose second rank took no part would give one per request.
        want = TP * len(PD_PROMPTS)
        wait_for(lambda: metric_sum(scrape(decode.url), m.VLLM_NIXL_BYTES_TRANSFERRED + "_count") >= want,
                 timeout=60, what=f"{want} NIXL transfers on the decode")
        served = scrape(decode.url)
        assert metric_sum(served, m.VLLM_NIXL_BYTES_TRANSFERRED + "_count") == want
        assert metric_sum(served, m.VLLM_NIXL_BYTES_TRANSFERRED + "_sum") >= want * 1024
        assert metric_sum(served, m.VLLM_NIXL_FAILED_TRANSFERS + "_total") == 0
        # each rank registered its own KV shard with NIXL, in its own process
        assert NIXL_REGISTERED in _log(leader) and NIXL_REGISTERED in _log(rank)
        assert "local_tp=1, remote_tp=2" in _log(decode), "the decode planned its reads for a prefill of two ranks"
        assert rank.proc.poll() is None and leader.proc.poll() is None
    finally:
        stop_all([front, decode])
