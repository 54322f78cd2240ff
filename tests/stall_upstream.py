"""An OpenAI-shaped upstream that misbehaves on purpose, for the router's timeout and admission tests.

The prompt says what it does (real HTTP, real sockets: the router cannot tell it from a worker):
- ``stall-mid``: two tokens, then silence with the connection open (a worker hung mid-stream);
- ``stall-first``: the response headers, then silence (a worker that never produces a token);
- ``slow N``: N tokens, one every 0.4 s, then [DONE] (a long but healthy stream);
- ``cut-mid-event``: two tokens, half of a third event, then the connection closes (a worker killed while
  writing);
- anything else: two tokens and [DONE], after the gate opens (POST /gate/open; GET /gate/waiting says
  how many requests wait at it).
A non-streaming request never gets an answer.
Run: python stall_upstream.py PORT
"""

import asyncio
import json
import sys

from aiohttp import web

gate = asyncio.Event()
waiting = 0


def chunk(i: int) -> bytes:
    body = {"id": f"s-{i}", "object": "text_completion", "model": "tiny",
            "choices": [{"index": 0, "text": "tok ", "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def generate(request: web.Request) -> web.StreamResponse:
    global waiting
    body = await request.json()
    if not body.get("stream"):
        await asyncio.sleep(3600)
    prompt = body.get("prompt") if isinstance(body.get("prompt"), str) else ""
    if not prompt.startswith(("stall", "slow", "cut")):
        waiting += 1
        try:
            await gate.wait()
        finally:
            waiting -= 1
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    if prompt.startswith("stall-first"):
        await asyncio.sleep(3600)
    n, pause = (int(prompt.split()[1]), 0.4) if prompt.startswith("slow") else (2, 0)
    for i in range(n):
        await asyncio.sleep(pause)
        await resp.write(chunk(i))
    if prompt.startswith("cut-mid-event"):
        await resp.write(b'data: {"id": "s-2", "object": "text_completion", "choi')
        request.transport.close()         # no rest of the event, no [DONE], no end of the chunked body
        await asyncio.sleep(3600)
    if prompt.startswith("stall-mid"):
        await asyncio.sleep(3600)
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def open_gate(request: web.Request) -> web.Response:
    gate.set()
    return web.Response(text="open")


async def gate_waiting(request: web.Request) -> web.Response:
    return web.json_response({"waiting": waiting})


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


app = web.Application()
app.router.add_post("/v1/completions", generate)
app.router.add_post("/gate/open", open_gate)
app.router.add_get("/gate/waiting", gate_waiting)
app.router.add_get("/health", health)
# It stalls on purpose; its teardown must not (aiohttp waits 60 s for handlers, stop_all 20 s).
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None, shutdown_timeout=1)
