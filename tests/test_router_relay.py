"""The relay's flow control (router/relay.py over router/upstream.py): while the client's side cannot take
more (its transport full: the sink asks for a drain), the worker's bytes stay in the connection only up to
its bound, and reading from the worker pauses there; once the client drains, the stream goes on to its
end, every event once, in order."""

from __future__ import annotations

import asyncio
import time

from disagg.api import metrics as m
from disagg.router import upstream
from disagg.router import relay as relay_module
from disagg.router.relay import StreamEnd, first_token, relay
from disagg.router.upstream import Client, Target

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
EVENTS = 40_000                            # ~1.5 MB: several times the connection's bound


def _event(i: int) -> bytes:
    return b'data: {"choices":[{"index":0,"text":"%d "}]}\n\n' % i


class HeldSink:
    """A client that takes nothing until ``gate`` opens: every write asks for a drain, and the drains
    wait for the gate."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.got: list[bytes] = []
        self.drains = 0

    def write(self, data: bytes) -> bool:
        self.got.append(data)
        return True

    async def drain(self) -> None:
        self.drains += 1
        await self.gate.wait()


async def _worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)
    writer.write(HEAD)
    for i in range(EVENTS):               # one chunk an event, as vLLM's server writes them
        e = _event(i)
        writer.write(b"%x\r\n%b\r\n" % (len(e), e))
    done = b"data: [DONE]\n\n"
    writer.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
    try:
        await writer.drain()               # waits on the router's reading: paused, TCP's window fills
        await reader.read()               # until the router closes
    except ConnectionError:
        pass
    writer.close()


def test_a_held_client_bounds_what_the_connection_keeps_and_pauses_the_worker():
    async def main():
        server = await asyncio.start_server(_worker, "127.0.0.1", 0)
        client = Client(connect_timeout_s=10)
        try:
            target = Target.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
            conn = await client.post(target, "/v1/completions", b"{}", 10)
            head, head_error = await first_token(conn, "w")
            sink, end = HeldSink(), StreamEnd(last_activity=time.monotonic(), resp=conn)
            task = asyncio.create_task(relay(conn, "w", end, sink, start=time.monotonic(), client_wants_usage=False,
                                             observe_ttft=lambda _: None, observe_itl=lambda _: None,
                                             first_token_timeout_s=10, idle_timeout_s=10, head=head,
                                             head_error=head_error))
            async with asyncio.timeout(60):
                while not conn._paused:          # the worker's bytes pile up until the connection pauses
                    await asyncio.sleep(0.01)
            kept = conn._buffered
            # at most the bound and the one socket read that crossed it (256 KiB reads, asyncio and uvloop)
            assert kept <= upstream.PAUSE_ABOVE + 256 * 1024, kept
            assert not task.done() and sink.drains == 1
            sink.gate.set()
            async with asyncio.timeout(60):
                await task
            return end, b"".join(sink.got)
        finally:
            client.close()
            server.close()

    end, out = asyncio.run(main())
    assert end.outcome == m.OUTCOME_SUCCESS and end.error is None
    assert out == b"".join(_event(i) for i in range(EVENTS)) + b"data: [DONE]\n\n"


def _endless(first: bytes):
    """A broken worker: ``first``, then an event that never ends (3 MiB with no blank line), then nothing
    until the router closes."""
    async def worker(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)
        writer.write(HEAD)
        chunks = [first] if first else []
        chunks += [b'data: {"choices":[{"index":0,"text":"' + b"x" * 65536] + [b"x" * 65536] * 48
        try:
            for c in chunks:
                writer.write(b"%x\r\n%b\r\n" % (len(c), c))
                await writer.drain()
            await reader.read()
        except ConnectionError:
            pass
        writer.close()
    return worker


def _relay_endless(first: bytes) -> tuple[StreamEnd, bytes, BaseException | None]:
    async def main():
        server = await asyncio.start_server(_endless(first), "127.0.0.1", 0)
        client = Client(connect_timeout_s=10)
        try:
            target = Target.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
            conn = await client.post(target, "/v1/completions", b"{}", 10)
            head, head_error = await first_token(conn, "w")
            sink, end = HeldSink(), StreamEnd(last_activity=time.monotonic(), resp=conn)
            sink.gate.set()
            async with asyncio.timeout(60):
                await relay(conn, "w", end, sink, start=time.monotonic(), client_wants_usage=False,
                            observe_ttft=lambda _: None, observe_itl=lambda _: None, first_token_timeout_s=10,
                            idle_timeout_s=10, head=head, head_error=head_error)
            return end, b"".join(sink.got), head_error
        finally:
            client.close()
            server.close()
    return asyncio.run(main())


def test_a_worker_that_never_completes_its_first_event_is_cut_at_the_bound():
    """Before the first token: what the worker sent is kept only up to MAX_EVENT_BYTES (it was unbounded),
    then the stream fails as a broken worker's does, and the client got none of it."""
    end, out, head_error = _relay_endless(b"")
    assert head_error is not None and "no token event" in str(head_error)
    assert end.outcome != m.OUTCOME_SUCCESS and "failed mid-stream" in end.error and out == b""


def test_an_event_that_never_ends_mid_stream_is_cut_at_the_bound():
    """After a token went out: an incomplete event grows only to MAX_EVENT_BYTES, then the stream fails with
    the router's error event; the client has its token and that error, never the endless bytes."""
    first = _event(0)
    end, out, head_error = _relay_endless(first)
    assert head_error is None
    assert end.outcome != m.OUTCOME_SUCCESS
    assert end.error == f"the decode worker w sent an event of more than {relay_module.MAX_EVENT_BYTES} bytes"
    assert out == first and end.failure.startswith(b'data: {"error"')
