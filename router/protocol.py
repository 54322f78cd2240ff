"""Request models of the OpenAI API the router serves: validation only, no I/O.

Fields the router does not interpret (vLLM's sampling extensions) pass through
to the worker untouched; the ones it relies on are checked here, so a bad
request is refused before any worker sees it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_PROMPT_CHARS = 1_000_000
MAX_MESSAGES = 1024


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = None
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
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Request):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
