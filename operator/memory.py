"""Where the operator's memory goes, on request: an opt-in report written on SIGUSR1 and at exit.

    DISAGG_OPERATOR_MEMORY=/path/report.txt      cheap: RSS, glibc heap, threads, live objects by type
    DISAGG_OPERATOR_TRACEMALLOC=<frames>         also trace Python allocations made after start-up
                                                 (costs memory and CPU)

Each report is appended to the file, so one run's reports (say, empty, full and at exit) sit side by
side. The numbers that tell fragmentation from live objects: RSS against glibc's in-use bytes (mallinfo2
``uordblks``) and free bytes kept in its arenas (``fordblks``: freed but not returned, one set of arenas per
thread that ever malloc'd), and, with tracing on, against the bytes Python objects hold now.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import os
import signal
import sys
import tempfile
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

REPORT_ENV = "DISAGG_OPERATOR_MEMORY"
TRACE_ENV = "DISAGG_OPERATOR_TRACEMALLOC"
TOP = 30


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
        "keepcost")]


def proc_status(fields: tuple[str, ...] = ("VmRSS", "VmHWM", "RssAnon", "Threads")) -> dict[str, int]:
    """Fields of /proc/self/status (kB, except Threads)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in fields:
            out[key] = int(value.split()[0])
    return out


def mallinfo() -> dict[str, int] | None:
    """glibc's heap counters in bytes (None off glibc or before 2.33)."""
    try:
        fn = ctypes.CDLL(None).mallinfo2
    except (OSError, AttributeError):
        return None
    fn.restype = _MallInfo2
    info = fn()
    return {"arena": info.arena, "mmapped": info.hblkhd, "in_use": info.uordblks + info.hblkhd,
            "free_in_arenas": info.fordblks}


def pymalloc() -> dict[str, int]:
    """Python's small-object allocator (pymalloc), which takes its arenas straight from mmap, outside
    glibc's counters: arenas held, bytes in live blocks, bytes free inside them (fragmentation).
    sys._debugmallocstats writes to file descriptor 2, so that is pointed at a file for the moment
    (a line another thread logs meanwhile lands there too: a diagnostic's price). Empty while tracemalloc
    traces: its hooks stand in front of pymalloc, and CPython then prints nothing."""
    with tempfile.TemporaryFile() as tmp:
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            os.dup2(tmp.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode(errors="replace")
    wanted = {"# arenas allocated current": "arenas", "# bytes in allocated blocks": "in_use",
              "# bytes in available blocks": "free_in_pools"}
    out = {}
    for line in text.splitlines():
        label, _, value = line.partition("=")
        if label.strip() in wanted:
            out[wanted[label.strip()]] = int(value.strip().replace(",", ""))
        elif "bytes/arena" in line:
            out["arena_bytes"] = int(value.strip().replace(",", ""))
    return out


def report(reason: str) -> str:
    mib = 1024 * 1024
    status = proc_status()
    lines = [f"== operator memory, {reason}, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}",
             f"rss {status.get('VmRSS', 0) / 1024:.1f} MiB, peak {status.get('VmHWM', 0) / 1024:.1f} MiB, "
             f"anon {status.get('RssAnon', 0) / 1024:.1f} MiB, threads {status.get('Threads', 0)} "
             f"(python {threading.active_count()})"]
    heap = mallinfo()
    if heap:
        lines.append("glibc heap: " + ", ".join(f"{k} {v / mib:.1f} MiB" for k, v in heap.items()))
    small = pymalloc()
    if small:
        lines.append(f"pymalloc: {small.get('arenas', 0)} arenas, {small.get('arena_bytes', 0) / mib:.1f} MiB; "
                     f"in blocks {small.get('in_use', 0) / mib:.1f} MiB, free in its pools "
                     f"{small.get('free_in_pools', 0) / mib:.1f} MiB")
    if tracemalloc.is_tracing():
        current, peak = tracemalloc.get_traced_memory()
        lines.append(f"python objects (tracemalloc): {current / mib:.1f} MiB now, {peak / mib:.1f} MiB peak; "
                     f"tracemalloc's own {tracemalloc.get_tracemalloc_memory() / mib:.1f} MiB")
        snapshot = tracemalloc.take_snapshot().filter_traces(
            [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap>")])
        lines.append(f"top {TOP} allocation sites (file:line, size, count):")
        for stat in snapshot.statistics("lineno")[:TOP]:
            frame = stat.traceback[0]
            lines.append(f"  {stat.size / 1024:10.1f} KiB {stat.count:8d}  {frame.filename}:{frame.lineno}")
        if tracemalloc.get_traceback_limit() > 1:   # who called: the heaviest stacks, outermost frame first
            lines.append("top 10 allocation stacks:")
            for stat in snapshot.statistics("traceback")[:10]:
                lines.append(f"  {stat.size / 1024:.1f} KiB in {stat.count} blocks")
                lines += [f"      {frame.filename}:{frame.lineno}" for frame in stat.traceback]
        lines.append(f"top {TOP} by file:")
        for stat in snapshot.statistics("filename")[:TOP]:
            lines.append(f"  {stat.size / 1024:10.1f} KiB {stat.count:8d}  {stat.traceback[0].filename}")
    counts = Counter(type(o).__qualname__ for o in gc.get_objects())
    lines.append(f"live gc-tracked objects: {sum(counts.values())}; top {TOP} types:")
    lines += [f"  {n:9d}  {name}" for name, n in counts.most_common(TOP)]
    return "\n".join(lines) + "\n"


def _write(path: str, reason: str) -> None:
    try:
        with open(path, "a") as f:
            f.write(report(reason))
    except Exception as e:  # a diagnostic must never take the operator down
        print(f"memory report to {path} failed: {e!r}", file=sys.stderr)


def trim() -> bool:
    """Give the free pages inside glibc's heap back to the system (malloc_trim). A list of a
    fleet's nodes, a burst of reconciles or of TLS connections leaves freed chunks scattered through
    the heap, which glibc keeps resident (the report's free_in_arenas); trimming costs a walk of the
    heap, milliseconds. With PYTHONMALLOC=malloc (the chart's setting) Python's small objects live in
    that heap too, instead of pymalloc's 1 MiB arenas that only go back when wholly empty. False off glibc."""
    try:
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def trim_every(seconds: float) -> threading.Thread:
    """Trim in the background every `seconds` (a daemon thread: nothing to stop at exit)."""
    def loop() -> None:
        while True:
            time.sleep(seconds)
            trim()
    thread = threading.Thread(target=loop, name="malloc-trim", daemon=True)
    thread.start()
    return thread


def start_tracing() -> None:
    """Trace Python allocations from here on when the environment asks for it. Called once the
    operator has imported everything: tracing the imports (the kubernetes client's thousands of
    model classes) made its start-up minutes long on a busy machine, and what grows comes later."""
    frames = os.environ.get(TRACE_ENV)
    if frames and not tracemalloc.is_tracing():
        tracemalloc.start(int(frames) if frames.isdigit() else 1)


def install() -> None:
    """Register the report (SIGUSR1, exit) when the environment asks for it."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return
    # the handler runs on the main thread between bytecodes (asyncio's loop is there too): no lock held
    signal.signal(signal.SIGUSR1, lambda *_: _write(path, "SIGUSR1"))
    atexit.register(_write, path, "exit")
