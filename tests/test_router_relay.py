"""The relay's flow control (router/relay.py over router/upstream.py): while the client's side cannot take
more (its transport full: the sink asks for a drain), the worker's bytes stay in the connection only up to
its bound, and reading from the worker pauses there; once the client drains, the stream goes on to its
end, every event once, in order."""

from __future__ import annotations

import asyncio
import time

from disagg.api import metrics as m
from disagg.router import upstream
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
