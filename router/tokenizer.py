"""The model's own tokenizer and chat template (transformers), for routing keys and length checks."""

from __future__ import annotations

from .protocol import ChatCompletionRequest, CompletionRequest


class Tokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)

    def prompt_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The token ids the worker will compute for this request's prompt."""
        if isinstance(req, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # vLLM tokenizes a rendered chat without adding special tokens again.
            return self._tok.encode(text, add_special_tokens=False)
        if isinstance(req.prompt, list):
            return req.prompt
        return self._tok.encode(req.prompt)
