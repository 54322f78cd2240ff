"""The SLO planner process: reads Prometheus, predicts load and resizes prefill and decode with the shared
performance model (:mod:`disagg.perf`). Imported as ``disagg.planner``; its simulator is
:mod:`disagg.simulator`."""
