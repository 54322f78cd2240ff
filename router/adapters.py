"""LoRA adapters (spec.model.adapters): which are declared, which worker holds which, and loading and
unloading them on the running workers, with no restart.

Why the router does this, not the operator: the router already discovers every worker of both roles and
probes it, and it routes by which worker holds which adapter. Loading from the same place that routes means
a request for an adapter only ever goes to a worker the router has seen answer that adapter's load (or list
it on /v1/models), and a worker that restarted (and so lost its adapters) is found and reloaded by the
next probe, with no second component's view to fall out of step. The operator only renders LoRA on in the
engines (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``); the declared adapters reach the router
from its DisaggDeployment (discovery) or its configuration, never through the pod template, so adding one
rolls nothing.

vLLM's side (0.32): ``POST /v1/load_lora_adapter {lora_name, lora_path}`` (400 "already loaded" when it
is), ``POST /v1/unload_lora_adapter {lora_name}``, and ``/v1/models`` lists each loaded adapter as a card
whose ``root`` is its path. A request naming an adapter a worker does not hold gets vLLM's 404, never the
base model's answer.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field

from disagg.api import metrics as m
from disagg.api.names import local_model_path

from .errors import NoWorkers, NotFound
from .index import ROOT

log = logging.getLogger("disagg.router.adapters")

# A lora_affinity score (the Gateway API Inference Extension's scorer): the adapter is in the worker's batch
# now, the worker has a free adapter slot, the adapter is queued for a slot there, the worker is full.
SCORE_ACTIVE, SCORE_FREE_SLOT, SCORE_WAITING, SCORE_FULL = 1.0, 0.8, 0.6, 0.0


def lora_affinity(adapter: str, active: set[str], waiting: set[str], max_loras: int | None) -> float:
    """The extension's lora_affinity score of one worker for a request of ``adapter``: ``active``, the adapters
    with requests running on it; ``waiting``, those with requests waiting for a slot; ``max_loras``, its slots
    (vLLM --max-loras; None: unbounded)."""
    if adapter in active:
        return SCORE_ACTIVE
    if max_loras is None or len(active | waiting) < max_loras:
        return SCORE_FREE_SLOT
    if adapter in waiting:
        return SCORE_WAITING
    return SCORE_FULL


def lora_requests(metrics_text: str) -> tuple[set[str], set[str]] | None:
    """(running, waiting) adapters, as a vLLM worker's /metrics last reported them in vllm:lora_requests_info
    (the lora_affinity scorer's input, as the Inference Extension reads it). vLLM keeps one sample per label set
    it ever reported, each set to the time it last reported it, so the sample of the greatest value is the
    engine's state now. None where the worker reports none (LoRA off, or no engine step yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    # only this metric's lines go to the parser: a worker's whole /metrics is tens of kB of histograms
    lines = [ln for ln in metrics_text.splitlines() if ln.startswith(m.VLLM_LORA_REQUESTS_INFO + "{")]
    samples = [s for f in text_string_to_metric_families("\n".join(lines) + "\n") for s in f.samples] if lines else []
    if not samples:
        return None
    now = max(samples, key=lambda s: s.value).labels

    def names(label: str) -> set[str]:
        return {n for n in now.get(label, "").split(",") if n}
    return names("running_lora_adapters"), names("waiting_lora_adapters")


def root(adapter: str | None) -> int:
    """The parent key of a prompt's first block under ``adapter``: the same tokens under two adapters (or an
    adapter and the base model) are different KV, so their chains start apart. Stable across processes (not
    ``hash(str)``, which each process seeds at random), as the block keys are."""
    if adapter is None:
        return ROOT
    return int.from_bytes(hashlib.blake2b(adapter.encode(), digest_size=8).digest(), "big") >> 1


class AdapterNotReady(NoWorkers):
    """A declared adapter that no healthy decode worker holds yet (or any more): a 503, retried later."""


@dataclass
class Declared:
    """The adapters the router serves: name -> the path vLLM loads it from (a source as the workers see it:
    ``local_model_path``), beside the base model's name."""
    base: str
    paths: dict[str, str] = field(default_factory=dict)

    def set(self, sources: dict[str, str]) -> tuple[set[str], set[str]]:
        """Replaces the declared adapters (name -> source); returns (added or moved, removed)."""
        paths = {name: local_model_path(src) for name, src in sources.items()}
        changed = {n for n, p in paths.items() if self.paths.get(n) != p}
        removed = set(self.paths) - set(paths)
        self.paths = paths
        return changed, removed

    def adapter_of(self, model: str) -> str | None:
        """None for the base model, the adapter for a declared adapter's name; any other name is a 404."""
        if model == self.base:
            return None
        if model in self.paths:
            return model
        served = ", ".join(f"`{n}`" for n in [self.base, *sorted(self.paths)])
        raise NotFound(f"The model `{model}` does not exist; this router serves {served}.", param="model")


def read_file(path: str) -> dict[str, str]:
    """An adapters file: a JSON object of name -> source (local runs; in a cluster the DisaggDeployment is
    read instead)."""
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
        raise ValueError(f"{path}: an adapters file is a JSON object of name -> source")
    return data


class FileWatch:
    """Re-reads an adapters file when it changes (as auth.py does the API keys): a running router takes a new
    adapter, or drops one, without a restart."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen: tuple | None = None

    def changed(self) -> dict[str, str] | None:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return None
        seen = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        if seen == self._seen:
            return None
        try:
            data = read_file(self.path)
        except (OSError, ValueError) as e:
            log.error("adapters file %s not taken: %s", self.path, e)
            return None
        self._seen = seen
        return data
