"""Mid-stream migration: a decode stream that fails after tokens reached the client is continued on another
decode worker, from the prompt's token ids plus the ids generated so far, as the same client stream.

vLLM (0.32) sends token ids in a stream when the request sets ``return_token_ids``: the first chunk carries
``prompt_token_ids`` (in the choice for /v1/completions, at the top for /v1/chat/completions) and every chunk
its new ``token_ids``. The router asks for them on every stream it may have to migrate and takes them out of
what the client gets, unless the client asked for them too. Ids, not text: text does not round-trip through
the tokenizer, ids do, so at temperature 0 the continuation is the uninterrupted generation.

Where the continuation starts matters for its text: vLLM detokenizes a stream incrementally with the prompt
as context (tokenizers' DecodeStream) and holds back text that ends in an incomplete UTF-8 sequence; a
continuation whose prompt ends inside a character would print the whole prompt as its first token's text
(tokenizers 0.23). So it starts after the last generated token at which the text is complete, and the
worker generates the few held-back tokens again (at temperature 0, the same ones; the client saw their ids,
when it asked for ids, but not their text, so neither is repeated).

A continuation always goes to ``/v1/completions`` with the ids as its prompt, for chat requests too (a chat
request cannot start from token ids); its chunks are reshaped into the original stream's (its id, created,
model and object; for chat a ``delta`` with the text), and its usage rewritten to the original prompt and
every token generated. Only the continuation's chunks are parsed; the first worker's chunks are split around
their ids by one regular expression each (no Python call per match).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

# vLLM writes its chunks compactly (pydantic's model_dump_json), these fields never first in their object.
# Split around: a chunk's ids (the group) and the prompt's (no group: None in the split)
_IDS = re.compile(rb',"token_ids":(null|\[[0-9,]*\])|,"prompt_token_ids":(?:null|\[[0-9,]*\])')
_TOKEN_IDS = re.compile(rb',"token_ids":(null|\[[0-9,]*\])')
_FINISHED = b'"finish_reason":"'

# the client's fields a continuation does not carry over: the prompt and what replaces it, the chat-only
# ones (a continuation is a completions request), and those the router sets itself
_NOT_CONTINUED = frozenset({
    "prompt", "messages", "echo", "suffix", "stream", "stream_options", "max_tokens", "max_completion_tokens",
    "min_tokens", "truncate_prompt_tokens", "prompt_logprobs", "kv_transfer_params", "return_token_ids", "n",
    "tools", "tool_choice", "parallel_tool_calls", "chat_template", "chat_template_kwargs", "add_generation_prompt",
    "continue_final_message", "documents", "include_reasoning", "reasoning_effort", "add_special_tokens",
    "return_prompt_text"})


def unsupported(endpoint: str, body: dict) -> str | None:
    """Why a request's stream could not be continued exactly elsewhere, or None. Logprobs (their shape
    differs between the endpoints, and the continuation's are not the original's), tool calls and
    structured output (their parser and grammar state live in the failed worker)."""
    if body.get("logprobs") or body.get("top_logprobs") is not None or body.get("prompt_logprobs"):
        return "logprobs"
    if endpoint == CHAT and body.get("tools") and body.get("tool_choice") != "none":
        return "tools"
    fmt = body.get("response_format")
    if (isinstance(fmt, dict) and fmt.get("type") not in (None, "text")) or any(
            body.get(k) is not None for k in ("structured_outputs", "guided_json", "guided_regex",
                                               "guided_choice", "guided_grammar")):
        return "structured_output"
    return None


class TokenLog:
    """One stream's token ids as they pass (prompt and generated), and what a continuation needs."""

    def __init__(self, endpoint: str, body: dict, prompt_ids: list[int] | Callable[[], list[int]],
                 decode: Callable[[list[int], bool], str] | None = None):
        self.endpoint, self.body, self._decode = endpoint, body, decode
        self.client_wants_ids = body.get("return_token_ids") is True
        # the router's own (or how to get them: tokenized only if a continuation needs them and the worker
        # did not say); replaced by the worker's when it says
        self._prompt: list[int] | Callable[[], list[int]] = prompt_ids
        self._head: dict | None = None           # the first chunk: the stream's id, created, model, object
        # the first chunk as it came, parsed only when a continuation needs it (never, on most streams):
        # no JSON parsing on the way to the client's first token
        self._first: bytes | None = None
        self._seen_first = False
        self.finished = False                    # a chunk with a finish_reason went to the client
        self.reshaping = False                   # chunks come from a continuation: rewrite each
        self._parts: list[bytes | None] = []     # each chunk's token_ids list, parsed when needed
        self._ids: list[int] | None = None
        self._base = 0                           # tokens generated before the current continuation
        self._skip = 0                           # ids of the continuation the client already has
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        self.limit: int | None = limit if isinstance(limit, int) else None

    # -------------------------------------------------------------- the stream as it passes
    def scan(self, event: bytes) -> bytes:
        """A ``data:`` event with choices from the worker: its ids recorded, and removed unless the client
        asked for them; a continuation's event rewritten as the original stream's."""
        if self.reshaping:
            return self._reshape(event)
        if not self._seen_first:
            self._seen_first, self._first = True, event
        if _FINISHED in event:
            self.finished = True
        self._ids = None
        if self.client_wants_ids:
            self._parts += _TOKEN_IDS.findall(event)
            return event
        # out of the client's bytes: the prompt's ids (null but in the first chunk) and the chunk's, kept.
        # One split in C: the regular expression with a callback per match that it replaces was ~9% of the
        # router's samples at 1,000 streams (py-spy)
        parts = _IDS.split(event)
        if len(parts) == 1:
            return event
        self._parts += parts[1::2]         # a chunk's ids, or None where the prompt's were
        return b"".join(parts[::2])

    @property
    def head(self) -> dict | None:
        self._note_head()
        return self._head

    @property
    def prompt(self) -> list[int]:
        self._note_head()
        if callable(self._prompt):
            self._prompt = self._prompt()
        return self._prompt

    def _note_head(self) -> None:
        if self._first is None:
            return
        event, self._first = self._first, None
        try:
            d = json.loads(event[6:])
        except ValueError:
            return
        choices = d.get("choices") or [{}]
        prompt = d.get("prompt_token_ids") or choices[0].get("prompt_token_ids")
        if isinstance(prompt, list) and prompt:
            self._prompt = prompt
        self._head = {k: d[k] for k in ("id", "object", "created", "model") if k in d}

    def generated(self) -> list[int]:
        if self._ids is None:
            inner = b",".join(p[1:-1] for p in self._parts if p and p != b"null" and len(p) > 2)
            self._ids = json.loads(b"[" + inner + b"]")
        return self._ids

    @property
    def has_ids(self) -> bool:
        """Whether the worker sent token ids (vLLM does when asked; a worker that does not cannot be
        continued)."""
        return self.head is not None and any(self._parts)

    def remaining(self) -> int | None:
        return None if self.limit is None else self.limit - len(self.generated())

    # -------------------------------------------------------------- the continuation
    def resume_at(self) -> int:
        """How many generated tokens the continuation keeps: all but those at the end whose text is an
        incomplete character (vLLM held it back), found with the model's tokenizer on the last ids."""
        gen = self.generated()
        if self._decode is None:
            return len(gen)
        skip = self.body.get("skip_special_tokens") is not False
        k = len(gen)
        # a character spans at most 4 bytes: the last 32 ids decide whether the text ends inside one
        while k > 0 and self._decode((self.prompt + gen[:k])[-32:], skip).endswith("\ufffd"):
            k -= 1
        return k

    def continuation(self) -> dict:
        """The /v1/completions request that continues the stream: same sampling parameters, the prompt's
        ids plus the generated ones (up to :meth:`resume_at`) as its prompt, max_tokens (and min_tokens)
        less those."""
        gen = self.generated()[:self.resume_at()]
        body = {k: v for k, v in self.body.items() if k not in _NOT_CONTINUED}
        opts = self.body.get("stream_options") or {}
        body.update(prompt=self.prompt + gen, stream=True, return_token_ids=True,
                    stream_options={"include_usage": True,
                                    **({"continuous_usage_stats": True} if opts.get("continuous_usage_stats")
                                       else {})})
        if self.limit is not None:
            body["max_tokens"] = self.limit - len(gen)
        if isinstance(self.body.get("min_tokens"), int) and self.body["min_tokens"] > len(gen):
            body["min_tokens"] = self.body["min_tokens"] - len(gen)
        return body

    def start_continuation(self) -> None:
        """The continuation is open: from here its chunks are rewritten, and the generated ids it
        repeats (those after :meth:`resume_at`) are taken out of the record, to come back with it."""
        keep = self.resume_at()
        self._skip = len(self._ids) - keep
        del self._ids[keep:]
        self._base = keep
        self.reshaping = True

    def _reshape(self, event: bytes) -> bytes:
        d = json.loads(event[6:])
        chat = self.endpoint == CHAT
        choices = []
        for c in d.get("choices") or []:
            ids = c.pop("token_ids", None)
            c.pop("prompt_token_ids", None)
            if ids:
                self.generated().extend(ids)
                if self._skip:        # the client has these ids already (their text it has not)
                    seen, self._skip = min(self._skip, len(ids)), self._skip - min(self._skip, len(ids))
                    ids = ids[seen:]
            if c.get("finish_reason"):
                self.finished = True
            if chat:
                text = c.pop("text", "")
                c = {"index": c.get("index", 0), "delta": {"content": text} if text else {}, "logprobs": None,
                     "finish_reason": c.get("finish_reason"), "stop_reason": c.get("stop_reason")}
            if ids is not None and self.client_wants_ids:
                c["token_ids"] = ids
            choices.append(c)
        d["choices"] = choices
        if isinstance(d.get("usage"), dict):
            d["usage"] = self.usage(self._base + (d["usage"].get("completion_tokens") or 0))
        d.update(self.head or {})
        return b"data: " + json.dumps(d, separators=(",", ":")).encode()

    def usage(self, completion_tokens: int) -> dict:
        return {"prompt_tokens": len(self.prompt), "completion_tokens": completion_tokens,
                "total_tokens": len(self.prompt) + completion_tokens}

    def closing(self, client_wants_usage: bool) -> bytes:
        """The end of a stream whose worker failed after its last token (the finish chunk, or max_tokens
        reached): what the worker had left to send (a finish chunk when none went out, the usage), so no
        continuation is needed."""
        out = []
        head = {**(self.head or {}), "choices": []}
        if not self.finished:
            choice = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
                      if self.endpoint == CHAT else
                      {"index": 0, "text": "", "logprobs": None, "finish_reason": "length"})
            out.append(b"data: " + json.dumps({**head, "choices": [choice]}).encode() + b"\n\n")
        if client_wants_usage:
            out.append(b"data: " + json.dumps({**head, "usage": self.usage(len(self.generated()))}).encode()
                       + b"\n\n")
        return b"".join(out) + b"data: [DONE]\n\n"
