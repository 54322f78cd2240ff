"""Loaded by every Python process of a vLLM engine this project starts (the supervisor puts this folder
on the engine's PYTHONPATH): the API server, the engine core and its spawned workers.

Four jobs, each done when the module it changes is imported (a meta-path hook, so a process that never
imports it pays nothing), each off unless its variable is set (workers/command.py sets them):

1. NIXL's UCX progress thread busy-polls. nixl 1.5's Python agent hard-codes the thread's poll timeout
   (``pthrDelay``) to 0, so every engine with a NIXL agent keeps one core at 100% while idle. On a CPU
   worker that core is the one its compute needs: on a 2-core machine an idle prefill/decode pair took
   both cores, and a third engine pinned beside them got ~1% of a core, its worker process importing
   torch for minutes (seen as a start-up "hang"; py-spy showed it runnable, importing). With a timeout
   the thread still wakes at once on UCX's event fds (it arms the workers and polls them); the timeout
   only bounds NIXL's periodic re-poll. ``DISAGG_NIXL_PROGRESS_DELAY_US`` (> 0) sets it; unset or 0
   leaves NIXL's spin. If the bindings' config type cannot be subclassed, NIXL's default stays and a
   warning says so.
2. vLLM's NIXL worker pins the thread that creates it, on the CPU build the worker's main thread (its
   compute, OpenMP's only thread on a one-core engine), to the last core of each NUMA node: on a 2-core
   host the prefill engine's compute ran on core 1, the decode's core, and a lone request's TTFT went
   from ~45 ms to a p50 of ~450 ms (bench/pd_path_timing.py). ``DISAGG_NIXL_KEEP_AFFINITY`` (1/true):
   no core is reserved, the thread keeps the cores its OpenMP binding gave it.
3. vLLM's shared-memory queues between an engine's scheduler and its worker process: a reader spins on
   ``sched_yield`` for 1 s after every read (``SpinCondition``), so each engine keeps one or two
   processes at 100% of a core through every stream and for a second after it. ``DISAGG_VLLM_SHM_WAIT_MS``
   (> 0): in that second the reader waits for the writer's notification for at most this long instead.
4. Pipeline parallel on vLLM's eager CPU engine: a stage after the first receives its activations into a
   buffer (``intermediate_tensors``) that only the start-up warm-up run allocates, and the CPU worker skips
   that run in eager mode (``CPUModelRunner.warming_up_model`` returns at once without compilation), so
   stage 2 failed its first request on an assertion and the engine died (a ``KeyError`` in the
   scheduler). ``DISAGG_VLLM_PP_BUFFERS`` (1/true): the buffer is allocated at its first use, as the
   warm-up run allocates it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import time

ENV = "DISAGG_NIXL_PROGRESS_DELAY_US"


def _env_int(name: str) -> int:
    """A non-negative integer setting; unset, empty or malformed reads as 0 (vLLM's own behaviour)."""
    try:
        return max(int(os.environ.get(name, "0") or 0), 0)
    except ValueError:
        return 0


def patch_bindings(bindings, delay_us: int) -> bool:
    """Make ``bindings.nixlAgentConfig`` turn a progress-thread delay of 0 into ``delay_us``."""
    base = bindings.nixlAgentConfig
    if getattr(base, "_disagg_delay_us", None) is not None:
        return True
    try:
        class AgentConfig(base):
            _disagg_delay_us = delay_us

            @property
            def pthrDelay(self):
                return base.pthrDelay.__get__(self)

            @pthrDelay.setter
            def pthrDelay(self, us):
                base.pthrDelay.__set__(self, us or delay_us)
    except TypeError as e:
        print(f"disagg: NIXL progress thread left busy-polling ({e})", file=sys.stderr)
        return False
    AgentConfig.__name__ = AgentConfig.__qualname__ = base.__name__
    bindings.nixlAgentConfig = AgentConfig
    return True


SHM_ENV = "DISAGG_VLLM_SHM_WAIT_MS"
SHM_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


def patch_shm_broadcast(module, wait_ms: int) -> bool:
    """Readers of vLLM's shared-memory queues (``SpinCondition``: a CPU worker's process reading its
    scheduler's orders, the scheduler reading the worker's results) spin on ``sched_yield`` for 1 s after
    every read, so after each request (and all through a stream) each engine keeps one or two processes
    runnable at 100% of a core. Here, within that second, a reader waits for the writer's notification
    (the ZMQ socket it otherwise waits on only after the second) for at most ``wait_ms``, then re-checks
    the buffer as before: a notification wakes it at once, a lost one costs ``wait_ms`` (vLLM's idle wait
    re-checks only every 5 s: a busy loop of 0 stalled steps for 5 s)."""
    cls = getattr(module, "SpinCondition", None)
    if cls is None or not callable(getattr(cls, "wait", None)):
        return False
    if getattr(cls, "_disagg_wait_ms", None) is not None:
        return True
    wait = cls.wait

    def spin_wait(self, timeout_ms=None):
        if not (getattr(self, "is_reader", False) and getattr(self, "poller", None) is not None
                and time.monotonic() <= getattr(self, "last_read", 0) + getattr(self, "busy_loop_s", 0)):
            return wait(self, timeout_ms)
        events = dict(self.poller.poll(timeout=wait_ms if timeout_ms is None else min(wait_ms, timeout_ms)))
        if self.local_notify_socket in events:
            self.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)

    import zmq

    cls.wait, cls._disagg_wait_ms = spin_wait, wait_ms
    return True


