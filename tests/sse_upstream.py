"""A minimal OpenAI-compatible upstream that streams canned tokens, for the router's load test.

Why not vLLM there: the load test measures the router holding 1,000 concurrent streams; the CPU
vLLM on this machine's two cores would make it a test of vLLM's batch size and speed instead.
It speaks the same wire format as vLLM (SSE `data:` events, a usage-only chunk, `[DONE]`), token ids
included when asked (`return_token_ids`, vLLM's: the prompt's in the first chunk, each chunk's new ones).
Run: python sse_upstream.py PORT TOKENS DELAY_S [CUT_AFTER [first|all]]
CUT_AFTER > 0: a stream is cut (connection closed, no [DONE]) after that many tokens, as a worker dying
mid-stream; `first` (default) cuts only requests whose prompt is text (a router's continuation of a cut
stream sends token ids, and is served in full), `all` cuts every stream.
As a prefill (a request with kv_transfer_params do_remote_decode) it answers with kv_transfer_params;
SSE_EXIT_AFTER_PREFILL=1: the process then dies (a prefill lost after it answered). SSE_KV_WAIT=1: a
request handed remote KV gets nothing (streamed: the headers, no event), as a decode waiting for KV from a
hung prefill; without KV it serves. Either set to `continuation` applies only to requests whose prompt is
token ids (a router's continuation of a cut stream). SSE_END_DELAY=S: the chunked body ends S seconds after [DONE].
GET /stats: how many connections streams came on, and how many prefills, decodes with a prefill's KV and
decodes without it were served; and the W3C traceparent headers the last requests came with, by kind
(prefill, decode), for the router's trace propagation.
"""

import asyncio
import itertools
import os
import json
import sys
import time

from aiohttp import web

TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 8
DELAY = float(sys.argv[3]) if len(sys.argv) > 3 else 0.01
CUT_AFTER = int(sys.argv[4]) if len(sys.argv) > 4 else 0
CUT_ALL = len(sys.argv) > 5 and sys.argv[5] == "all"
# every "tok " is this id (a router decodes ids with its model's tokenizer: tests pass one whose text is whole)
TOKEN_ID = int(os.environ.get("SSE_TOKEN_ID", "100"))
STREAMS = itertools.count()
# seconds between [DONE] and the end of the chunked body (uvicorn, under vLLM, writes them apart too)
END_DELAY = float(os.environ.get("SSE_END_DELAY", "0"))
# the client ends (host, port) of the connections streams came on: GET /stats says how many there were
# (a router that pools its connections to workers sends many streams on one)
STREAM_PEERS: set = set()
# requests by kind: prefills answered, and decodes that came with a prefill's KV (GET /stats)
SERVED = {"prefills": 0, "remote_kv_decodes": 0, "local_decodes": 0}
# the traceparent headers requests came with (None: none), the last 100 of each kind (GET /stats)
TRACEPARENTS: dict[str, list] = {"prefill": [], "decode": []}


def chunk(i: int, chat: bool, text: str | None, finish: str | None = None, ids: bool = False,
          prompt: list[int] | None = None, sid: str = "x") -> bytes:
    choice = ({"index": 0, "delta": {"content": text}, "finish_reason": finish} if chat
              else {"index": 0, "text": text, "finish_reason": finish})
    body = {"id": sid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": "tiny", "choices": [choice]}
    if ids:             # where vLLM puts them, written as compactly as vLLM writes its chunks
        (body if chat else choice)["prompt_token_ids"] = prompt if i == 0 else None
        choice["token_ids"] = [TOKEN_ID]
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def _applies(setting: str | None, continuation: bool) -> bool:
    return setting == "1" or (setting == "continuation" and continuation)


async def generate(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    chat = request.path.endswith("/chat/completions")
    kv = body.get("kv_transfer_params") or {}
    continuation = isinstance(body.get("prompt"), list)
    seen = TRACEPARENTS["prefill" if kv.get("do_remote_decode") else "decode"]
    seen.append(request.headers.get("traceparent"))
    del seen[:-100]
    if not kv.get("do_remote_decode"):
        SERVED["remote_kv_decodes" if kv.get("remote_engine_id") else "local_decodes"] += 1
    if kv.get("do_remote_decode"):
        SERVED["prefills"] += 1
        if _applies(os.environ.get("SSE_EXIT_AFTER_PREFILL"), continuation):
            asyncio.get_running_loop().call_later(0.2, os._exit, 0)
        return web.json_response({"id": "p", "object": "text_completion", "model": "tiny",
                                  "choices": [{"index": 0, "text": "tok ", "finish_reason": "length"}],
                                  "kv_transfer_params": {"remote_engine_id": "sse", "remote_block_ids": [0]}})
    if kv.get("remote_engine_id") and _applies(os.environ.get("SSE_KV_WAIT"), continuation):
        if body.get("stream"):
            wait = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await wait.prepare(request)    # headers at once, as vLLM's stream; no token
        await asyncio.sleep(3600)          # not streamed: no answer at all, as vLLM's
    n = min(body.get("max_tokens") or TOKENS, TOKENS)
    if not body.get("stream"):
        await asyncio.sleep(DELAY * n)  # an engine generates the same tokens before it answers
        return web.json_response({"id": "x", "object": "text_completion", "model": "tiny",
                                  "choices": [{"index": 0, "text": "tok " * n, "finish_reason": "length"}],
                                  "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}})
    STREAM_PEERS.add(request.transport.get_extra_info("peername"))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    ids = body.get("return_token_ids") is True
    prompt = body["prompt"] if continuation else [1, 2, 3]
    sid = f"x-{next(STREAMS)}"         # one id per stream, as vLLM's
    cut = CUT_AFTER if CUT_AFTER and (CUT_ALL or not continuation) else None
    for i in range(n):
        if i == cut:
            request.transport.close()      # dies mid-stream: no [DONE], no usage
            return resp
        await asyncio.sleep(DELAY)
        await resp.write(chunk(i, chat, "tok ", "length" if i == n - 1 else None, ids, prompt, sid))
    usage = {"id": "x", "object": "text_completion", "model": "tiny", "choices": [],
             "usage": {"prompt_tokens": len(prompt), "completion_tokens": n, "total_tokens": n + len(prompt)}}
    await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
    if END_DELAY:
        await asyncio.sleep(END_DELAY)
    await resp.write_eof()
    return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def stats(request: web.Request) -> web.Response:
    return web.json_response({"stream_connections": len(STREAM_PEERS), **SERVED, "traceparents": TRACEPARENTS})


app = web.Application()
app.router.add_post("/v1/completions", generate)
app.router.add_post("/v1/chat/completions", generate)
app.router.add_get("/health", health)
app.router.add_get("/stats", stats)
# A stand-in holding a request for ever (SSE_KV_WAIT) must not hold the teardown: stop_all waits
# 20 s for a SIGTERMed process, aiohttp would wait 60 s for its handlers.
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None, backlog=2048,
            shutdown_timeout=1)
