"""A request under way keeps its KV revision: a stream whose decode dies mid-way is continued on a decode of
the revision it started on (its token ids are that model's), never on another revision's, and when none is
left it ends with an error that says so; a decode retried before its first token likewise. During a rollout
that changes the model or its tokenizer, another revision's worker would read the old model's ids as its
own and its text would be spliced into the same stream.

The two revisions are two real upstream processes (tests/sse_upstream.py) that the router's configuration
labels with different KV revisions, as discovery labels pods of a rollout's old and new revision; the newer
generation is the one new requests go to (pairing.py), so the streams below start on the old revision only
where that is the one left serving."""

from __future__ import annotations

import json
import signal
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest
from openai import OpenAI

from disagg.api import metrics as m
from disagg.workers.local import free_port, router, scrape, stop_all

TOKENS, CUT = 20, 5


def _stream_connections(url: str) -> int:
    with urllib.request.urlopen(f"{url}/stats", timeout=10) as r:
        return json.loads(r.read())["stream_connections"]


@contextmanager
def _two_revisions(routers, tiny_model: str, logs: Path, *old_args):
    """A router over an old-revision decode (generation 2: newest, so new requests start there) started
    with ``old_args``, and a new-revision one (generation 1) that must never see those requests' tokens."""
    from disagg.router.tokenizer import Tokenizer

    tok_id = Tokenizer(tiny_model)._encode("tok ", add_special_tokens=False)[0]
    env = {"SSE_TOKEN_ID": str(tok_id)}
    old = routers.upstream(logs, "old", *old_args, env=env)
    new = routers.upstream(logs, "new", TOKENS, 0.005, env=env)
    port = free_port()
    cfg = routers.config(tiny_model, port, [], health_interval_s=60)
    cfg["decode"] = [{"url": old.url, "revision": "r-old", "revision_generation": 2},
                     {"url": new.url, "revision": "r-new", "revision_generation": 1}]
    path = logs / "router.json"
    path.write_text(json.dumps(cfg))
    r = router(path, port, logs)
    try:
        for u in (old, new):
            u.wait_ready(timeout=30)
        r.start().wait_ready(timeout=60)
        yield r, old, new
    finally:
        stop_all([r, old, new])


def test_a_cut_stream_continues_on_its_own_revision(routers, tiny_model, tmp_path):
    """The old revision's decode cuts its first stream after CUT tokens and serves the continuation (ids):
    the continuation goes back to it, though the other decode is healthy and was not tried."""
    with _two_revisions(routers, tiny_model, tmp_path, TOKENS, 0.005, CUT, "first") as (r, old, new):
        client = OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
        chunks = list(client.completions.create(model="tiny", prompt="x", max_tokens=TOKENS, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == "tok " * TOKENS
        assert _stream_connections(new.url) == 0, "the new revision's worker got the old model's tokens"
        s = scrape(r.url)
        assert s[f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_MIGRATED}"}}'] == 1


def test_with_no_worker_of_its_revision_left_the_stream_ends_with_an_error(routers, tiny_model, tmp_path):
    """The old revision's only decode dies mid-stream: the stream ends with an error naming the revision,
    not a continuation on the new revision's worker."""
    with _two_revisions(routers, tiny_model, tmp_path, TOKENS, 0.2) as (r, old, new):
        client = OpenAI(base_url=f"{r.url}/v1", api_key="unused", max_retries=0)
        stream = iter(client.completions.create(model="tiny", prompt="x", max_tokens=TOKENS, stream=True))
        assert next(stream).choices[0].text == "tok "
        old.proc.send_signal(signal.SIGKILL)
        with pytest.raises(openai.APIError) as err:
            for _ in stream:
                pass
        assert "r-old" in str(err.value) and "revision" in str(err.value), str(err.value)
        assert _stream_connections(new.url) == 0
        s = scrape(r.url)
        assert s[f'{m.ROUTER_MIGRATIONS}{{outcome="{m.MIGRATION_FAILED}"}}'] == 1
