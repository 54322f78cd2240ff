"""The kopf operator: reconciles DisaggDeployments into gang-scheduled,
topology-packed prefill/decode workloads and owns their status.

Imported as ``disagg.operator``; the folder is never a top-level module, so the
standard library's ``operator`` is left alone.
"""
