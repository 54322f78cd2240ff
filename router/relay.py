"""The stream relay: a worker's SSE bytes to the client as they arrive, with as little work per chunk as
the accounting allows.

The profile of the router at 1,000 streams (bench/router_vs_vllm_router.py, py-spy) had the old
line-by-line relay's reading (two ``readline`` awaits per event) at 18% of the router's samples and
the socket writes at 19%. Here each read takes whatever the socket delivered (:mod:`.upstream`, the
chunked framing already off), splits it into events only to look at their first bytes, and hands what is
complete to the client's :class:`Sink` in one piece: a plain call, no async generator between the worker's
socket and the client's (each chunk used to resume three). No event's JSON is parsed, except the single
usage-only event at the end (its token count).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from disagg.api import metrics as m

from .errors import RouterError, UpstreamFailed, UpstreamTimeout, sse
from .migration import TokenLog
from .upstream import Connection, ProtocolError, ReadTimeout, UpstreamError

_USAGE_ONLY = re.compile(rb'"choices":\s*\[\]')
# The most a worker may send of one stream without completing an event (or, before the first token, without
# a token event): a token event is ~100 bytes and one with top-20 logprobs a few KB, so this bounds only a
# broken or hostile worker, whose bytes would otherwise pile up in the router's memory, one buffer a stream.
MAX_EVENT_BYTES = 1 << 20
_DATA = b"data: "
_DONE = b"data: [DONE]"


@dataclass(eq=False)
class StreamEnd:
    """How a relayed stream ended, for the caller's accounting; while it runs, when it last moved."""
    outcome: str = m.OUTCOME_UPSTREAM_ERROR
    output_tokens: int = 0
    first_token_at: float | None = None
    idle_timeout: bool = False
    last_activity: float = 0.0
    resp: Connection | None = None
    last_token_at: float | None = None     # when the client got this stream's last token event
    usage: dict | None = None              # the worker's usage chunk's, as it came
    # a failed stream: why, and what the client gets if the router does not continue it elsewhere
    error: str | None = None
    failure: bytes = b""

    def fail(self, err: RouterError) -> None:
        self.error, self.failure = err.message, sse(err)


class Watchdog:
    """Cuts streams that stalled: no token within the first-token timeout of the request, or nothing
    for the idle timeout between chunks. One sweep over all streams a fraction of a second apart, not a
    timer per stream re-armed on every chunk (aiohttp's read timeout: a timer cancelled and created
    per socket read, in the profile at 2,000 streams)."""

    def __init__(self, first_token_timeout_s: float, idle_timeout_s: float) -> None:
        self.first_token_timeout_s, self.idle_timeout_s = first_token_timeout_s, idle_timeout_s
        self.streams: set[StreamEnd] = set()
        self.interval_s = min(max(min(first_token_timeout_s, idle_timeout_s) / 4, 0.05), 1.0)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.sweep(time.monotonic())

    def sweep(self, now: float) -> None:
        for end in list(self.streams):
            started = end.first_token_at is not None
            if now - end.last_activity > (self.idle_timeout_s if started else self.first_token_timeout_s):
                self.streams.discard(end)
                end.idle_timeout = True
                # wakes the relay's pending read with the error
                end.resp.set_exception(ReadTimeout("stalled"))


# how long a stream that sent [DONE] may take to end its HTTP body (the chunked terminator) before its
# connection is closed instead of going back to the pool. A worker writes ``[DONE]`` and the terminator
# apart (vLLM's uvicorn, aiohttp), and a connection whose body has not ended cannot be reused: every
# stream then paid a new TCP connection to the worker before its first token (strace of one stream).
FINISH_TIMEOUT_S = 5.0


class Sink(Protocol):
    """The client's side of a stream (router/app.py writes it to the client's connection)."""

    def write(self, data: bytes) -> bool:
        """Sends ``data``; True when :meth:`drain` must be awaited before the next write (a slow client,
        or a write that only aiohttp can make). Raises ConnectionResetError when the client has gone."""

    async def drain(self) -> None: ...


async def emit(sink: Sink, data: bytes) -> None:
    if sink.write(data):
        await sink.drain()


async def finish(resp: Connection) -> None:
    """A stream that sent ``[DONE]``: its connection back to the pool once the worker's body has ended
    (its chunked terminator, usually in the same read), closed when that takes longer than
    FINISH_TIMEOUT_S; the client's stream is complete either way."""
    try:
        ended = resp.is_eof() or await resp.wait_eof(FINISH_TIMEOUT_S)
    except BaseException:
        resp.close()
        raise
    if ended:
        resp.release()
    else:
        resp.close()


class EndedBeforeOutput(Exception):
    """The worker ended the stream (``[DONE]``, an error event, or the connection closed) before any token:
    nothing reached the client yet, so another worker can serve the request."""


