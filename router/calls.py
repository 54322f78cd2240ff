"""One request to one worker, its failures in the router's terms.

Prefill, non-streaming decodes and probes go over aiohttp's client; decode streams over the lean one
(:mod:`.upstream`). A failure that another worker may not have is :class:`WorkerError` (the caller may
try elsewhere); a worker's 4xx is the client's mistake as that worker judged it
(:class:`~.errors.UpstreamRejected`), passed on.
"""

from __future__ import annotations

import json
import ssl

import aiohttp

from disagg.api import metrics as m

from . import upstream
from .config import MAX_ANSWER_BYTES, MAX_ERROR_BODY_BYTES, RouterConfig
from .errors import UpstreamRejected
from .pool import Worker


class WorkerError(Exception):
    """A worker could not be reached or failed (5xx); the router may try elsewhere."""


class TooLarge(WorkerError):
    """A worker's answer was larger than the router reads (config.MAX_ANSWER_BYTES)."""


class Calls:
    """The router's two HTTP clients to its workers, made at :meth:`start` (inside the event loop)."""

    def __init__(self, config: RouterConfig, metrics) -> None:
        self.config = config
        self.metrics = metrics
        self.session: aiohttp.ClientSession | None = None
        # decode streams: the lean client (upstream.py); the rest on aiohttp's session
        self.streams: upstream.Client | None = None

    def start(self) -> None:
        # https:// workers: one trust context for both clients (streams, and prefill/probes on aiohttp's)
        ca = self.config.worker_ca_file
        tls = ssl.create_default_context(cafile=ca) if ca else None
        self.session = aiohttp.ClientSession(
            # keep-alive shorter than the workers' (uvicorn: 5 s), so a pooled connection is
            # not reused just as the worker closes it
            # no connection limit here: the bound on requests is the router's admission control
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=3,
                                           ssl=tls if tls is not None else True),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.spec.connect_timeout_seconds))
        self.streams = upstream.Client(self.config.spec.connect_timeout_seconds, keepalive_s=3, ssl_context=tls)

    async def close(self) -> None:
        if self.session:
            await self.session.close()
        if self.streams:
            self.streams.close()

    def forget(self, w: Worker) -> None:
        """Closes the pooled stream connections of a worker that left."""
        if self.streams is not None:
            self.streams.forget(w.target)

    async def post(self, w: Worker, endpoint: str, body: dict, timeout: float | None,
                   headers: dict[str, str] | None = None) -> dict:
        """``headers``: more request headers (a traced request's traceparent)."""
        try:
            async with self.session.post(f"{w.url}{endpoint}", json=body, headers=headers, timeout=aiohttp.ClientTimeout(
                    total=timeout, sock_connect=self.config.spec.connect_timeout_seconds)) as r:
                if 400 <= r.status < 500:
                    raise await _rejected(r)
                if r.status != 200:
                    text = (await read(r, MAX_ERROR_BODY_BYTES))[0]
                    raise WorkerError(f"HTTP {r.status}: {text[:200].decode(errors='replace')}")
                # a declared length over the bound is refused before a byte of it is read
                more = r.content_length is not None and r.content_length > MAX_ANSWER_BYTES
                if not more:
                    raw, more = await read(r, MAX_ANSWER_BYTES)
                if more:
                    r.close()
                    raise TooLarge(f"the worker {w.name} answered more than the router accepts "
                                   f"({MAX_ANSWER_BYTES} bytes)")
        except aiohttp.ClientError as e:
            if isinstance(e, aiohttp.ConnectionTimeoutError):  # connect timed out: another worker may answer
                self.metrics.timeouts.labels(m.TIMEOUT_CONNECT).inc()
                raise WorkerError(f"connecting timed out ({self.config.spec.connect_timeout_seconds:g} s)") from e
            if isinstance(e, TimeoutError):
                raise TimeoutError(str(e)) from e
            if isinstance(e, aiohttp.ClientConnectorError):   # nothing listens there: out until /health says so
                w.healthy = False
            raise WorkerError(str(e) or type(e).__name__) from e
        except TimeoutError as e:          # the total timeout (aiohttp raises asyncio's own)
            raise TimeoutError(str(e)) from e
        try:
            data = json.loads(raw)
        except ValueError as e:            # UnicodeDecodeError among them
            raise WorkerError(f"the worker {w.name} answered with invalid JSON: {e}") from None
        if not isinstance(data, dict):
            raise WorkerError(f"the worker {w.name} answered with JSON that is not an object")
        return data

    async def open_stream(self, w: Worker, endpoint: str, body: dict,
                          headers: dict[str, str] | None = None) -> upstream.Connection:
        """The worker's streamed response, its head read; the first-token timeout runs from here until
        :func:`~.relay.first_token` has a token. ``headers``: more request headers (a traceparent)."""
        spec = self.config.spec
        try:
            r = await self.streams.post(w.target, endpoint, upstream.dumps(body), spec.first_token_timeout_seconds,
                                        headers)
        except upstream.UpstreamError as e:
            if isinstance(e, upstream.ConnectTimeout):
                self.metrics.timeouts.labels(m.TIMEOUT_CONNECT).inc()
            elif isinstance(e, upstream.ReadTimeout):      # no answer headers within the first-token timeout
                self.metrics.timeouts.labels(m.TIMEOUT_FIRST_TOKEN).inc()
            elif isinstance(e, upstream.ConnectFailed):    # nothing listens there: out until /health says so
                w.healthy = False
            raise WorkerError(str(e) or type(e).__name__) from e
        status = r.status        # before release(), which clears it when the connection is pooled
        if status == 200:
            return r
        try:
            text = await r.body(MAX_ERROR_BODY_BYTES)
        except upstream.UpstreamError as e:
            raise WorkerError(f"HTTP {status}, then {e}") from e
        finally:
            r.release()
        if 400 <= status < 500:
            raise _rejected_body(status, text)
        raise WorkerError(f"HTTP {status}: {text[:200].decode(errors='replace')}")


async def read(r: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """A worker's body, at most ``limit`` bytes of it, and whether it had more: then the rest is not read
    and the connection is closed (aiohttp would otherwise read it to the end before pooling it)."""
    parts, size = [], 0
    while size <= limit and (data := await r.content.read(limit + 1 - size)):
        parts.append(data)
        size += len(data)
    if size > limit:
        r.close()
        return b"".join(parts)[:limit], True
    return b"".join(parts), False


async def _rejected(r: aiohttp.ClientResponse) -> UpstreamRejected:
    """A worker's 4xx, passed on with its own message (a body cut at MAX_ERROR_BODY_BYTES is no JSON:
    then a message of the router's own)."""
    try:
        return _rejected_body(r.status, (await read(r, MAX_ERROR_BODY_BYTES))[0])
    except aiohttp.ClientError:
        return _rejected_body(r.status, b"")


def _rejected_body(status: int, text: bytes) -> UpstreamRejected:
    try:
        err = json.loads(text).get("error") or {}
    except (ValueError, AttributeError):
        err = {}
    if not isinstance(err, dict):
        err = {}
    return UpstreamRejected(status, err.get("message") or f"the worker refused the request (HTTP {status})",
                            param=err.get("param"), type_=err.get("type"))
