"""Workers and a router as local processes: for `disagg serve --local`, tests and benchmarks.

Each vLLM instance gets its own HTTP, NIXL side-channel and KV-event ports and
its own CPU cores; :class:`LocalProcess` starts one, waits until it serves, reads
its metrics and stops it (SIGTERM, then SIGKILL) with its whole process group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from disagg.api.metrics import PATH_REMOTE_PREFILL, VLLM_NIXL_BYTES_TRANSFERRED

from .command import build
from .ports import free_port  # noqa: F401  (re-exported: tests and benchmarks take it from here)
from .settings import WorkerSettings


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format as {series: value}, each series keyed as it prints ('name{a="x",b="y"}',
    labels in the order given); timestamps, escapes and comments handled by prometheus_client's parser."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return out


def scrape(url: str, timeout: float = 30) -> dict[str, float]:
    """A /metrics page as {series: value} (see :func:`parse_metrics`)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as r:
        return parse_metrics(r.read().decode())


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of every series of ``name`` (all label sets, or those carrying every one of ``labels``)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items()
               if (k == name or k.startswith(name + "{")) and all("{" + w in k or "," + w in k for w in want))


def wait_metric(url: str, name: str, at_least: float, timeout: float = 30) -> float:
    """Polls ``url``'s /metrics until the sum of ``name`` reaches ``at_least`` (vLLM publishes some
    stats, NIXL's among them, only at its periodic logging interval); returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = metric_sum(scrape(url), name)
        if value >= at_least or time.monotonic() > deadline:
            return value
        time.sleep(0.5)


class LocalProcess:
    """A local process with its log in ``log_dir``; the ports it binds come from
    :func:`~disagg.workers.ports.free_port` (reserved, not raced)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], url: str, log_dir: Path,
                 stall_restart_s: float | None = None):
        """`stall_restart_s`: while waiting to be ready, a process whose log has not grown for this long
        is killed and started once more, at most once per `wait_ready` (its log kept as
        <name>.stalled-N.log). Once per wait, not per object: a caller that starts the same process
        again (tests/test_router_pd.py's decode-b after a stalled first KV pull) gets the net again; a
        CI run's second start of decode-b hung after a first start had used it, and waited 1200 s.
        For vLLM engines, a safety net: engines starting beside others printed nothing for minutes
        here, starved of CPU (by idle engines' busy-polling NIXL threads, fixed in workers/engine_site;
        then by a scheduler autogroup per engine, see `start`); should a start-up stall again, a second
        start is the cheap way through and the kept log the evidence. Slow start-ups still print, so
        they are not restarted."""
        self.name, self.argv, self.env, self.url = name, argv, env, url
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.stall_restart_s = stall_restart_s
        self.restarts = 0

    def start(self) -> LocalProcess:
        log = open(self.log_path, "wb")
        # Not the repository root as cwd: `python -m` would put its `operator` folder on sys.path.
        # Its own process group (stop and kill signal the group), not its own session: the kernel puts
        # each session in its own scheduler autogroup, and on this kind of host (Linux 6.18, EEVDF) a
        # second decode engine pinned to the prefill's core, in its own autogroup, went unscheduled for
        # minutes while the prefill's NIXL progress thread ran: runnable, its group entity never
        # eligible (/sys/kernel/debug/sched/debug), its first KV pull "stalled" (the decode-b stalls of
        # tests/test_router_pd.py). Same workers, same cores, one autogroup: 7 of 7 first pulls in 0.1 s,
        # against 3 of 4 stalled with a session each.
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdin=subprocess.DEVNULL,
                                     stdout=log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir(),
                                     process_group=0)
        return self

    def wait_ready(self, timeout: float = 300, path: str = "/health") -> LocalProcess:
        deadline = time.monotonic() + timeout
        log_size, grew_at = -1, time.monotonic()
        restarted = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log tail:\n{self.tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}{path}", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if self.stall_restart_s and not restarted:
                size = self._log_size()
                if size != log_size:
                    log_size, grew_at = size, time.monotonic()
                elif time.monotonic() - grew_at > self.stall_restart_s:
                    self._restart_stalled()
                    restarted = True
                    deadline, log_size, grew_at = time.monotonic() + timeout, -1, time.monotonic()
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready after {timeout}s; log tail:\n{self.tail()}")

    def _log_size(self) -> int:
        try:
            return self.log_path.stat().st_size
        except OSError:
            return -1

    def _restart_stalled(self) -> None:
        self.kill()
        stalled = self.log_path.with_name(f"{self.name}.stalled-{self.restarts + 1}.log")
        self.log_path.replace(stalled)
        print(f"{self.name}: no log line for {self.stall_restart_s:.0f}s while starting; killed and started "
              f"once more (its log: {stalled})", file=sys.stderr, flush=True)
        self.restarts += 1
        self.start()

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def kill(self) -> None:
        """Abrupt death (SIGKILL to the process group), as a crashed pod."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace: float = 20) -> None:
        stop_all([self], grace)


def stop_all(procs: list[LocalProcess], grace: float = 20) -> None:
    """SIGTERM to every process group at once (they drain in parallel), SIGKILL to those still
    there after ``grace`` seconds."""
    running = [p for p in procs if p.proc and p.proc.poll() is None]
    for p in running:
        try:
            os.killpg(p.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace
    for p in running:
        try:
            p.proc.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            p.kill()


def worker(name: str, settings: WorkerSettings, python: str, log_dir: Path) -> LocalProcess:
    """A vLLM worker run through the worker entrypoint (the supervisor), as a pod runs it."""
    env = settings.to_env()
    argv = [sys.executable, "-P", "-m", "disagg.workers", "serve", "--python", python]
    # the entrypoint reads DISAGG_* and builds the vLLM command itself
    build(settings, python)  # validates the settings here, before a process starts
    host = settings.host if settings.host not in ("0.0.0.0", "::", "") else "127.0.0.1"
    return LocalProcess(name, argv, env, f"http://{host}:{settings.port}", log_dir,
                        stall_restart_s=ENGINE_STALL_S)


# No log line for this long while a vLLM engine starts: hung, not slow. The longest silent step of a
# normal start, importing torch and vLLM in the engine's worker process, took 25 s at load average 2.
ENGINE_STALL_S = 180


def cpu_settings(role: str, model: str, cores: str, **kw) -> WorkerSettings:
    """Small CPU settings for the tiny model: fresh ports, float32, eager, small KV cache."""
    defaults = dict(role=role, model=model, served_model_name="tiny", host="127.0.0.1", port=free_port(),
                    advertise_host="127.0.0.1", nixl_port=free_port(), kv_events_port=free_port(),
                    kv_replay_port=free_port(), kv_buffer_device="cpu", cpu=True, cpu_cores=cores, max_model_len=1024,
                    kv_cache_bytes=64 * 2**20, block_size=32, drain_seconds=5,
                    engine_args=["--max-num-seqs", "64"])
    defaults.update(kw)
    return WorkerSettings(**defaults)


def kv_revision(prefill: WorkerSettings, decode: WorkerSettings, python: str) -> str:
    """The KV revision of a local prefill/decode pair (disagg.api.contract.kv_revision): the worker
    environment's interpreter stands for the image."""
    from disagg.api.contract import kv_revision as revision

    shared = prefill.engine_args if prefill.engine_args == decode.engine_args else []
    roles = {s.role: (1, [*(a for a in s.engine_args if a not in shared),
                          *(["--dtype=float32"] if s.cpu else []), f"--block-size={s.block_size}"])
             for s in (prefill, decode)}
    return revision(model=prefill.model, model_revision=None, tokenizer=None, image=f"local:{python}",
                    kv_transfer={"buffer_device": prefill.kv_buffer_device, "backends": prefill.nixl_backends},
                    roles=roles, engine_args=shared)


