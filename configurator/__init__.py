"""disagg.configurator: aggregated vs disaggregated layouts for a model, GPU and SLO (``disagg configure``)."""

from .estimate import Estimate, Inputs, Result, configure

__all__ = ["Estimate", "Inputs", "Result", "configure"]
