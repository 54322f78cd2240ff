"""A decode worker behind HTTPS, its certificate self-signed (made here with ``cryptography``): the router
trusts it through its ``worker_ca_file`` (``--worker-ca-file``), for the decode stream (its own HTTP/1.1
client, router/upstream.py) and for what goes on aiohttp's client (health probes, a non-streaming
request); without that file the same worker's certificate is refused."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from disagg.router import upstream
from disagg.router.app import make_app
from disagg.router.config import RouterConfig
from disagg.router.metrics import RouterMetrics
from disagg.router.service import Router
from disagg.router.tokenizer import Tokenizer

TOKENS = 5


def _self_signed(tmp_path) -> tuple[str, str]:
    """(certificate, key) PEM files for 127.0.0.1, the certificate its own issuer."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "disagg test worker")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = tmp_path / "worker.crt", tmp_path / "worker.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_file), str(key_file)


def _worker_app() -> web.Application:
    """An OpenAI-shaped worker: /health, its model card, and completions streamed (chunked SSE) or not."""
    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model",
                                                              "max_model_len": 4096}]})

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        chunk = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "tiny"}
        if not body.get("stream"):
            return web.json_response({**chunk, "choices": [{"index": 0, "text": "tok " * TOKENS,
                                                             "finish_reason": "length"}],
                                      "usage": {"prompt_tokens": 1, "completion_tokens": TOKENS,
                                                "total_tokens": TOKENS + 1}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(TOKENS):
            choice = {"index": 0, "text": "tok ", "finish_reason": "length" if i == TOKENS - 1 else None}
            await resp.write(b"data: %s\n\n" % json.dumps({**chunk, "choices": [choice]}).encode())
        usage = {"prompt_tokens": 1, "completion_tokens": TOKENS, "total_tokens": TOKENS + 1}
        await resp.write(b"data: %s\n\n" % json.dumps({**chunk, "choices": [], "usage": usage}).encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


async def _https_worker(cert: str, key: str) -> tuple[web.AppRunner, str]:
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    runner = web.AppRunner(_worker_app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return runner, f"https://127.0.0.1:{port}"


async def _complete(session: aiohttp.ClientSession, base: str, stream: bool) -> tuple[int, str]:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": TOKENS, "stream": stream}
    async with session.post(f"{base}/v1/completions", json=body) as r:
        return r.status, await r.text()


def test_a_worker_behind_https_is_trusted_through_the_routers_ca_file(tiny_model, tmp_path):
    cert, key = _self_signed(tmp_path)

    async def main():
        worker, url = await _https_worker(cert, key)
        config = RouterConfig(model="tiny", tokenizer=tiny_model, block_size=16, health_interval_s=0.2,
                              worker_ca_file=cert, decode=[{"url": url}])
        router = Router(config, Tokenizer(tiny_model), RouterMetrics())
        server = TestServer(make_app(config, router=router), host="127.0.0.1")
        await server.start_server()
        base = str(server.make_url("")).rstrip("/")
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                streamed = await _complete(s, base, stream=True)
                unary = await _complete(s, base, stream=False)
            # the context length comes from the worker's /v1/models, asked on aiohttp's client once a
            # health probe (aiohttp's too) found the worker serving
            deadline = asyncio.get_running_loop().time() + 30
            while router.max_model_len is None and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            learned = router.max_model_len
            # the system's trust store alone does not know the certificate: the CA file is what admitted it
            bare = upstream.Client(connect_timeout_s=10)
            try:
                with pytest.raises(upstream.ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
                    await bare.post(upstream.Target.parse(url), "/v1/completions", b"{}", 10)
            finally:
                bare.close()
            return streamed, unary, learned
        finally:
            await server.close()
            await worker.cleanup()

    (status, text), (unary_status, unary_text), learned = asyncio.run(main())
    assert status == 200, text
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) == TOKENS + 1, events
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "tok " * TOKENS
    assert unary_status == 200 and json.loads(unary_text)["choices"][0]["text"] == "tok " * TOKENS
    assert learned == 4096, "the health probe and the model card (aiohttp's client) trust the worker too"