KEEP_AFFINITY_ENV = "DISAGG_NIXL_KEEP_AFFINITY"
CPU_PLATFORM_MODULE = "vllm.platforms.cpu"


def patch_kv_core_reservation(module) -> bool:
    """vLLM's NIXL worker pins the thread that creates it (the CPU worker's main thread: its compute) to the
    last core of each NUMA node (``CpuPlatform.discover_numa_topology``), whatever cores the engine was
    given; none reserved: the thread keeps the cores its OpenMP binding gave it."""
    platform = getattr(module, "CpuPlatform", None)
    if platform is None or not hasattr(platform, "discover_numa_topology"):
        return False
    platform.discover_numa_topology = classmethod(lambda cls: [])
    return True


PP_BUFFERS_ENV = "DISAGG_VLLM_PP_BUFFERS"
MODEL_RUNNER_MODULE = "vllm.v1.worker.gpu_model_runner"


def patch_pp_buffers(module) -> bool:
    """``GPUModelRunner.sync_and_gather_intermediate_tensors`` (the CPU runner inherits it) allocates the
    stage's activation buffer when no warm-up run did: the same call, sizes and dtype as its dummy run."""
    cls = getattr(module, "GPUModelRunner", None)
    gather = getattr(cls, "sync_and_gather_intermediate_tensors", None)
    if gather is None:
        return False
    if getattr(gather, "_disagg", False):
        return True

    def allocating_gather(self, *args, **kwargs):
        if getattr(self, "intermediate_tensors", None) is None:
            self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
                batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)
        return gather(self, *args, **kwargs)

    allocating_gather._disagg = True
    cls.sync_and_gather_intermediate_tensors = allocating_gather
    return True


def _warn_unless(patched: bool, what: str) -> None:
    if not patched:
        print(f"disagg: {what} left as vLLM has it (its code is not the one engine_site knows)", file=sys.stderr)


class _ModuleFinder(importlib.abc.MetaPathFinder):
    """Finds the modules ``patches`` name (a module's name -> its patch, or None) through the other
    finders, then runs the patch once the module is loaded."""

    def __init__(self, patches):
        self._patches = patches

    def find_spec(self, name, path, target=None):
        patch = self._patches(name)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingModuleLoader(spec.loader, patch)
                return spec
        return None


class _PatchingModuleLoader(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._patch(module)


def install() -> None:
    patches = {}
    delay = _env_int(ENV)
    wait_ms = _env_int(SHM_ENV)
    if wait_ms:
        patches[SHM_MODULE] = lambda m: _warn_unless(patch_shm_broadcast(m, wait_ms), "the shm queues' spin")
    if os.environ.get(KEEP_AFFINITY_ENV, "").lower() in ("1", "true", "yes"):
        patches[CPU_PLATFORM_MODULE] = lambda m: _warn_unless(patch_kv_core_reservation(m),
                                                              "NIXL's core reservation")
    if os.environ.get(PP_BUFFERS_ENV, "").lower() in ("1", "true", "yes"):
        patches[MODEL_RUNNER_MODULE] = lambda m: _warn_unless(patch_pp_buffers(m), "pipeline stages' buffers")

    def patch_for(name: str):
        if delay and name.startswith("nixl") and name.endswith("._bindings"):   # nixl's or nixl_cu12's
            return lambda m: patch_bindings(m, delay)
        return patches.get(name)

    if (delay or patches) and not any(isinstance(f, _ModuleFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ModuleFinder(patch_for))

install()
