"""How the router writes a stream to its client (router/app.py ``_send``: the first chunk through aiohttp,
the rest framed by the router and written to the transport): an HTTP/1.0 client gets the events unframed,
a client that reads slowly gets every event, and a client that goes away mid-stream ends the relay (its
request leaves the router; the worker's stream is closed, and it is counted as client_disconnected) instead of
the router writing on into nothing."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import pytest

from disagg.api import metrics as m
from disagg.e2e.testing import wait_for
from disagg.workers.local import scrape

# an upstream whose streams last as long as max_tokens asks (up to a million tokens, 1 ms apart)
UPSTREAM_TOKENS, UPSTREAM_DELAY_S = 1_000_000, 0.001


@pytest.fixture(scope="module")
def served(routers, tiny_model, tmp_path_factory):
    logs = tmp_path_factory.mktemp("client-writes")
    upstream = routers.upstream(logs, "writes-upstream", UPSTREAM_TOKENS, UPSTREAM_DELAY_S)
    # a context far above the streams asked for here, so the router passes a million-token request on
    with routers.serving(tiny_model, logs, [upstream], name="router-writes", max_model_len=2 * UPSTREAM_TOKENS) as r:
        yield r


def _request(version: str, tokens: int) -> bytes:
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": tokens, "stream": True}).encode()
    return (f"POST /v1/completions HTTP/{version}\r\nHost: router\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def _dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body decoded, strictly: every size line, every CRLF, the terminator."""
    out, pos = [], 0
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol], 16)
        start = eol + 2
        assert body[start + size:start + size + 2] == b"\r\n", "a chunk's data is not followed by CRLF"
        if size == 0:
            assert start + 2 == len(body), "bytes after the terminator"
            return b"".join(out)
        out.append(body[start:start + size])
        pos = start + size + 2


def _token_events(payload: bytes) -> list[bytes]:
    events = [e for e in payload.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]", events[-3:]
    return [e for e in events[:-1] if b'"choices":[]' not in e and b'"choices": []' not in e]


async def _exchange(url: str, request: bytes, rcvbuf: int | None = None, read_size: int = 65536) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf:                # set before connecting: the window the router may fill is small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    writer.write(request)
    buf = bytearray()
    async with asyncio.timeout(120):
        while True:
            data = await reader.read(read_size)
            if not data:                  # HTTP/1.0: the response ends with the connection
                break
            buf += data
            if b"\r\n\r\n" in buf and not buf.startswith((b"HTTP/1.1 200 ", b"HTTP/1.0 200 ")):
                break                     # refused: the test fails on the status, not on a timeout
            # HTTP/1.1: it ends with the chunked terminator (the connection stays open)
            if buf.endswith(b"\r\n0\r\n\r\n") and b"chunked" in buf[:buf.find(b"\r\n\r\n")].lower():
                break
    writer.close()
    return bytes(buf)


def test_an_http10_client_gets_the_events_unframed(served):
    raw = asyncio.run(_exchange(served.url, _request("1.0", 20)))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b" 200 " in head.split(b"\r\n")[0], head
    assert b"transfer-encoding" not in head.lower()
    assert len(_token_events(body)) == 20


def test_a_slow_reader_gets_every_event_framed(served):
    # 2,000 events (~400 KB) into a 4 KiB receive window read 1 KiB at a time: the router's writes back up
    raw = asyncio.run(_exchange(served.url, _request("1.1", 2000), rcvbuf=4096, read_size=1024))
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    assert len(_token_events(_dechunk(body))) == 2000


def test_a_client_gone_mid_stream_ends_the_relay(served):
    async def main():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            r = await s.post(f"{served.url}/v1/completions",
                             json={"model": "tiny", "prompt": "hello", "max_tokens": UPSTREAM_TOKENS, "stream": True})
            assert r.status == 200
            got = b""
            while got.count(b"\n\n") < 5:          # the stream is flowing
                got += await r.content.readany()
            r.close()                               # the client goes away, its connection closed
    asyncio.run(main())
    # the relay stops at its next write, the request leaves the router; had it written on into the closed
    # connection, it would stay in flight for the upstream's million tokens (~17 minutes)
    wait_for(lambda: scrape(served.url).get(m.ROUTER_IN_FLIGHT) == 0, 60, "the request to leave the router")
    # counted as the client's doing, not the worker's (the only request of this module not served in full)
    s = scrape(served.url)
    def outcome(name: str) -> str:
        return f'{m.ROUTER_REQUESTS}{{outcome="{name}",path="{m.PATH_LOCAL_PREFILL}"}}'
    assert s.get(outcome(m.OUTCOME_CLIENT_DISCONNECTED)) == 1, s
    assert s.get(outcome(m.OUTCOME_UPSTREAM_ERROR), 0) == 0, s
    assert "unhandled error" not in served.log_path.read_text(errors="replace")
