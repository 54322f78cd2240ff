"""disagg: disaggregated prefill/decode LLM serving on Kubernetes.

The import root. Shared code lives here (``disagg.api``: the API models, label
keys and names every component uses); each component is its own top-level
folder mapped into this package (``disagg.operator`` is ``operator/``, and so on).
"""

__version__ = "0.1.0"
