"""A lean HTTP/1.1 client for the decode streams: one asyncio Protocol per connection to a worker, its
response head parsed once, its chunked body unframed in the protocol's own callback, and whole socket
reads handed to the relay. Connections are kept alive and reused per worker.

Why not aiohttp's client here: at 1,000 streams its request machinery (request object, headers,
connector, send) and its reading (``data_received``, ``StreamReader.readany``) were ~26% of the router's
samples (py-spy, router/README.md). A decode stream needs little of it: one POST with a JSON body, a
status, two framing headers and a chunked body read to its end. Everything else (prefill, non-streaming
requests, health probes) stays on aiohttp.

Timeouts: connecting (``connect_timeout_s``); the response head and the first token together
(``first_token_s`` given to :meth:`Client.post`, a single timer per request that the relay stops with
:meth:`Connection.stop_timer` once a token is in hand); between chunks the relay's watchdog
(:class:`~.relay.Watchdog`) calls :meth:`Connection.set_exception`. Errors are :class:`UpstreamError`
subclasses, raised by the read that meets them, after the bytes that came before.
"""

from __future__ import annotations

import asyncio
import json
import re
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

# a response head larger than this is not a worker's (vLLM's is ~150 bytes)
MAX_HEAD_BYTES = 65536
# a chunk-size line (hex digits and extensions) longer than this is not HTTP
MAX_CHUNK_LINE = 4096
# body bytes buffered for a relay that is waiting on a slow client: above this, stop reading the worker
# (TCP's window then slows it) until the relay takes them
PAUSE_ABOVE = 1 << 18
_HEX = re.compile(rb"[0-9A-Fa-f]{1,16}")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})\r\n")


class UpstreamError(Exception):
    """The worker could not be reached, or its response broke off or was not HTTP/1.1."""


class ConnectFailed(UpstreamError):
    """Nothing accepted the connection (refused, unreachable)."""


class ConnectTimeout(UpstreamError):
    """The connection was not set up within the connect timeout."""


class ReadTimeout(UpstreamError):
    """No response head or first token within the first-token timeout, or a stream cut for stalling."""


class Disconnected(UpstreamError):
    """The worker closed or reset the connection before its response ended."""


class ProtocolError(UpstreamError):
    """The response is not well-formed HTTP/1.1 (status line, headers, chunked framing)."""


