"""A request's part in the router's metrics and in its workers' loads."""

from __future__ import annotations

from .pool import Worker


def account(w: Worker, delta: int) -> None:
    w.active += delta     # the gauge reads it at scrape time (Fleet._watch)
    if w.settled is not None:   # a flex worker's drain waits for its requests to end
        w.settled.set()


class Accounting:
    """``needs_ids``: whether the router tokenizes before routing (:attr:`~.decision.Decider.needs_ids`);
    where it does not, prompt tokens are counted from the worker's usage instead."""

    def __init__(self, metrics, needs_ids: bool) -> None:
        self.metrics = metrics
        self.needs_ids = needs_ids
        self._children: dict[tuple, object] = {}

    def labelled(self, metric, *values: str):
        """``metric.labels(*values)``, looked up once: prometheus_client's ``labels`` validates, joins and
        locks on every call (~2% of the router's samples at one stream, py-spy)."""
        child = self._children.get((metric, values))
        if child is None:
            child = self._children[metric, values] = metric.labels(*values)
        return child

    def count_prompt(self, usage: dict | None) -> None:
        """Prompt-token metrics from the worker's usage where the router did not tokenize (it counts its
        own before routing otherwise): the worker's cached count stands in for the router's index's."""
        prompt_tokens = (usage or {}).get("prompt_tokens")
        if self.needs_ids or prompt_tokens is None:
            return
        self.metrics.input_tokens.observe(prompt_tokens)
        self.metrics.prompt_tokens.inc(prompt_tokens)
        self.metrics.cached_prompt_tokens.inc((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
