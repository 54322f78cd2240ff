"""Loaded by every Python process of a vLLM engine this project starts (the supervisor puts this folder
on the engine's PYTHONPATH): the API server, the engine core and its spawned workers.

One job: NIXL's UCX progress thread busy-polls. nixl 1.5's Python agent hard-codes the thread's poll
timeout (``pthrDelay``) to 0, so every engine with a NIXL agent keeps one core at 100% while idle. On a
CPU worker that core is the one its compute needs: on a 2-core machine an idle prefill/decode pair took
both cores, and a third engine pinned beside them got ~1% of a core, its worker process importing torch
for minutes (seen as a start-up "hang"; py-spy showed it runnable, importing). With a timeout the thread
still wakes at once on UCX's event fds (it arms the workers and polls them); the timeout only bounds
NIXL's periodic re-poll. ``DISAGG_NIXL_PROGRESS_DELAY_US`` (> 0) sets it; unset or 0 leaves NIXL's spin.

Patched at import of NIXL's bindings (a meta-path hook), so a process that never loads NIXL pays
nothing. If the bindings' config type cannot be subclassed, NIXL's default stays and a warning says so.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

ENV = "DISAGG_NIXL_PROGRESS_DELAY_US"


def _delay_us() -> int:
    try:
        return max(int(os.environ.get(ENV, "0") or 0), 0)
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


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, delay_us: int):
        self._loader, self._delay_us = loader, delay_us

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        patch_bindings(module, self._delay_us)


class _NixlBindingsFinder(importlib.abc.MetaPathFinder):
    """Finds `nixl*._bindings` through the other finders, then patches the module once loaded."""

    def __init__(self, delay_us: int):
        self._delay_us = delay_us

    def find_spec(self, name, path, target=None):
        if not (name.startswith("nixl") and name.endswith("._bindings")):
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _PatchingLoader(spec.loader, self._delay_us)
                return spec
        return None


def install() -> None:
    delay = _delay_us()
    if delay and not any(isinstance(f, _NixlBindingsFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _NixlBindingsFinder(delay))


install()