def router(config_path: Path, port: int, log_dir: Path, *args: str) -> LocalProcess:
    return LocalProcess("router", [sys.executable, "-P", "-m", "disagg.router", "--config", str(config_path), *args],
                        {}, f"http://127.0.0.1:{port}", log_dir)


def _chat(url: str, question: str):
    """One streamed chat request: (route headers, first-token time, end, chunks, texts, start)."""
    import json as _json

    body = {"model": "tiny", "messages": [{"role": "user", "content": question}],
            "max_tokens": 32, "temperature": 0, "stream": True}
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=_json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    start, first, chunks, text = time.monotonic(), None, 0, []
    with urllib.request.urlopen(req, timeout=120) as r:
        route = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-disagg-")}
        for line in r:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            event = _json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            first = first or time.monotonic()
            chunks += 1
            text.append(event["choices"][0]["delta"].get("content") or "")
    return route, first, time.monotonic(), chunks, text, start


class Stopped(Exception):
    """A stop was asked for (SIGINT, SIGTERM, SIGHUP)."""


# Ctrl-C, `timeout`, systemd and container runtimes (SIGTERM), a closed terminal (SIGHUP)
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _raise_stopped(signum, _frame):
    raise Stopped(signal.Signals(signum).name)


def pd_processes(model: str, port: int, python: str, log_dir: Path,
                 otlp_traces_endpoint: str | None = None) -> list[LocalProcess]:
    """A prefill and a decode worker (cores 0 and 1) and the router in front of them on `port`, not yet
    started: what `disagg serve --local` runs, and a baseline for benchmarks. ``otlp_traces_endpoint``: all
    three trace every request there (spec.tracing's settings, ratio 1)."""
    import json as _json

    tracing = {"otlp_traces_endpoint": otlp_traces_endpoint} if otlp_traces_endpoint else {}
    prefill_s, decode_s = cpu_settings("prefill", model, "0", **tracing), cpu_settings("decode", model, "1", **tracing)
    revision = kv_revision(prefill_s, decode_s, python)
    config = {"model": "tiny", "tokenizer": model, "block_size": prefill_s.block_size,
              "max_model_len": prefill_s.max_model_len, "port": port, "host": "127.0.0.1",
              "spec": {"disaggregation": "always"},
              "prefill": [{"url": f"http://127.0.0.1:{prefill_s.port}",
                           "kv_events": f"tcp://127.0.0.1:{prefill_s.kv_events_port}",
                           "kv_replay": f"tcp://127.0.0.1:{prefill_s.kv_replay_port}", "revision": revision}],
              "decode": [{"url": f"http://127.0.0.1:{decode_s.port}",
                          "kv_events": f"tcp://127.0.0.1:{decode_s.kv_events_port}",
                          "kv_replay": f"tcp://127.0.0.1:{decode_s.kv_replay_port}", "revision": revision}]}
    if otlp_traces_endpoint:
        config["tracing"] = {"otlpEndpoint": otlp_traces_endpoint}
    (log_dir / "router.json").write_text(_json.dumps(config))
    return [worker("prefill", prefill_s, python, log_dir), worker("decode", decode_s, python, log_dir),
            router(log_dir / "router.json", port, log_dir)]


