"""The discrete-event simulator (``disagg simulate``) and its request traces. Imported as
``disagg.simulator``.

Its own package, above both :mod:`disagg.perf` and :mod:`disagg.planner`: it runs the planner's
:func:`disagg.planner.decide.decide` (and its fast path and predictors) unchanged against simulated time and
latencies from the performance model, so it imports the planner, which rules it out of the ground-floor
:mod:`disagg.perf`. It is not part of the planner process either (nothing the planner's sidecar runs
imports it, and its plots need matplotlib), so ``planner/`` holds only the planner process. The
configurator's tests and ``bench/`` compare against it.
"""
