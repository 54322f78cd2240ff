"""kopf's diff base (the 'last-handled-configuration' annotation), built without deep-copying
what it throws away.

kopf computes a DisaggDeployment's essence (spec, labels, annotations) on every event of it, to
tell spec changes from the rest, by deep-copying the whole body and then deleting its metadata
and status. Those are most of the body (managedFields, conditions), and most events are status
writes: with 300 deployments created at once the copies were a fifth of the operator's time
(bench/operator_scale.py --profile). Here kopf's own build runs on a body trimmed to what it
keeps, so the essence and the stored annotation are exactly kopf's.
"""

from __future__ import annotations

from collections.abc import Iterable

import kopf
from kopf._cogs.structs import bodies, dicts  # the types of the storage interface

# what kopf's build reads from metadata: labels and annotations (kept), ownerReferences (key naming)
_METADATA_READ = ("labels", "annotations", "ownerReferences")


class LeanDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    def build(self, *, body: bodies.Body,
              extra_fields: Iterable[dicts.FieldSpec] | None = None) -> bodies.BodyEssence:
        extra = list(extra_fields or [])
        if any(dicts.parse_field(f)[0] in ("metadata", "status") for f in extra):
            return super().build(body=body, extra_fields=extra)  # a handler watches a field dropped below
        meta = body.get("metadata") or {}
        trimmed = {k: v for k, v in body.items() if k not in ("metadata", "status")}
        trimmed["metadata"] = {k: meta[k] for k in _METADATA_READ if k in meta}
        return super().build(body=kopf.Body(trimmed), extra_fields=extra)
