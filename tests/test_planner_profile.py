"""`disagg profile` measuring a real HTTP server that streams completions with latencies the test sets:
prefill time a + b x tokens (per batch), decode step c + d x concurrent streams."""

import json
import shutil
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from disagg.perf import model as perfmodel
from disagg.perf.profile import measure

PREFILL_BASE, PREFILL_PER_TOKEN = 0.05, 100e-6       # 50 ms + 100 us/token (slow enough to dwarf jitter)
DECODE_BASE, DECODE_PER_STREAM = 0.02, 0.01           # 20 ms + 10 ms per concurrent stream
HANDOFF = 0.15                                        # what a P/D path adds between prefill and decode


class Worker:
    """A completions endpoint whose prefill (serialised, like a GPU's compute) and decode (slower with
    more concurrent streams) obey the constants above. With ``bursts``, it also behaves like a vLLM whose
    frontend falls behind its engine: each stream's tokens reach the client in one burst at its end, and
    the decode steps are seen only in the inter-token latency histogram it exports on /metrics (as vLLM
    does, from the engine's own clock). With ``handoff``, it stands for a router in front of a P/D pair
    of such workers: the same prefill, then ``handoff`` s and a decode step before the first token."""

    def __init__(self, bursts: bool = False, handoff: float = 0.0):
        self.lock = threading.Lock()
        self.compute = threading.Lock()
        self.streams = 0
        self.itl_sum, self.itl_count = 0.0, 0
        worker = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                if not bursts:
                    self.send_error(404)
                    return
                with worker.lock:
                    body = ("# TYPE vllm:inter_token_latency_seconds histogram\n"
                            f"vllm:inter_token_latency_seconds_sum{{engine=\"0\"}} {worker.itl_sum}\n"
                            f"vllm:inter_token_latency_seconds_count{{engine=\"0\"}} {worker.itl_count}\n"
                            ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Connection", "close")
                self.end_headers()
                with worker.compute:  # prefill is compute-bound: one prompt at a time, a batch takes b x as long
                    time.sleep(PREFILL_BASE + PREFILL_PER_TOKEN * len(body["prompt"]))
                if handoff:
                    time.sleep(handoff + DECODE_BASE + DECODE_PER_STREAM)
                with worker.lock:
                    worker.streams += 1
                try:
                    held = []
                    for i in range(body["max_tokens"]):
                        if i:
                            with worker.lock:
                                n = worker.streams
                            step = time.perf_counter()
                            time.sleep(DECODE_BASE + DECODE_PER_STREAM * n)
                            with worker.lock:
                                worker.itl_sum += time.perf_counter() - step
                                worker.itl_count += 1
                        chunk = {"choices": [{"text": "x", "index": 0}]}
                        held.append(f"data: {json.dumps(chunk)}\n\n".encode())
                        if not bursts or i == 0 and body["max_tokens"] == 1:
                            self.wfile.write(b"".join(held))
                            self.wfile.flush()
                            held = []
                    self.wfile.write(b"".join(held) + b"data: [DONE]\n\n")
                finally:
                    with worker.lock:
                        worker.streams -= 1

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


@pytest.fixture(scope="module")
def worker():
    w = Worker()
    yield w
    w.close()


def test_decode_steps_come_from_the_engines_histogram_when_the_client_sees_bursts():
    """A frontend that falls behind its engine sends a stream's tokens in one burst: chunk arrival times
    would make its decode steps ~0. The profile reads the engine's inter-token latency histogram."""
    w = Worker(bursts=True)
    try:
        profile = measure(w.url, "tiny", prompt_tokens=(64, 128, 256), batches=(1,), concurrencies=(1, 2, 4),
                          context=32, decode_tokens=6, timeout=60)
    finally:
        w.close()
    for c in (1, 2, 4):
        want = DECODE_BASE + DECODE_PER_STREAM * c
        assert profile.decode_seconds(c, c * 35) == pytest.approx(want, rel=0.5), c


def test_profile_recovers_the_workers_latencies(worker):
    profile = measure(worker.url, "tiny", prompt_tokens=(64, 512, 2048), batches=(1, 2), concurrencies=(1, 2, 4),
                      context=64, decode_tokens=10)
    for n in (256, 1024, 2048):
        want = PREFILL_BASE + PREFILL_PER_TOKEN * n
        assert profile.prefill_seconds([n]) == pytest.approx(want, rel=0.35, abs=0.03), n
    slope = (profile.prefill_seconds([2048]) - profile.prefill_seconds([64])) / (2048 - 64)
    assert slope == pytest.approx(PREFILL_PER_TOKEN, rel=0.35)
    for c in (1, 4):
        want = DECODE_BASE + DECODE_PER_STREAM * c
        assert profile.decode_seconds(c, c * 70) == pytest.approx(want, rel=0.5), c
    assert profile.decode_seconds(4, 280) > profile.decode_seconds(1, 70)
    # and the planner's model uses it (floored by physics, which this slow worker is far above)
    model = perfmodel.PerfModel.analytic("Qwen/Qwen2.5-1.5B-Instruct", "L40S", profile=profile)
    assert model.ttft(1024) == pytest.approx(profile.prefill_seconds([1024]))


def test_cli_writes_a_configmap_the_planner_can_load(worker, tmp_path):
    exe = shutil.which("disagg", path=str(Path(sys.executable).parent))
    out = tmp_path / "cm.yaml"
    run = subprocess.run([exe, "profile", "--url", worker.url, "--model", "tiny", "--gpu", "L40S",
                          "--prompt-tokens", "64,512,1024", "--batches", "1", "--concurrency", "1,2,3",
                          "--context", "32", "--decode-tokens", "6", "--configmap", "tiny-profile",
                          "--namespace", "team-a", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    cm = yaml.safe_load(out.read_text())
    assert cm["kind"] == "ConfigMap" and cm["metadata"] == {"name": "tiny-profile", "namespace": "team-a"}
    profile = perfmodel.Profile.from_dict(yaml.safe_load(cm["data"][perfmodel.PROFILE_KEY]))
    assert profile.gpu == "L40S" and len(profile.prefill) == 3 and len(profile.decode) == 3
    assert "prefill =" in run.stdout


def test_the_path_through_a_router_gives_the_handoff(worker):
    """``path_url``: lone requests through the P/D path; what they took beyond the worker's own prefill
    and first decode step is the profile's hand-off."""
    path = Worker(handoff=HANDOFF)
    try:
        profile = measure(worker.url, "tiny", prompt_tokens=(64, 256, 512), batches=(1,), concurrencies=(1, 2, 4),
                          context=32, decode_tokens=6, repeats=3, path_url=path.url)
    finally:
        path.close()
    assert len(profile.handoff) == 3
    assert profile.handoff_base == pytest.approx(HANDOFF, rel=0.35)
    assert perfmodel.Profile.from_dict(profile.to_dict()).handoff_base == pytest.approx(profile.handoff_base)
    # a worker profiled alone has none
    assert measure(worker.url, "tiny", prompt_tokens=(64, 256, 512), batches=(1,), concurrencies=(1, 2, 4),
                   context=32, decode_tokens=6).handoff_base is None
