"""The performance model, the ground floor the planner, the configurator, the simulator and the benchmarks
stand on. Imported as ``disagg.perf``.

* :mod:`.model`: how long one prefill, one decode step and one KV transfer take (analytic from
  ``data/models.yaml`` and ``data/gpus.yaml``, a measured profile, or a shipped kernel calibration,
  ``data/calibration/``), and the online correction;
* :mod:`.serving`: what those latencies mean for a deployment under load (queueing, batching, utilisation
  caps, KV transfer): the one set of constants the planner, the configurator and the simulator size with;
* :mod:`.measured`: public kernel timings (Vidur's H100 profiling) turned into a calibration;
* :mod:`.profile`: ``disagg profile``, which measures a running worker into a profile for :mod:`.model`.

It imports nothing from the planner, the configurator, the simulator, the router or the operator (only
``disagg.api`` and third-party libraries; ``tests/test_perf_package.py`` checks it), so any of them can
import it without dragging the others in.
"""