@dataclass(frozen=True)
class Target:
    """A worker's address, parsed once: where to connect and what its requests start with."""
    host: str
    port: int
    tls: bool
    prefix: str          # a base URL's path, put before every endpoint
    host_header: bytes

    @classmethod
    def parse(cls, url: str) -> Target:
        from urllib.parse import urlsplit

        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) URL: {url}")
        tls = u.scheme == "https"
        port = u.port or (443 if tls else 80)
        return cls(u.hostname, port, tls, u.path.rstrip("/"), u.netloc.rsplit("@", 1)[-1].encode())

    def request(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> bytes:
        """``headers``: more header lines (a traced request's traceparent), names and values as given."""
        extra = b"".join(b"%s: %s\r\n" % (k.encode("latin-1"), v.encode("latin-1"))
                         for k, v in headers.items()) if headers else b""
        return (b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\n"
                b"%sContent-Length: %d\r\n\r\n%s" % ((self.prefix + path).encode(), self.host_header, extra, len(body),
                                                       body))


_ENCODER = msgspec.json.Encoder()


def dumps(body: dict) -> bytes:
    """A request body as compact JSON, in C (msgspec, already the router's KV-event decoder; it also
    writes integers beyond 64 bits, which a client's body may hold), or the standard library for
    anything it refuses."""
    try:
        return _ENCODER.encode(body)
    except (TypeError, msgspec.EncodeError):
        return json.dumps(body, separators=(",", ":")).encode()


_HEAD, _SIZE, _DATA, _DATA_END, _TRAILER, _LENGTH, _UNTIL_CLOSE, _DONE = range(8)


class Connection(asyncio.Protocol):
    """One connection to a worker, carrying one request at a time. After :meth:`Client.post` it is that
    request's response: ``status``, ``headers`` (lower-case names), the body through :meth:`read`."""

    def __init__(self, client: Client, target: Target) -> None:
        self._client, self.target = client, target
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._state = _HEAD
        self._raw = b""                    # bytes of the head or of a chunk-size line not yet complete
        self._need = 0                     # the current chunk's (or Content-Length body's) bytes still to come
        self._body: list[bytes] = []       # body bytes the relay has not read yet
        self._buffered = 0
        self._paused = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future | None = None
        self._head: asyncio.Future | None = None
        self._keep = False                 # the connection may carry another request once this one ends
        self._received = False             # any byte of this response came
        self._timer: asyncio.TimerHandle | None = None
        self._active = False               # a request was sent and its response is not released
        self._feed: Callable[[bytes], None] | None = None   # attach(): body reads pushed, not read

    # ------------------------------------------------------------------ asyncio.Protocol
    def connection_made(self, transport: asyncio.Transport) -> None:
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        if not self._active:               # bytes nobody asked for (an idle connection): not reusable
            self.close()
            return
        self._received = True
        if self._state == _HEAD:
            data = self._parse_head(data)
            if not data:
                return
        state = self._state
        if state == _SIZE and not self._raw:
            # the usual socket read: exactly one whole chunk (a worker writes one event a chunk)
            m = _CHUNK_SIZE.match(data)
            if m is not None:
                start = m.end()
                end = start + int(m.group(1), 16)
                if end > start and len(data) == end + 2 and data.endswith(b"\r\n"):
                    if self._feed is not None:
                        self._feed(data[start:end])
                        return
                    self._deliver(data[start:end])
                    if self._buffered > PAUSE_ABOVE and not self._paused:
                        self._paused = True
                        self._transport.pause_reading()
                    return
            self._unchunk(data)
        elif state in (_SIZE, _DATA, _DATA_END, _TRAILER):
            self._unchunk(data)
        elif state == _LENGTH:
            take = data[:self._need]
            self._need -= len(take)
            self._deliver(take)
            if len(data) > len(take):
                self._keep = False         # bytes after the body: nothing a reused connection can trust
            if not self._need:
                self._finish()
        elif state == _UNTIL_CLOSE:
            self._deliver(data)
        else:                              # unsolicited bytes between requests: not reusable
            self._keep = False
            if self._transport is not None:
                self._transport.close()

    def eof_received(self) -> bool:
        return False                       # close; connection_lost says what it meant

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        state = self._state
        if state == _DONE:
            return
        if state == _UNTIL_CLOSE and exc is None:
            self._finish()                 # a body delimited by the connection's end: complete
            return
        self._fail(Disconnected(
            f"the worker closed the connection {'before answering' if state == _HEAD else 'mid-response'}"
            + (f" ({exc})" if exc else "")))

    def pause_writing(self) -> None:      # a request body is small; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # ------------------------------------------------------------------ parsing
    def _parse_head(self, data: bytes) -> bytes:
        """Consumes the status line and headers; returns the body bytes that came with them."""
        raw = self._raw + data if self._raw else data
        end = raw.find(b"\r\n\r\n")
        if end < 0:
            if len(raw) > MAX_HEAD_BYTES:
                self._fail(ProtocolError("the response head is too large"))
            else:
                self._raw = raw
            return b""
        self._raw = b""
        lines = raw[:end].split(b"\r\n")
        version, _, rest = lines[0].partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit() or \
                rest[3:4] not in (b"", b" "):
            self._fail(ProtocolError(f"not an HTTP/1.1 status line: {lines[0][:80]!r}"))
            return b""
        self.status = int(code)
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip() or b" " in name:
                self._fail(ProtocolError(f"malformed response header: {line[:80]!r}"))
                return b""
            headers[name.decode("latin-1").lower()] = value.strip(b" \t").decode("latin-1")
        if 100 <= self.status < 200:
            self._fail(ProtocolError(f"unexpected informational response {self.status}"))
            return b""
        te, length = headers.get("transfer-encoding"), headers.get("content-length")
        self._keep = version == b"HTTP/1.1" and "close" not in headers.get("connection", "").lower()
        if te is not None:
            if te.lower() != "chunked":
                self._fail(ProtocolError(f"unsupported Transfer-Encoding: {te[:40]}"))
                return b""
            self._state = _SIZE
        elif self.status in (204, 304):
            self._state = _DONE
        elif length is not None:
            if not length.isdigit():
                self._fail(ProtocolError(f"bad Content-Length: {length[:40]}"))
                return b""
            self._need = int(length)
            self._state = _LENGTH if self._need else _DONE
        else:
            self._state = _UNTIL_CLOSE
            self._keep = False
        if self._head is not None and not self._head.done():
            self._head.set_result(None)
        body = raw[end + 4:]
        if self._state == _DONE:
            self._finish()
            if body:
                self._keep = False
            return b""
        return body

    def _unchunk(self, data: bytes) -> None:
        """The chunked body's framing off, strictly (RFC 9112 7.1): hex size, CRLF, data, CRLF; the
        last chunk (size 0), optional trailer fields, CRLF."""
        if self._raw:
            data, self._raw = self._raw + data, b""
        pos, n = 0, len(data)
        state = self._state
        while pos < n:
            if state == _DATA:
                take = min(self._need, n - pos)
                self._body.append(data[pos:pos + take] if take < n else data)
                self._buffered += take
                self._need -= take
                pos += take
                if not self._need:
                    state = _DATA_END
            elif state == _DATA_END:
                if n - pos < 2:
                    self._raw = data[pos:]
                    break
                if data[pos:pos + 2] != b"\r\n":
                    self._state = state
                    self._fail(ProtocolError("a chunk's data is not followed by CRLF"))
                    return
                pos += 2
                state = _SIZE
            else:                          # _SIZE or _TRAILER: a line
                eol = data.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > MAX_CHUNK_LINE:
                        self._state = state
                        self._fail(ProtocolError("a chunk-size or trailer line is too long"))
                        return
                    self._raw = data[pos:]
                    break
                line = data[pos:eol]
                pos = eol + 2
                if state == _TRAILER:
                    if line:
                        continue           # a trailer field: nothing the relay needs
                    self._state = state
                    self._finish()
                    if pos < n:
                        self._keep = False
                    break
                size = line.split(b";", 1)[0].rstrip(b" \t")
                if _HEX.fullmatch(size) is None:
                    self._state = state
                    self._fail(ProtocolError(f"bad chunk size line: {line[:40]!r}"))
                    return
                self._need = int(size, 16)
                state = _DATA if self._need else _TRAILER
        if self._state != _DONE:
            self._state = state
        self._push()
        if self._buffered > PAUSE_ABOVE and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()

    def _deliver(self, data: bytes) -> None:
        if data:
            self._body.append(data)
            self._buffered += len(data)
            self._push()

    def _push(self) -> None:
        """The body bytes of this read to the attached relay, or kept for :meth:`read`."""
        body = self._body
        if not body:
            return
        if self._feed is None:
            self._wake()
            return
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        self._feed(data)

    def _finish(self) -> None:
        self._state = _DONE
        self.stop_timer()
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        """The response cannot go on: ``exc`` for the next read (after what was read before), the
        connection closed."""
        self._keep = False
        self._feed = None
        if self._exc is None:
            self._exc = exc
        self.stop_timer()
        if self._head is not None and not self._head.done():
            self._head.set_exception(exc)
            self._head.exception()         # retrieved: a head never awaited is no "never retrieved" warning
        self._wake()
        if self._transport is not None:
            self._transport.close()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # ------------------------------------------------------------------ the response, for its reader
    async def read(self) -> bytes:
        """What the body has brought since the last read (whole socket reads, unframed); b"" once it
        ended; the error that broke it, once what came before it was read."""
        while True:
            body = self._body
            if body:
                data = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                self._buffered = 0
                if self._paused:
                    self._paused = False
                    if not self.closed:
                        self._transport.resume_reading()
                return data
            if self._exc is not None:
                raise self._exc
            if self._state == _DONE:
                return b""
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    # ------------------------------------------------------------------ the response, pushed
    def attach(self, feed: Callable[[bytes], None]) -> None:
        """From here each read of the body goes to ``feed`` in the protocol's own callback, not to
        :meth:`read`; the body must have been taken (:meth:`take`) first. The reader learns of the body's
        end and of errors by :meth:`wait`. ``feed`` must not raise; it calls :meth:`detach` (and
        :meth:`wake`) to stop, and then bytes are kept again, reading paused past PAUSE_ABOVE."""
        self._feed = feed
        if self._paused:
            self._paused = False
            if not self.closed:
                self._transport.resume_reading()

    def detach(self) -> None:
        self._feed = None

    def take(self) -> bytes:
        """The body bytes kept since the last read, without waiting; b"" when none."""
        body = self._body
        if not body:
            return b""
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._buffered = 0
        return data

    def raise_error(self) -> None:
        """Raises the error that broke the response, if one did."""
        if self._exc is not None:
            raise self._exc

    async def wait(self) -> None:
        """Until something changes for the reader: bytes kept, the body's end, an error, or :meth:`wake`."""
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def wake(self) -> None:
        self._wake()

    async def body(self, limit: int) -> bytes:
        """The body (an error response's), cut after ``limit`` bytes: the rest is never read, so the
        connection is then closed by :meth:`release`, not reused."""
        parts, size = [], 0
        while size < limit and (data := await self.read()):
            parts.append(data)
            size += len(data)
        return b"".join(parts)[:limit]

    def is_eof(self) -> bool:
        """The body ended and all of it was read."""
        return self._state == _DONE and not self._body

    async def wait_eof(self, timeout_s: float) -> bool:
        """Reads what is left of the body, at most ``timeout_s``; True when it ended cleanly."""
        try:
            async with asyncio.timeout(timeout_s):
                while await self.read():
                    pass
        except (UpstreamError, TimeoutError):
            return False
        return True

    def set_exception(self, exc: BaseException) -> None:
        """Breaks the response off (the watchdog's cut): the next read raises ``exc``."""
        self._fail(exc)

    def stop_timer(self) -> None:
        """The first-token timer is done with: a token came (or the response ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def release(self) -> None:
        """Done with the response: the connection goes back to its worker's pool when the body ended
        and both sides allow another request, else it is closed."""
        if self._state == _DONE and self._keep and not self._body and not self.closed:
            self._reset()
            self._client._put(self)
        else:
            self.close()

    def close(self) -> None:
        self.stop_timer()
        self._keep = False
        self._feed = None
        if self._transport is not None:
            self._transport.close()
        self.closed = True

    # ------------------------------------------------------------------ sending
    def _send(self, request: bytes, first_token_s: float | None) -> None:
        self._active = True
        self._head = self._loop.create_future()
        if first_token_s is not None:
            self._timer = self._loop.call_later(first_token_s, self._timed_out, first_token_s)
        self._transport.write(request)

    def _timed_out(self, after_s: float) -> None:
        self._timer = None
        self._fail(ReadTimeout(f"no token within {after_s:g} s"))


@dataclass
class Client:
    """The router's connections to its workers for streams: per worker, the idle ones kept up to
    ``keepalive_s`` (below the workers' own: uvicorn closes after 5 s) and reused newest first."""
    connect_timeout_s: float
    keepalive_s: float = 3.0
    _idle: dict[Target, list[Connection]] = field(default_factory=dict)
    # https:// workers: checked against this context's authorities (the router's worker_ca_file), else
    # the system's trust store
    ssl_context: ssl.SSLContext | None = None
    _swept: float = 0.0

    async def post(self, target: Target, path: str, body: bytes, first_token_s: float | None,
                   headers: dict[str, str] | None = None) -> Connection:
        """Sends the request (with ``headers`` besides its own, when given) and waits for the response
        head. A reused connection that the worker closed before answering (it timed the connection out as
        the request went) is replaced by a new one, once; nothing of the request was processed then."""
        request = target.request(path, body, headers)
        conn = self._take(target)
        reused = conn is not None
        if conn is None:
            conn = await self._connect(target)
        try:
            conn._send(request, first_token_s)
            try:
                await conn._head
            except Disconnected:
                if not reused or conn._received:
                    raise
                conn.close()
                conn = await self._connect(target)
                conn._send(request, first_token_s)
                await conn._head
        except BaseException:
            conn.close()
            raise
        return conn

    async def _connect(self, target: Target) -> Connection:
        loop = asyncio.get_running_loop()
        kw = {}
        if target.tls:
            if self.ssl_context is None:
                self.ssl_context = ssl.create_default_context()
            kw = {"ssl": self.ssl_context, "server_hostname": target.host}
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: Connection(self, target), target.host,
                                                       target.port, **kw)
        except TimeoutError:
            raise ConnectTimeout(f"connecting timed out ({self.connect_timeout_s:g} s)") from None
        except OSError as e:
            raise ConnectFailed(f"cannot connect to {target.host}:{target.port}: {e}") from e
        return conn

    def _take(self, target: Target) -> Connection | None:
        idle = self._idle.get(target)
        if not idle:
            return None
        too_old = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since > too_old:
                return conn
            conn.close()
        return None

    def _put(self, conn: Connection) -> None:
        now = conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.target, []).append(conn)
        if now - self._swept > self.keepalive_s:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Closes connections idle past the keep-alive (those of a worker no longer asked)."""
        self._swept = now
        for target, idle in list(self._idle.items()):
            keep = [c for c in idle if not c.closed and now - c.idle_since <= self.keepalive_s]
            for c in idle:
                if c.closed or now - c.idle_since > self.keepalive_s:
                    c.close()
            if keep:
                self._idle[target] = keep
            else:
                del self._idle[target]

    def forget(self, target: Target) -> None:
        """Closes the idle connections to a worker that left (discovery), now rather than at a sweep."""
        for c in self._idle.pop(target, ()):
            c.close()

    def close(self) -> None:
        for idle in self._idle.values():
            for c in idle:
                c.close()
        self._idle.clear()
