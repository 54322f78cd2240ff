"""The stream relay: a worker's SSE bytes to the client as they arrive, with as little work per chunk as
the accounting allows.

The profile of the router at 1,000 streams (bench/router_vs_vllm_router.py, py-spy) had the old
line-by-line relay's reading (two ``readline`` awaits per event) at 18% of the router's samples and
the socket writes at 19%. Here each read takes whatever the socket delivered (``readany``), splits it
into events only to look at their first bytes, and writes what is complete in one piece. No event's JSON
is parsed, except the single usage-only event at the end (its token count).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import aiohttp

from disagg.api import metrics as m

from .errors import UpstreamFailed, UpstreamTimeout, sse

_USAGE_ONLY = re.compile(rb'"choices":\s*\[\]')
_DATA = b"data: "
_DONE = b"data: [DONE]"


@dataclass
class StreamEnd:
    """How a relayed stream ended, for the caller's accounting."""
    outcome: str = m.OUTCOME_UPSTREAM_ERROR
    output_tokens: int = 0
    first_token_at: float | None = None
    idle_timeout: bool = False


async def relay(resp: aiohttp.ClientResponse, worker: str, end: StreamEnd, *, start: float,
                client_wants_usage: bool, observe_ttft: Callable[[float], None],
                observe_itl: Callable[[float], None], first_token_timeout_s: float | None,
                idle_timeout_s: float | None) -> AsyncIterator[bytes]:
    """Yields the client's bytes: every ``data:`` event but the usage-only one (unless the client asked
    for usage), then ``[DONE]``; or an OpenAI-style error event when the worker fails, stalls longer
    than ``idle_timeout_s`` between chunks, or ends without ``[DONE]``. ``end`` says how it went.
    The caller opened the response with ``first_token_timeout_s`` as its read timeout; after the first
    token the connection's read timeout becomes ``idle_timeout_s``."""
    content = resp.content
    pending = b""
    last = None
    protocol = resp.connection.protocol if resp.connection is not None else None
    try:
        while True:
            data = await content.readany()
            if not data:
                yield sse(UpstreamFailed(f"the decode worker {worker} ended the stream early"))
                return
            if b"\r" in data:             # SSE allows CRLF; vLLM sends LF. One form to split on.
                data = data.replace(b"\r\n", b"\n")
            pending += data
            cut = pending.rfind(b"\n\n")
            if cut < 0:
                continue
            complete, pending = pending[:cut], pending[cut + 2:]
            now = time.monotonic()
            out = []
            done = False
            for event in complete.split(b"\n\n"):
                if not event.startswith(_DATA):
                    continue              # comments, retry:, empty lines: not the client's
                if event.startswith(_DONE):
                    out.append(_DONE + b"\n\n")
                    done = True
                    break
                if _USAGE_ONLY.search(event):
                    usage = json.loads(event[6:]).get("usage") or {}
                    end.output_tokens = usage.get("completion_tokens", end.output_tokens)
                    if client_wants_usage:
                        out.append(event + b"\n\n")
                    continue
                if last is None:
                    end.first_token_at = now
                    observe_ttft(now - start)
                    # the first token came: from now on the worker may pause at most the idle timeout
                    if protocol is not None and idle_timeout_s is not None:
                        protocol.read_timeout = idle_timeout_s
                else:
                    observe_itl(now - last)
                last = now
                out.append(event + b"\n\n")
            if out:
                yield out[0] if len(out) == 1 else b"".join(out)
            if done:
                end.outcome = m.OUTCOME_SUCCESS
                return
    except aiohttp.ServerTimeoutError:
        end.idle_timeout = True
        if last is None:
            msg = f"sent no token within the first-token timeout ({first_token_timeout_s:g} s)"
        else:
            msg = f"stalled mid-stream longer than the idle timeout ({idle_timeout_s:g} s)"
        yield sse(UpstreamTimeout(f"the decode worker {worker} {msg}"))
    except (aiohttp.ClientError, TimeoutError) as e:
        yield sse(UpstreamFailed(f"the decode worker {worker} failed mid-stream: {e}"))