def start_pd(procs: list[LocalProcess], engine_timeout: float = 300) -> None:
    """Starts :func:`pd_processes`' processes: both engines at once, then the router once they are ready
    (its first health check must find the prefill worker up)."""
    for p in procs[:2]:
        p.start()
    for p in procs[:2]:
        p.wait_ready(engine_timeout)
    procs[2].start().wait_ready()


def serve_local(port: int = 8080, model: str | None = None, once: bool = False, log_dir: Path | None = None,
                out=sys.stdout, otlp_traces_endpoint: str | None = None) -> int:
    """`disagg serve --local`: a prefill and a decode worker (one core each) and the router on this
    machine; answers one OpenAI chat request and prints TTFT, tokens/s and the bytes NIXL moved.
    Its children run in their own sessions (a terminal's Ctrl-C reaches only this process), so every
    way of stopping it ends here and stops them: nothing keeps their ports and cores afterwards."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        return _serve_local(port, model, once, log_dir, out, otlp_traces_endpoint)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _serve_local(port: int, model: str | None, once: bool, log_dir: Path | None, out,
                 otlp_traces_endpoint: str | None = None) -> int:
    from .envpath import worker_python
    from .tinymodel import ensure

    python = worker_python()
    model = model or str(ensure(python))
    log_dir = Path(log_dir or tempfile.mkdtemp(prefix="disagg-local-"))
    procs = pd_processes(model, port, python, log_dir, otlp_traces_endpoint)
    print(f"starting prefill, decode and router (logs in {log_dir}) ...", file=out, flush=True)
    try:
        start_pd(procs)
        url = procs[2].url
        print(f"router: {url}/v1 (model 'tiny')", file=out, flush=True)
        # long enough for full KV blocks: NIXL moves whole blocks; a prompt shorter than one block is
        # recomputed on decode and nothing moves
        question = "Hello from disagg! Tell me how a prefill hands its KV cache to a decode worker. " * 3
        for attempt in range(1, 4):
            route, first, end, chunks, text, start = _chat(url, question)
            print(f"path: {route.get('x-disagg-path')} (prefill {route.get('x-disagg-prefill', '-')} -> decode "
                  f"{route.get('x-disagg-decode')})"
                  + (f"; trace {route['x-disagg-trace-id']}" if "x-disagg-trace-id" in route else ""),
                  file=out, flush=True)
            if route.get("x-disagg-path") == PATH_REMOTE_PREFILL:
                break
            # a cold worker (first request after start on a busy machine) can time out or fail once
            print(f"attempt {attempt}: the router fell back ({route.get('x-disagg-fallback', 'no prefill')}); "
                  f"see {log_dir}", file=out, flush=True)
        else:
            return 1
        moved = wait_metric(procs[1].url, VLLM_NIXL_BYTES_TRANSFERRED + "_sum", 1, timeout=60)
        print(f"answer: {''.join(text)!r}", file=out)
        print(f"TTFT: {(first - start) * 1000:.1f} ms   tokens/s: {(chunks - 1) / max(end - first, 1e-9):.1f}   "
              f"NIXL moved: {int(moved)} bytes", file=out, flush=True)
        if once:
            return 0
        print("serving; Ctrl-C stops", file=out, flush=True)
        while all(p.proc.poll() is None for p in procs):
            time.sleep(1)
        return 1
    except (Stopped, KeyboardInterrupt) as e:
        print(f"stopping ({e or 'SIGINT'}) ...", file=out, flush=True)
        return 0
    finally:
        # a second signal must not cut the clean-up short
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        stop_all(procs)
