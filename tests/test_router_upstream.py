"""The router's stream client (router/upstream.py) against real loopback servers that answer with scripted
bytes: strict chunked framing however the bytes are split, errors after the bytes that came before them
(bad framing, a worker closing mid-chunk), the first-token timer and the watchdog's cut, connections kept
alive and reused, a stale pooled connection replaced, and a connect to nothing."""

from __future__ import annotations

import asyncio

import pytest

from disagg.router import upstream
from disagg.router.upstream import Client, Target

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"bc"}]}\n\n', b"data: [DONE]\n\n"]


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in parts)


class Scripted:
    """A loopback HTTP server: reads each request (head and Content-Length body), then plays ``script``
    (a list of byte strings, written with a pause between them so that they tend to arrive in separate
    reads; a None closes the connection). Counts connections and requests."""

    def __init__(self, script: list[bytes | None], pause_s: float = 0.002, keep: bool = True):
        self.script, self.pause_s, self.keep = script, pause_s, keep
        self.connections = self.requests = 0
        self.bodies: list[bytes] = []
        self.tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> Scripted:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        self.target = Target.parse(f"http://127.0.0.1:{self.port}")
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.tasks.add(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length:"))
                self.bodies.append(await reader.readexactly(length))
                self.requests += 1
                for part in self.script:
                    if part is None:
                        writer.close()
                        return
                    writer.write(part)
                    await writer.drain()
                    await asyncio.sleep(self.pause_s)
                if not self.keep:
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()


async def _read_all(conn: upstream.Connection) -> tuple[bytes, BaseException | None]:
    got = b""
    try:
        while data := await conn.read():
            got += data
    except upstream.UpstreamError as e:
        return got, e
    return got, None


def test_a_chunked_body_arrives_whole_however_it_is_split():
    body = chunked(*EVENTS)
    # chunk extensions and a trailer field are legal and carry nothing the relay needs
    body = body.replace(b"%x\r\n" % len(EVENTS[0]), b"%x;ext=1\r\n" % len(EVENTS[0]), 1)
    wire = HEAD + body + b"0\r\nX-Trailer: 1\r\n\r\n"

    splits = [[wire[i:i + step] for i in range(0, len(wire), step)]    # byte by byte, odd splits, all at once
              for step in (1, 3, 7, len(wire))]
    # and as a worker writes: the head, then one chunk a write (the client's fast path: one whole chunk a read)
    splits.append([HEAD, *(chunked(e) for e in EVENTS), b"0\r\n\r\n"])

    async def main():
        for step, script in enumerate(splits):
            async with Scripted(script, pause_s=0 if step < 4 else 0.002) as s:
                client = Client(connect_timeout_s=2)
                conn = await client.post(s.target, "/v1/completions", b'{"x":1}', 5)
                assert conn.status == 200 and conn.headers["content-type"] == "text/event-stream"
                got, err = await _read_all(conn)
                assert err is None and got == b"".join(EVENTS), (step, got)
                assert conn.is_eof()
                assert s.bodies == [b'{"x":1}']
                conn.release()
                client.close()

    asyncio.run(main())


@pytest.mark.parametrize("bad, good, error", [
    (b"zz\r\n", b"", "bad chunk size"),
    (b"5\r\nhelloXX", b"hello", "not followed by CRLF"),      # the chunk's data is good; what follows is not
    (b"1" * (upstream.MAX_CHUNK_LINE + 10), b"", "too long"),
], ids=["size-not-hex", "data-without-crlf", "endless-size-line"])
def test_malformed_framing_is_an_error_after_the_good_bytes(bad, good, error):
    async def main():
        async with Scripted([HEAD + chunked(EVENTS[0]), bad]) as s:
            client = Client(connect_timeout_s=2)
            conn = await client.post(s.target, "/v1/completions", b"{}", 5)
            got, err = await _read_all(conn)
            assert got == EVENTS[0] + good and isinstance(err, upstream.ProtocolError) and error in str(err), \
                (got, err)
            conn.release()                     # broken: closed, never pooled
            assert conn.closed and client._take(s.target) is None

    asyncio.run(main())


def test_a_worker_closing_mid_chunk_is_an_error_after_what_it_sent():
    async def main():
        # a chunk of 100 bytes announced, 40 sent, then the connection closes (a worker killed mid-event)
        async with Scripted([HEAD + chunked(EVENTS[0]) + b"64\r\n" + b"d" * 40, None]) as s:
            conn = await Client(connect_timeout_s=2).post(s.target, "/v1/completions", b"{}", 5)
            got, err = await _read_all(conn)
            assert got == EVENTS[0] + b"d" * 40 and isinstance(err, upstream.Disconnected), (got, err)

    asyncio.run(main())


def test_the_first_token_timer_and_the_watchdogs_cut():
    async def main():
        # no answer at all: the head does not come within the first-token timeout
        async with Scripted([]) as s:
            with pytest.raises(upstream.ReadTimeout):
                await Client(connect_timeout_s=2).post(s.target, "/v1/completions", b"{}", 0.2)
        # the head, then silence: the read that waits for the first token times out
        async with Scripted([HEAD]) as s:
            conn = await Client(connect_timeout_s=2).post(s.target, "/v1/completions", b"{}", 0.2)
            got, err = await _read_all(conn)
            assert got == b"" and isinstance(err, upstream.ReadTimeout)
        # a token, the timer stopped (as the relay does), then silence: only the watchdog's cut ends the read
        async with Scripted([HEAD + chunked(EVENTS[0])]) as s:
            conn = await Client(connect_timeout_s=2).post(s.target, "/v1/completions", b"{}", 0.2)
            assert await conn.read() == EVENTS[0]
            conn.stop_timer()
            reading = asyncio.ensure_future(conn.read())
            await asyncio.sleep(0.4)           # past the first-token timeout: nothing happened
            assert not reading.done()
            conn.set_exception(upstream.ReadTimeout("stalled"))
            with pytest.raises(upstream.ReadTimeout, match="stalled"):
                await reading
            assert conn.closed

    asyncio.run(main())


def test_connections_are_kept_alive_and_reused():
    async def main():
        client = Client(connect_timeout_s=2)
        async with Scripted([HEAD + chunked(*EVENTS) + b"0\r\n\r\n"]) as s:
            for _ in range(3):
                conn = await client.post(s.target, "/v1/completions", b"{}", 5)
                assert (await _read_all(conn)) == (b"".join(EVENTS), None)
                conn.release()
            assert (s.connections, s.requests) == (1, 3)
        # a worker that closes each connection after its response (without saying so): the pooled
        # connection is found closed, or closes as the request goes; a new one serves, the caller sees nothing
        client = Client(connect_timeout_s=2)
        async with Scripted([HEAD + chunked(*EVENTS) + b"0\r\n\r\n"], keep=False) as s:
            for _ in range(3):
                conn = await client.post(s.target, "/v1/completions", b"{}", 5)
                assert (await _read_all(conn)) == (b"".join(EVENTS), None)
                conn.release()
            assert (s.connections, s.requests) == (3, 3)
        # Connection: close, and a body read only in part: never pooled
        head = HEAD.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n")
        async with Scripted([head + chunked(*EVENTS) + b"0\r\n\r\n"]) as s:
            conn = await client.post(s.target, "/v1/completions", b"{}", 5)
            await _read_all(conn)
            conn.release()
            assert conn.closed and client._take(s.target) is None

    asyncio.run(main())


def test_a_content_length_body_and_an_error_status():
    async def main():
        err = b'{"error":{"message":"too long"}}'
        answer = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%b" % (len(err), err)
        async with Scripted([answer[:20], answer[20:]]) as s:
            client = Client(connect_timeout_s=2)
            conn = await client.post(s.target, "/v1/completions", b"{}", 5)
            assert conn.status == 400 and await conn.body(1024) == err
            conn.release()
            assert client._take(s.target) is conn     # ended cleanly: pooled

    asyncio.run(main())


def test_an_error_body_is_read_up_to_its_bound_and_the_connection_not_reused():
    async def main():
        err = b'{"error":{"message":"' + b"x" * 100_000 + b'"}}'
        head = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n" % len(err)
        # the body in pieces: the read stops at the bound, long before the body's end
        async with Scripted([head] + [err[i:i + 1000] for i in range(0, len(err), 1000)]) as s:
            client = Client(connect_timeout_s=2)
            conn = await client.post(s.target, "/v1/completions", b"{}", 5)
            assert await conn.body(1024) == err[:1024]
            conn.release()                  # the rest unread: closed, never pooled mid-body
            assert conn.closed and client._take(s.target) is None

    asyncio.run(main())


def test_nothing_listening_is_a_connect_failure():
    async def main():
        async with Scripted([]) as s:
            target = s.target
        with pytest.raises(upstream.ConnectFailed):
            await Client(connect_timeout_s=2).post(target, "/v1/completions", b"{}", 5)

    asyncio.run(main())
