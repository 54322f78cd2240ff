"""The model's own tokenizer and chat template (transformers), for routing keys and length checks."""

from __future__ import annotations

from jinja2 import TemplateError

from .errors import BadRequest
from .protocol import ChatCompletionRequest, CompletionRequest


class Tokenizer:
    def __init__(self, path: str):
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        self._encode = self._tok.encode
        self.vocab_size = len(self._tok)     # added tokens included
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
        """The token ids the worker will compute for this request's prompt. BadRequest for a prompt no
        worker could take either: text that is not Unicode (a lone surrogate, which JSON can spell),
        messages the model's chat template refuses, token ids outside the vocabulary."""
        if isinstance(req, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except TemplateError as e:     # the template's own raise_exception(): roles out of order...
                raise BadRequest(f"The messages do not fit the model's chat template: {e}",
                                 param="messages") from None
            # vLLM tokenizes a rendered chat without adding special tokens again.
            return self._text_ids(text, False, "messages")
        if isinstance(req.prompt, list):
            if max(req.prompt) >= self.vocab_size:
                raise BadRequest(f"The prompt has a token id beyond the vocabulary ({self.vocab_size} tokens).",
                                 param="prompt")
            return req.prompt
        return self._text_ids(req.prompt, True, "prompt")

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def _text_ids(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        try:
            return self._encode(text, add_special_tokens=add_special_tokens)
        except TypeError:                  # the Rust tokenizer's answer to a lone surrogate
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                raise BadRequest("The text is not valid Unicode (a lone surrogate).", param=param) from None
            raise