async def first_token(resp: Connection, worker: str) -> tuple[bytes, BaseException | None]:
    """Reads ``resp`` up to its first token event. Returns what was read, for :func:`relay` to replay, and
    the error that interrupted the read (a timeout or a broken connection: the relay reports it as it
    would mid-stream). Raises :class:`EndedBeforeOutput` when the stream ended without a token. A
    draining vLLM answers a request it will not run with a stream that ends at once, no token in it
    (seen when a decode pod is scaled away under load); the client must never get that as a response."""
    buf = b""
    try:
        while True:
            data = await resp.read()
            if not data:
                raise EndedBeforeOutput(f"the decode worker {worker} closed the stream before its first token")
            buf += data
            if len(buf) > MAX_EVENT_BYTES:
                # what it sent is no use to the client: the relay reports the failure, with nothing to replay
                return b"", ProtocolError(f"sent {len(buf)} bytes and no token event (at most "
                                          f"{MAX_EVENT_BYTES} before the first)")
            events = buf.replace(b"\r\n", b"\n").split(b"\n\n")[:-1]   # the complete ones
            for event in events:
                if not event.startswith(_DATA) or _USAGE_ONLY.search(event):
                    continue
                if event.startswith(_DONE) or b'"choices"' not in event:   # the end, or an error event
                    raise EndedBeforeOutput(f"the decode worker {worker} ended the stream before its first "
                                            f"token: {event[:200].decode(errors='replace')}")
                resp.stop_timer()         # from here the watchdog times the stream
                return buf, None
    except UpstreamError as e:
        return buf, e


class _Relay:
    """One stream's relay state. :meth:`feed` is the per-read work (events out of the worker's bytes,
    the accounting, the write to the client); once the relay is attached to the connection
    (:meth:`~.upstream.Connection.attach`) it runs in the connection's ``data_received``, so a read costs
    no future, no task step and no coroutine resumption (~3-4 of the ~12-15 µs a chunk cost through
    ``read``). The coroutine (:meth:`run`) is woken only when the stream stops, breaks, ends, or the
    client's transport must drain."""
    __slots__ = ("resp", "worker", "end", "sink", "start", "client_wants_usage", "observe_ttft", "observe_itl",
                 "tokens", "last", "pending", "started", "stopped", "draining", "exc")

    def __init__(self, resp: Connection, worker: str, end: StreamEnd, sink: Sink, start: float,
                 client_wants_usage: bool, observe_ttft: Callable[[float], None],
                 observe_itl: Callable[[float], None], tokens: TokenLog | None, last: float | None) -> None:
        self.resp, self.worker, self.end, self.sink, self.start = resp, worker, end, sink, start
        self.client_wants_usage, self.observe_ttft, self.observe_itl = client_wants_usage, observe_ttft, observe_itl
        self.tokens, self.last = tokens, last
        self.pending = b""
        self.started = False              # this stream's first token event went out
        self.stopped = False              # [DONE] or the worker's error event: nothing more to relay
        self.draining = False             # the client's transport is full: the coroutine awaits its drain
        self.exc: BaseException | None = None   # raised by the client's write (gone) or a bug, for run()

    def feed(self, data: bytes) -> None:
        """A read of the worker's body (unframed): its complete events to the client. In a protocol
        callback nothing may raise, so an error is kept for the coroutine and the relay detached."""
        try:
            self._feed(data)
        except Exception as e:            # noqa: BLE001  (re-raised by run())
            self.exc = e
            self.stopped = True
            self.resp.detach()
            self.resp.wake()

    def _feed(self, data: bytes) -> None:
        if b"\r" in data:                 # SSE allows CRLF; vLLM sends LF. One form to split on.
            data = data.replace(b"\r\n", b"\n")
        pending = self.pending + data if self.pending else data
        cut = pending.rfind(b"\n\n")
        if cut < 0:
            if len(pending) > MAX_EVENT_BYTES:
                self.pending = b""
                self.end.fail(UpstreamFailed(f"the decode worker {self.worker} sent an event of more than "
                                             f"{MAX_EVENT_BYTES} bytes"))
                self.stopped = True
                self.resp.detach()
                self.resp.wake()
                return
            self.pending = pending
            return
        complete, self.pending = pending[:cut], pending[cut + 2:]
        end, tokens = self.end, self.tokens
        now = time.monotonic()
        out = []
        done = False
        for event in complete.split(b"\n\n"):
            if not event.startswith(_DATA):
                continue                  # comments, retry:, empty lines: not the client's
            if event.startswith(_DONE):
                out.append(_DONE + b"\n\n")
                done = True
                break
            if b'"choices"' not in event:   # an error event: the worker failed mid-stream
                end.error = f"the decode worker {self.worker} failed mid-stream: " \
                            f"{event[6:206].decode(errors='replace')}"
                end.failure = event + b"\n\n" + _DONE + b"\n\n"
                break
            # the regex only where it can match: a plain substring test rules out nearly every token event
            usage_only = b"[]" in event and _USAGE_ONLY.search(event) is not None
            if tokens is not None and (tokens.reshaping or not usage_only):
                event = tokens.scan(event)
            if usage_only:
                usage = json.loads(event[6:]).get("usage") or {}
                end.output_tokens = usage.get("completion_tokens", end.output_tokens)
                end.usage = usage
                if self.client_wants_usage:
                    out.append(event + b"\n\n")
                continue
            if not self.started:
                self.started = True
                end.first_token_at = now
                if self.last is None:
                    self.observe_ttft(now - self.start)
                else:
                    self.observe_itl(now - self.last)
            else:
                self.observe_itl(now - self.last)
            self.last = end.last_token_at = now
            out.append(event + b"\n\n")
        if self.started:
            end.last_activity = now
        if out and self.sink.write(out[0] if len(out) == 1 else b"".join(out)):
            # a slow client (or the first write, aiohttp's): the coroutine awaits the drain. Until then the
            # worker's bytes stay in the connection, which stops reading them past its bound (upstream.py)
            self.draining = True
            self.resp.detach()
            self.resp.wake()
        if done:
            # the client has [DONE]; the caller accounts for the request, then waits for the worker's
            # body to end (finish) so the connection is pooled before the client's response ends
            end.outcome = m.OUTCOME_SUCCESS
            self.stopped = True
            self.resp.detach()
            self.resp.wake()
        elif end.failure:
            self.stopped = True
            self.resp.detach()
            self.resp.wake()

    async def run(self, head: bytes, head_error: BaseException | None) -> None:
        resp = self.resp
        if head:
            self.feed(head)
        try:
            while True:
                if self.exc is not None:
                    raise self.exc
                if self.draining:
                    await self.sink.drain()
                    self.draining = False
                if self.stopped:
                    return
                if head_error is not None:
                    err, head_error = head_error, None
                    raise err
                data = resp.take()        # what came while the relay was not attached
                if data:
                    self.feed(data)
                    continue
                resp.raise_error()        # the error that broke the body, after every byte before it
                if resp.is_eof():
                    self.end.fail(UpstreamFailed(f"the decode worker {self.worker} ended the stream early"))
                    return
                resp.attach(self.feed)
                await resp.wait()         # detached by whatever woke it
                resp.detach()
        finally:
            resp.detach()


