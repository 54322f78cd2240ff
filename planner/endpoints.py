"""The Prometheus endpoints the planner may read: an allowlist in the operator's configuration.

A DisaggDeployment names one (``spec.planner.prometheus``) and never gives a URL: a namespace user
must not make the planner's pod fetch whatever its network position reaches and read the answer back
in status. The chart writes the list (``planner.prometheusEndpoints``) into a file the planner reads at
start-up (``--prometheus-endpoints``)::

    default: main                        # for deployments that name none (optional)
    endpoints:
      - name: main
        url: https://prometheus-operated.monitoring:9090
        caFile: /etc/disagg/prometheus-ca/main/ca.crt   # optional: the CA that signed its certificate
        insecureSkipVerify: false                       # TLS is verified unless this says otherwise

The chart also renders a ValidatingAdmissionPolicy refusing names not in the list; the planner checks
again (a cluster without the policy, or a list changed since) and holds with a reason naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from disagg.api.names import DNS1035_LABEL

# spec.planner.prometheus (status, events) and the planner's hold reason when the name is not allowed
FIELD = "spec.planner.prometheus"


@dataclass(frozen=True)
class Endpoint:
    name: str
    url: str
    ca_file: str | None = None
    insecure_skip_verify: bool = False

    @property
    def verify(self) -> bool | str:
        """``requests``' verify: the CA file, the system's trust store, or (only when asked) off."""
        if self.insecure_skip_verify:
            return False
        return self.ca_file or True


@dataclass(frozen=True)
class Allowlist:
    endpoints: dict[str, Endpoint]
    default: str | None = None

    @classmethod
    def from_dict(cls, doc: dict[str, Any] | None) -> Allowlist:
        doc = doc or {}
        unknown = set(doc) - {"default", "endpoints"}
        if unknown:
            raise ValueError(f"Prometheus endpoints: unknown keys {sorted(unknown)}")
        endpoints: dict[str, Endpoint] = {}
        for i, e in enumerate(doc.get("endpoints") or []):
            where = f"endpoints[{i}]"
            extra = set(e) - {"name", "url", "caFile", "insecureSkipVerify"}
            if extra:
                raise ValueError(f"{where}: unknown keys {sorted(extra)}")
            name, url = str(e.get("name", "")), str(e.get("url", ""))
            if not re.fullmatch(DNS1035_LABEL, name) or len(name) > 63:
                raise ValueError(f"{where}.name: {name!r} is not a DNS-1035 label")
            if not re.fullmatch(r"https?://[^\s]+", url):
                raise ValueError(f"{where}.url: {url!r} is not an http(s) URL")
            if name in endpoints:
                raise ValueError(f"{where}.name: {name!r} appears twice")
            endpoints[name] = Endpoint(name, url.rstrip("/"), e.get("caFile") or None,
                                       bool(e.get("insecureSkipVerify", False)))
        default = doc.get("default") or None
        if default is not None and default not in endpoints:
            raise ValueError(f"default: {default!r} is not one of the endpoints {sorted(endpoints)}")
        return cls(endpoints, default)

    @classmethod
    def load(cls, path: str | Path | None) -> Allowlist:
        return cls.from_dict(yaml.safe_load(Path(path).read_text()) if path else None)

    def resolve(self, name: str | None) -> Endpoint | str:
        """The endpoint a deployment reads, or why there is none (a message naming the field)."""
        allowed = ", ".join(sorted(self.endpoints)) or "none configured"
        if name is None:
            if self.default:
                return self.endpoints[self.default]
            return (f"{FIELD} is unset and the operator has no default Prometheus endpoint "
                    f"(allowed: {allowed})")
        if name not in self.endpoints:
            return f"{FIELD}: {name!r} is not an allowed Prometheus endpoint (allowed: {allowed})"
        return self.endpoints[name]
