"""Load predictors: the next interval's value of a series from its history.

Registered by the names of ``spec.planner.predictor``; exactly one default;
unknown names are refused. Each is a pure function of the history (oldest
first), so the planner keeps the history and the predictors keep nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from disagg.api.v1alpha1 import Predictor as PredictorName


class Predictor(Protocol):
    name: str

    def predict(self, history: Sequence[float], ahead: int = 1) -> float:
        """The value ``ahead`` intervals after the last one in ``history``."""
        ...


@dataclass(frozen=True)
class LastValue:
    name: str = PredictorName.LAST_VALUE.value

    def predict(self, history: Sequence[float], ahead: int = 1) -> float:
        return max(history[-1], 0.0) if history else 0.0


@dataclass(frozen=True)
class MovingAverage:
    window: int = 4
    name: str = PredictorName.MOVING_AVERAGE.value

    def predict(self, history: Sequence[float], ahead: int = 1) -> float:
        if not history:
            return 0.0
        tail = history[-self.window:]
        return max(sum(tail) / len(tail), 0.0)


@dataclass(frozen=True)
class HoltWinters:
    """Additive Holt-Winters: level + trend + a season of ``season`` intervals, once a season is seen.

    Seasonal from one whole season on (its trend starts at zero until a second season is
    seen); before that (or with ``season=0``) Holt's linear trend method; with fewer than two
    points, the last value.
    """

    alpha: float = 0.5
    beta: float = 0.3
    gamma: float = 0.3
    season: int = 0
    name: str = PredictorName.HOLT_WINTERS.value

    def predict(self, history: Sequence[float], ahead: int = 1) -> float:
        n = len(history)
        if n < 2:
            return LastValue().predict(history)
        m = self.season
        if m >= 2 and n > m:
            first = history[:m]
            level = sum(first) / m
            # the trend from two whole seasons when there are two, else none yet
            trend = (sum(history[m:2 * m]) - sum(first)) / (m * m) if n >= 2 * m else 0.0
            seasonal = [x - level for x in first]
            for t in range(m, n):
                x, s = history[t], seasonal[t % m]
                prev_level = level
                level = self.alpha * (x - s) + (1 - self.alpha) * (level + trend)
                trend = self.beta * (level - prev_level) + (1 - self.beta) * trend
                seasonal[t % m] = self.gamma * (x - level) + (1 - self.gamma) * s
            return max(level + ahead * trend + seasonal[(n + ahead - 1) % m], 0.0)
        level, trend = history[0], history[1] - history[0]
        for x in history[1:]:
            prev_level = level
            level = self.alpha * x + (1 - self.alpha) * (level + trend)
            trend = self.beta * (level - prev_level) + (1 - self.beta) * trend
        return max(level + ahead * trend, 0.0)


DEFAULT = PredictorName.MOVING_AVERAGE.value
_REGISTRY: dict[str, Callable[..., Predictor]] = {}


def register(name: str, factory: Callable[..., Predictor]) -> None:
    if name in _REGISTRY:
        raise ValueError(f"predictor {name!r} is already registered")
    _REGISTRY[name] = factory


def get(name: str | None = None, **params: float) -> Predictor:
    key = name or DEFAULT
    if key not in _REGISTRY:
        raise ValueError(f"unknown predictor {key!r}; known: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[key](**params)


def names() -> list[str]:
    return sorted(_REGISTRY)


register(PredictorName.LAST_VALUE.value, LastValue)
register(PredictorName.MOVING_AVERAGE.value, MovingAverage)
register(PredictorName.HOLT_WINTERS.value, HoltWinters)
