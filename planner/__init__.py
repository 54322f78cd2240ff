"""The SLO planner: reads Prometheus, predicts load and resizes prefill and decode
from the shared performance model. Imported as ``disagg.planner``."""
