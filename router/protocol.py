"""Request models of the OpenAI API the router serves: validation only, no I/O.

Fields the router does not interpret (vLLM's sampling extensions) pass through
to the worker untouched; the ones it relies on are checked here, so a bad
request is refused before any worker sees it.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1024
# Deeper bodies are refused: no OpenAI request nests this deep (tool schemas included), and a deeper one
# would reach the recursion limits of the JSON encoders on the way to the worker.
MAX_JSON_DEPTH = 64
INT64 = (-(2**63), 2**63 - 1)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"the number {text[:20]} is out of range")
    return value


def load_json(raw: bytes) -> Any:
    """A request body as strict JSON (RFC 8259): UTF-8, no NaN or Infinity, finite numbers, nested at most
    MAX_JSON_DEPTH deep. ValueError (with a message for the client) otherwise."""
    try:
        doc = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels") from None
    # a body with fewer brackets than the limit cannot nest that deep (counted in C; most bodies)
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth_exceeds(doc, MAX_JSON_DEPTH):
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    return doc


def _depth_exceeds(doc: Any, limit: int) -> bool:
    """Whether containers nest deeper than ``limit``, level by level; a level's scalars are typed in C
    (set(map(type, ...))), so a prompt of 100,000 token ids costs a set, not a Python loop."""
    level, depth = [doc], 0
    while level:
        level = [node for node in level if type(node) in (dict, list)]
        if not level:
            return False
        depth += 1
        if depth > limit:
            return True
        nxt = []
        for node in level:
            children = node.values() if type(node) is dict else node
            kinds = set(map(type, children))
            if dict in kinds or list in kinds:
                nxt.extend(children)
        level = nxt
    return False


# strict: a field of the wrong JSON type is refused as OpenAI refuses it ("5" is no max_tokens), never
# coerced, since the body is forwarded to the worker as the client sent it
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    kv_transfer_params: None = Field(None, description="set by the router only")

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Request):
    prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | \
        Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            return v[0]         # a batch of one
        if isinstance(v, list) and v and not all(isinstance(t, int) for t in v):
            raise ValueError("prompt must be a string or a list of token ids (batches are not supported)")
        return v


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
