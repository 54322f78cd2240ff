"""A request body as the router reads it, in both modes (proxy: :mod:`.app`; picker: :mod:`.picker`):
strict JSON, then the endpoint's request model, with errors a client can act on."""

from __future__ import annotations

from pydantic import ValidationError

from . import errors
from .protocol import load_json

_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _describe(e: ValidationError) -> errors.BadRequest:
    """The first problem, as ``field.path: message`` (pydantic's union-member tags dropped)."""
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"]
                     if not (isinstance(p, str) and (p in _UNION_TAGS or "-" in p or "[" in p)))
    return errors.BadRequest(f"{where}: {first['msg']}" if where else first["msg"], param=where or None)


def parse_body(raw: bytes, model) -> tuple[object, dict]:
    """``(model instance, the body as a dict)``, or :class:`~.errors.BadRequest` naming the problem."""
    try:
        body = load_json(raw)
    except ValueError as e:     # UnicodeDecodeError among them: not UTF-8
        raise errors.BadRequest(f"The body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise errors.BadRequest("The body must be a JSON object.")
    try:
        return model.model_validate(body), body
    except ValidationError as e:
        raise _describe(e) from None
