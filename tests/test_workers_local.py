"""`disagg serve --local` brings up prefill + decode + router, answers a chat request and reports
TTFT, tokens/s and the bytes NIXL moved (all real: vLLM CPU build, NIXL over UCX/TCP), and every way
of stopping it (SIGTERM as `timeout`, systemd or a container stop send, SIGHUP from a closed terminal)
stops every process it started and frees their ports."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from disagg.workers.local import free_port, parse_metrics
from disagg.e2e.testing import wait_for


def _descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (from /proc), whatever session it runs in."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.add(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


def _listen_sockets() -> dict[str, int]:
    """Socket inode -> port of every TCP socket listening on this machine (/proc/net/tcp{,6})."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":      # LISTEN
                out[f[9]] = int(f[1].rsplit(":", 1)[1], 16)
    return out


def _sockets_of(pid: int) -> set[str]:
    """The socket inodes a process holds (empty once it is gone; an fd closed while it is read is skipped,
    not the rest with it)."""
    out = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def _listening_ports(pids: set[int]) -> set[int]:
    """TCP ports the given processes listen on."""
    listening = _listen_sockets()
    return {listening[i] for pid in pids for i in _sockets_of(pid) if i in listening}


def _started(pid: int) -> int:
    """When a process started, in clock ticks since boot (/proc/<pid>/stat field 22)."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])


def _now_ticks() -> int:
    return int(float(Path("/proc/uptime").read_text().split()[0]) * os.sysconf("SC_CLK_TCK"))


def _listeners(ports: set[int]) -> dict[int, tuple[int, int, str]]:
    """The processes on this machine that listen on any of ``ports``: pid -> (port, start time in ticks
    since boot, command line)."""
    held = {inode: port for inode, port in _listen_sockets().items() if port in ports}
    out: dict[int, tuple[int, int, str]] = {}
    if not held:
        return out
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        for inode in _sockets_of(int(proc.name)) & held.keys():
            try:
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
                out[int(proc.name)] = (held[inode], _started(int(proc.name)), cmd)
            except OSError:
                continue
    return out


class Serve:
    """`disagg serve --local` as a user runs it, its stdout read line by line as it comes."""

    def __init__(self, worker_python: str, cwd: Path):
        exe = shutil.which("disagg", path=str(Path(sys.executable).parent))
        self.port = free_port()
        self.proc = subprocess.Popen([exe, "serve", "--local", "--port", str(self.port)], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                     env={"DISAGG_WORKER_PYTHON": worker_python, "PATH": "/usr/bin:/bin",
                                          "HOME": str(Path.home())})
        self.started = _started(self.proc.pid)
        self.lines: queue.Queue[str] = queue.Queue()
        self.out: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)

    def until(self, text: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise AssertionError(f"no {text!r} after {timeout}s:\n{''.join(self.out)}") from None
            self.out.append(line)
            if text in line:
                return "".join(self.out)

    def stop_and_check(self, sig: signal.Signals) -> None:
        """Send ``sig``; every descendant must be gone, every port it listened on free."""
        children = _descendants(self.proc.pid)
        assert children, "serve --local started no processes"
        ports = _listening_ports(children)
        stopped = _now_ticks()
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=90)
        assert rc == 0, "".join(self.out)
        # serve waited for its children; theirs (vLLM's engine processes) may take a moment longer
        wait_for(lambda: not any(_alive(p) for p in children), 30, "every process serve --local started to exit")
        # and no process it started, in its tree or re-parented out of it (vLLM's processes start sessions of
        # their own and rename themselves, so neither tells them), listens on their ports: a process started
        # while serve ran. Others may: once freed, those (mostly ephemeral) ports are anyone's, and in two
        # clean-clone runs of the full suite (2026-12-02) one of some 55 was listened on again within 30 s
        # with every process of serve's tree gone (run alone, none is); a failure names the holders
        def leaked() -> dict:
            return {pid: h for pid, h in _listeners(ports).items() if self.started <= h[1] <= stopped}
        try:
            wait_for(lambda: not leaked(), 30, "no process started while serve --local ran to listen on a port its "
                                               "processes listened on")
        except AssertionError as e:
            raise AssertionError(f"{e}: {leaked()}; every holder: {_listeners(ports)}") from None

    def kill(self):
        """After a failure: serve and everything below it (killed alone, serve leaves its router and
        engines running for the rest of the suite)."""
        if self.proc.poll() is None:
            for pid in [self.proc.pid, *_descendants(self.proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.wait()


def test_serve_local_answers_reports_and_stops_everything_on_sigterm(tiny_model, worker_python, tmp_path):
    serve = Serve(worker_python, tmp_path)
    try:
        out = serve.until("serving; Ctrl-C stops", timeout=400)
        stats = re.search(r"TTFT: ([\d.]+) ms\s+tokens/s: ([\d.]+)\s+NIXL moved: (\d+) bytes", out)
        assert stats, out
        ttft, rate, moved = float(stats[1]), float(stats[2]), int(stats[3])
        assert ttft > 0 and rate > 0 and moved > 0
        assert re.search(r"^answer: ['\"]", out, re.M)
        assert re.search(r"^path: remote_prefill \(prefill http://\S+ -> decode http://\S+\)$", out, re.M)
        assert serve.port in _listening_ports(_descendants(serve.proc.pid))
        serve.stop_and_check(signal.SIGTERM)
    finally:
        serve.kill()


def test_sighup_while_starting_stops_the_children(worker_python, tiny_model, tmp_path):
    serve = Serve(worker_python, tmp_path)
    try:
        serve.until("starting prefill, decode and router", timeout=60)
        # both workers' supervisors have started vLLM (a process below each)
        wait_for(lambda: len(_descendants(serve.proc.pid)) >= 4, 60, "both workers' vLLM processes")
        serve.stop_and_check(signal.SIGHUP)
    finally:
        serve.kill()


@pytest.mark.parametrize("text,want", [
    # a timestamp after the value (the last field is not the value)
    ('m_total{path="a b"} 3 1700000000000\n', {'m_total{path="a b"}': 3.0}),
    # escaped quotes and backslashes in a label value, as they print
    ('# TYPE m gauge\nm{q="say \\"hi\\" \\\\ there"} 1.5\n', {'m{q="say \\"hi\\" \\\\ there"}': 1.5}),
    ('vllm:num_requests_running{engine="0",model_name="tiny"} 2.0\nplain 4\n',
     {'vllm:num_requests_running{engine="0",model_name="tiny"}': 2.0, "plain": 4.0}),
])
def test_metrics_text_is_read_with_prometheus_clients_parser(text, want):
    assert parse_metrics(text) == want


_HANGS_ONCE = """
import http.server, pathlib, sys, time
marker = pathlib.Path(sys.argv[1])
print("starting", flush=True)
if not marker.exists():
    marker.write_text("hung once")
    time.sleep(3600)  # a start-up that hangs: no further log line, never ready
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[2])), Health).serve_forever()
"""


def test_a_process_whose_start_up_hangs_is_started_once_more(tmp_path):
    """LocalProcess's stall restart (vLLM engines use it): no log line for stall_restart_s while not
    ready -> killed and started again once per wait, the hung run's log kept; a process that keeps
    hanging still fails (no endless restarts), and is given the net again when started again."""
    from disagg.workers.local import LocalProcess

    port = free_port()
    argv = [sys.executable, "-c", _HANGS_ONCE, str(tmp_path / "marker"), str(port)]
    p = LocalProcess("hangs-once", argv, {}, f"http://127.0.0.1:{port}", tmp_path, stall_restart_s=2)
    try:
        p.start().wait_ready(timeout=60)
        assert p.restarts == 1
        assert (tmp_path / "hangs-once.stalled-1.log").read_text().strip() == "starting"
    finally:
        p.stop(grace=2)

    (tmp_path / "always").mkdir()
    hangs = LocalProcess("hangs", [sys.executable, "-c", "print('starting', flush=True); import time; "
                                   "time.sleep(3600)"], {}, f"http://127.0.0.1:{free_port()}", tmp_path / "always",
                         stall_restart_s=1)
    try:
        with pytest.raises(TimeoutError, match="not ready after 4s"):
            hangs.start().wait_ready(timeout=4)
        assert hangs.restarts == 1
        hangs.kill()
        # started again by its caller (decode-b after a stalled first pull): the net is there again
        with pytest.raises(TimeoutError, match="not ready after 4s"):
            hangs.start().wait_ready(timeout=4)
        assert hangs.restarts == 2 and (tmp_path / "always" / "hangs.stalled-2.log").exists()
    finally:
        hangs.stop(grace=2)
