"""The model's own tokenizer and chat template (transformers), for routing keys and length checks."""

from __future__ import annotations

from .protocol import ChatCompletionRequest, CompletionRequest


class Tokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self._encode = self._tok.encode
        # The Rust tokenizer underneath, called directly: transformers' encode() wraps every call in a
        # BatchEncoding (a fifth of the router's tokenizing time at 1,000 streams). Used only when it gives
        # the same ids as encode() on a few probes, so a tokenizer with Python-side rules keeps them.
        fast = getattr(self._tok, "backend_tokenizer", None)
        if fast is not None:
            def encode(text: str, add_special_tokens: bool = True) -> list[int]:
                return fast.encode(text, add_special_tokens=add_special_tokens).ids

            probes = ["Hello, world!", " leading space", "multi\nline  text\twith tabs", "ünïcödé 日本語 🙂"]
            if all(encode(t, sp) == self._tok.encode(t, add_special_tokens=sp)
                   for t in probes for sp in (True, False)):
                self._encode = encode

    def prompt_ids(self, req: CompletionRequest | ChatCompletionRequest) -> list[int]:
        """The token ids the worker will compute for this request's prompt."""
        if isinstance(req, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            # vLLM tokenizes a rendered chat without adding special tokens again.
            return self._encode(text, add_special_tokens=False)
        if isinstance(req.prompt, list):
            return req.prompt
        return self._encode(req.prompt)
