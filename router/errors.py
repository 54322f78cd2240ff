"""Typed errors and their one rendering: ``{"error": {message, type, param, code}}``.

Every error a client sees is one of these, raised where the problem is found
and turned into a response (or a final SSE event) only by :func:`body`.
"""

from __future__ import annotations

import json


class RouterError(Exception):
    status = 500
    type = "internal_error"
    code: str | None = None     # OpenAI's string code where it has one; else the HTTP status (as vLLM does)

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(RouterError):
    """No API key, or not one of the router's (spec.router.auth): OpenAI's 401. The message never
    repeats what the client sent."""
    status = 401
    type = "invalid_request_error"
    code = "invalid_api_key"


class PayloadTooLarge(RouterError):
    status = 413
    type = "invalid_request_error"


class BodyTimeout(RouterError):
    """The client did not send its whole body within spec.router.bodyTimeoutSeconds."""
    status = 408
    type = "invalid_request_error"


class NotFound(RouterError):
    status = 404
    type = "not_found_error"


class NoWorkers(RouterError):
    status = 503
    type = "service_unavailable"


class UpstreamFailed(RouterError):
    status = 502
    type = "upstream_error"


class UpstreamTimeout(RouterError):
    """A worker took longer than a configured timeout (connect, first token, between chunks, unary)."""
    status = 504
    type = "timeout_error"


class Overloaded(RouterError):
    """The router holds its bound of requests in flight and its queue is full or the wait ran out."""
    status = 429
    type = "rate_limit_exceeded"

    def __init__(self, message: str, retry_after_s: int):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UpstreamRejected(RouterError):
    """The worker refused the request (4xx): its own message, passed on."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None):
        super().__init__(message, param)
        self.status = status
        self.type = type_ or ("invalid_request_error" if status == 400 else "upstream_error")


def body(err: RouterError) -> dict:
    return {"error": {"message": err.message, "type": err.type, "param": err.param,
                      "code": err.code if err.code is not None else err.status}}


def sse(err: RouterError) -> bytes:
    """The same error as the last event of a stream that fails after it began."""
    return b"data: " + json.dumps(body(err)).encode() + b"\n\ndata: [DONE]\n\n"
