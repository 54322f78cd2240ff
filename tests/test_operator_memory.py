"""The operator's opt-in memory report (operator/memory.py): written on SIGUSR1 and at exit, with RSS,
glibc's heap and, when tracing, the allocation sites that hold the most."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from disagg.operator import memory

CHILD = textwrap.dedent("""
    import os, signal, sys
    from disagg.operator import memory
    memory.install()
    memory.start_tracing()
    hoard = [bytearray(1024) for _ in range(20000)]   # ~20 MiB held at one line
    os.kill(os.getpid(), signal.SIGUSR1)
    print("signalled", flush=True)
""")


def test_report_on_signal_and_at_exit_names_the_allocation_site(tmp_path: Path) -> None:
    path = tmp_path / "memory.txt"
    env = {memory.REPORT_ENV: str(path), memory.TRACE_ENV: "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "signalled" in out.stdout
    text = path.read_text()
    reports = text.split("== operator memory, ")[1:]
    assert [r.split(",")[0] for r in reports] == ["SIGUSR1", "exit"]
    first = reports[0]
    assert "rss " in first and "glibc heap: " in first and "python objects (tracemalloc): " in first
    # the hoard's line is the top allocation site, at about its size
    top = next(line for line in first.splitlines() if line.startswith("  ") and "KiB" in line)
    size_kib = float(top.split()[0])
    assert top.rstrip().endswith("<string>:6"), top
    assert 20000 <= size_kib <= 25000, top


def test_no_report_and_no_tracing_unless_asked(tmp_path: Path) -> None:
    code = ("import tracemalloc, signal; from disagg.operator import memory; memory.install(); memory.start_tracing(); "
            "print(tracemalloc.is_tracing(), signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL)")
    out = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr
    assert not list(tmp_path.iterdir())


def test_glibc_heap_counters_are_read() -> None:
    heap = memory.mallinfo()
    assert heap is not None and heap["in_use"] > 0
    assert memory.proc_status()["VmRSS"] > 0


def test_pymalloc_counters_are_read() -> None:
    small = memory.pymalloc()
    assert small["arenas"] > 0 and small["in_use"] > 0 and small["arena_bytes"] >= small["in_use"]


def test_trim_returns_freed_heap_pages() -> None:
    # many mid-sized blocks (below glibc's mmap threshold: they come from the heap), then all but the
    # last freed: the heap cannot shrink from its top, only a trim gives the pages back
    code = textwrap.dedent("""
        from disagg.operator import memory
        blocks = [bytearray(64 * 1024) for _ in range(800)]
        keep = blocks[-1]
        del blocks
        before = memory.proc_status()["VmRSS"]
        memory.trim()
        print(before, memory.proc_status()["VmRSS"])
    """)
    out = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin"}, capture_output=True,
                         text=True, timeout=120)
    before, after = map(int, out.stdout.split())
    assert before - after > 30 * 1024, (before, after)   # most of the ~50 MiB freed comes back
