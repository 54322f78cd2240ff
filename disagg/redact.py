"""Secrets out of anything logged or printed: command lines and environments.

The one place that decides what counts as a secret. Every component that logs or prints an argv
or an environment (the worker supervisor, ``python -m disagg.workers command``) passes it through
:func:`argv` or :func:`env` first. A name is secret when one of its words (split on ``-``, ``_``
and ``.``) is one of :data:`SECRET_WORDS`: ``--api-key``, ``--hf-token``, ``HF_TOKEN``,
``AWS_SECRET_ACCESS_KEY`` are, ``--tokenizer`` and ``--max-num-batched-tokens`` are not (whole
words only, so the arguments that say what runs stay readable). Beyond names, credentials inside
URLs (``https://user:pass@host``) and secret-named fields of JSON arguments
(``--model-loader-extra-config '{"access_key": ...}'``) are masked too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

MASK = "***"
SECRET_WORDS = frozenset({"key", "apikey", "token", "secret", "password", "passwd", "credential",
                          "credentials", "auth", "authorization"})
_WORD = re.compile(r"[-_.]+")
# userinfo of a URL: scheme://user:password@host
_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")


def is_secret_name(name: str) -> bool:
    """Whether a flag, variable or field name names a secret (``--api-key``, ``HF_TOKEN``, ``secretKey``)."""
    # camelCase words apart too (secretAccessKey -> secret access key)
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name.lstrip("-"))
    return any(w in SECRET_WORDS for w in _WORD.split(spaced.lower()))


def value(text: str) -> str:
    """A value that is not itself named secret: URL credentials and secret fields of JSON masked."""
    text = _URL_CREDENTIALS.sub(MASK + "@", text)
    if text[:1] in "{[":
        try:
            doc = json.loads(text)
        except ValueError:
            return text
        masked = _json(doc)
        if masked != doc:
            return json.dumps(masked, separators=(",", ":"))
    return text


def _json(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: MASK if isinstance(k, str) and is_secret_name(k) and v not in (None, "")
                else _json(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [_json(v) for v in doc]
    if isinstance(doc, str):
        return _URL_CREDENTIALS.sub(MASK + "@", doc)
    return doc


def argv(args: Sequence[str]) -> list[str]:
    """A command line with the values of secret-named flags masked: ``--api-key X`` and
    ``--api-key=X`` both. A secret-named flag followed by another flag is a switch (vLLM's bare
    ``--hf-token`` reads the stored token): the next argument is left alone."""
    out: list[str] = []
    mask_next = False
    for arg in args:
        if mask_next and not arg.startswith("-"):
            out.append(MASK)
            mask_next = False
            continue
        mask_next = False
        if arg.startswith("-") and len(arg) > 1:
            name, eq, val = arg.partition("=")
            if is_secret_name(name):
                if eq:
                    out.append(f"{name}={MASK}")
                else:
                    out.append(arg)
                    mask_next = True
                continue
            out.append(f"{name}={value(val)}" if eq else arg)
            continue
        out.append(value(arg))
    return out


def env(variables: Mapping[str, str]) -> dict[str, str]:
    """An environment with secret-named variables' values masked (and URL credentials in the rest)."""
    return {k: MASK if is_secret_name(k) else value(v) for k, v in variables.items()}