async def relay(resp: Connection, worker: str, end: StreamEnd, sink: Sink, *, start: float,
                client_wants_usage: bool, observe_ttft: Callable[[float], None],
                observe_itl: Callable[[float], None], first_token_timeout_s: float | None,
                idle_timeout_s: float | None, head: bytes = b"",
                head_error: BaseException | None = None, tokens: TokenLog | None = None,
                last: float | None = None) -> None:
    """Writes the client's bytes to ``sink``: every ``data:`` event but the usage-only one (unless the client asked
    for usage), then ``[DONE]``. When the worker fails (an error event, a broken connection), stalls longer
    than ``idle_timeout_s`` between chunks, or ends without ``[DONE]``, it stops and ``end`` holds the
    error and the bytes that would end the client's stream (``end.failure``): the caller continues the
    stream elsewhere (:mod:`.migration`) or sends them. ``end`` says how it went.
    ``tokens`` (streams that may be migrated) records each chunk's token ids, and rewrites a
    continuation's chunks; ``last``, for a continuation, is when the client got its last token (the
    continuation's first chunk is then an inter-token gap, not a first token).
    The stalls are detected by a :class:`Watchdog` watching ``end`` (its ``last_activity``, from the
    request's start until the first token). Until :func:`first_token` found a token, the response's own
    first-token timer ran (:mod:`.upstream`); from here on the watchdog alone times the stream.
    ``head`` and ``head_error`` are what :func:`first_token` read and the error that stopped it.
    The per-read work runs in the connection's callback (:class:`_Relay`)."""
    r = _Relay(resp, worker, end, sink, start, client_wants_usage, observe_ttft, observe_itl, tokens, last)
    try:
        await r.run(head, head_error)
    except ReadTimeout:                       # the watchdog's, or the response's first-token timer
        end.idle_timeout = True
        if not r.started:
            msg = f"sent no token within the first-token timeout ({first_token_timeout_s:g} s)"
        else:
            msg = f"stalled mid-stream longer than the idle timeout ({idle_timeout_s:g} s)"
        end.fail(UpstreamTimeout(f"the decode worker {worker} {msg}"))
    except UpstreamError as e:
        end.fail(UpstreamFailed(f"the decode worker {worker} failed mid-stream: {e}"))
