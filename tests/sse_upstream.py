"""A minimal OpenAI-compatible upstream that streams canned tokens, for the router's load test.

Why not vLLM there: the load test measures the router holding 1,000 concurrent streams; the CPU
vLLM on this machine's two cores would make it a test of vLLM's batch size and speed instead.
It speaks the same wire format as vLLM (SSE `data:` events, a usage-only chunk, `[DONE]`).
Run: python sse_upstream.py PORT TOKENS DELAY_S
"""

import asyncio
import json
import sys
import time

from aiohttp import web

TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 8
DELAY = float(sys.argv[3]) if len(sys.argv) > 3 else 0.01


def chunk(i: int, chat: bool, text: str | None, finish: str | None = None) -> bytes:
    choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
              else {"index": 0, "text": text, "finish_reason": finish})
    body = {"id": f"x-{i}", "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": "tiny", "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    chat = request.path.endswith("/chat/completions")
    n = min(body.get("max_tokens") or TOKENS, TOKENS)
    if not body.get("stream"):
        await asyncio.sleep(DELAY * n)  # an engine generates the same tokens before it answers
        return web.json_response({"id": "x", "object": "text_completion", "model": "tiny",
                                  "choices": [{"index": 0, "text": "tok " * n, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(n):
        await asyncio.sleep(DELAY)
        await resp.write(chunk(i, chat, "tok ", "length" if i == n - 1 else None))
    usage = {"id": "x", "object": "text_completion", "model": "tiny", "choices": [],
             "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


app = web.Application()
app.router.add_post("/v1/completions", generate)
app.router.add_post("/v1/chat/completions", generate)
app.router.add_get("/health", health)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None, backlog=2048)
