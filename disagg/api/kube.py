"""How every component talks to the Kubernetes API: one request timeout, one home.

The kubernetes client waits forever by default: an API server (or a proxy in front of it) that accepts a
connection and never answers would stall the caller for good, and in the operator a hung list holds a
lock that every kopf thread then waits on (operator/fleet.py). Every call carries a (connect, read)
timeout instead; a call cut by it fails like any API error, and its caller's retry takes over.
"""

from __future__ import annotations

from typing import Any

# (connect, read) seconds. The read bound is per socket read, not per list: a paged list of a large
# fleet reads continuously and is never cut by it. urllib3 retries a timed-out GET up to 3 times first.
KUBE_REQUEST_TIMEOUT: tuple[float, float] = (5.0, 30.0)


def api_client(configuration: Any = None, timeout: tuple[float, float] | None = None) -> Any:
    """A kubernetes ``ApiClient`` whose every call without its own ``_request_timeout`` gets ``timeout``
    (default: KUBE_REQUEST_TIMEOUT). Not for watches meant to stay open (pass ``_request_timeout`` there)."""
    from kubernetes import client

    timeout = timeout or KUBE_REQUEST_TIMEOUT

    class _TimedApiClient(client.ApiClient):
        def call_api(self, method, url, header_params=None, body=None, post_params=None, _request_timeout=None):
            return super().call_api(method, url, header_params=header_params, body=body, post_params=post_params,
                                    _request_timeout=_request_timeout or timeout)

    return _TimedApiClient(configuration)
