"""Routing policies: plugins with one interface, registered by name.

A policy picks one worker of a role for a request from the candidates' loads
and their prefix overlap with the prompt. Names are the API's
:class:`~disagg.api.v1alpha1.RoutingPolicy` values; registering a name twice
is refused, and so is asking for an unknown one. Each is described in README.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from disagg.api.v1alpha1 import RouterSpec, RoutingPolicy


@dataclass(frozen=True)
class Candidate:
    name: str
    load: float            # active requests on the worker (as the router counts them)


@dataclass(frozen=True)
class Request:
    blocks: int                          # full prompt blocks
    overlap: dict[str, int] = field(default_factory=dict)  # worker -> leading blocks it holds


@dataclass(frozen=True)
class Decision:
    worker: str
    overlap_blocks: int
    cost: float
    load_bounded: bool = False   # the cheapest worker was passed over for its load (the skew bound)


class Policy(Protocol):
    name: str

    def choose(self, candidates: list[Candidate], request: Request) -> Decision: ...


_REGISTRY: dict[str, Callable[[RouterSpec], Policy]] = {}
DEFAULT = RoutingPolicy.KV_AWARE.value


def register(name: str):
    """Class decorator: registers a policy factory under ``name`` (refuses duplicates)."""
    def wrap(factory):
        if name in _REGISTRY:
            raise ValueError(f"routing policy {name!r} is already registered")
        _REGISTRY[name] = factory
        factory.name = name
        return factory
    return wrap


def create(name: str, spec: RouterSpec | None = None) -> Policy:
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(sorted(_REGISTRY))}") from None
    return factory(spec or RouterSpec())


def names() -> list[str]:
    return sorted(_REGISTRY)


from . import builtin  # noqa: E402,F401  (registers the built-in policies)
