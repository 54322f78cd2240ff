"""Every reason the planner writes (CamelCase): ``status.planner.reason``, the ``PlannerActive`` and ``SLOMet``
conditions, events and the ``reason`` label of ``disagg_planner_decisions_total``. One home, so the
planner's decision, the SLO verdict and the alerts never spell the same cause two ways."""

# decisions (status.planner.reason, PlannerActive when it holds)
SCALED = "Scaled"
STEADY = "Steady"
COOLDOWN = "ScaleDownCooldown"
NOT_READY = "DeploymentNotReady"
ROLLING_OUT = "RolloutInProgress"
BUDGET_LIMITED = "GPUBudgetLimited"
METRICS_OK = "MetricsAvailable"            # PlannerActive=True
METRICS_UNAVAILABLE = "MetricsUnavailable"  # Prometheus answered, a required series is absent or NaN
# the performance model has no entry for the deployment's model or GPU: it holds rather than size the deployment
# as another model or for another GPU (the metrics were read: these never stand in for a metrics outage)
UNKNOWN_MODEL = "UnknownModel"
UNKNOWN_GPU = "UnknownGPU"
# flex workers (disagg.planner.flex): a decision that moved flex workers between roles, grew the flex pool
# (neither role had one to spare) or shrank it (both idle); a switch whose drain outlasted its bound was given
# up (the worker stays in its old role: no request is cut to make a switch)
ROLE_SWITCHED = "RoleSwitched"
FLEX_GROWN = "FlexPoolGrown"
FLEX_SHRUNK = "FlexPoolShrunk"
SWITCH_DRAIN_TIMED_OUT = "SwitchDrainTimedOut"

# the metrics source could not be read (decisions hold; SLOMet is Unknown with the same reason)
PROMETHEUS_UNREACHABLE = "PrometheusUnreachable"  # no answer: refused, timed out, not Prometheus' API
QUERY_ERROR = "QueryError"                        # Prometheus answered with an error (its type, never its text)
PROMETHEUS_NOT_ALLOWED = "PrometheusNotAllowed"    # spec.planner.prometheus names no endpoint of the allowlist

# SLOMet
TARGETS_MET = "TargetsMet"
TTFT_ABOVE = "TTFTAboveTarget"
ITL_ABOVE = "ITLAboveTarget"
BOTH_ABOVE = "TTFTAndITLAboveTarget"
NO_METRICS = "NoMetrics"
NO_TRAFFIC = "NoTraffic"
