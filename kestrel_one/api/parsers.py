"""The API's one request parser: every JSON body, on every endpoint, is read by it."""

from __future__ import annotations

import json
import re
from typing import Any

from django.conf import settings
from rest_framework import parsers, renderers
from rest_framework.exceptions import ParseError

from kestrel_one.common.errors import ValidationFailed
from kestrel_one.common.jsontext import json_loads

# Neither can be stored, hashed or signed: PostgreSQL text and jsonb hold no NUL, and a lone
# UTF-16 surrogate (a JSON "\ud800" escape) is not a character, so it has no UTF-8 form.
_UNSTORABLE = re.compile("[\x00\ud800-\udfff]")


class _Repeated(dict[str, Any]):
    """A decoded JSON object that was given a key more than once (refused by body_check)."""

    def __init__(self, pairs: list[tuple[str, Any]]):
        super().__init__(pairs)
        seen: set[str] = set()
        self.repeated: list[str] = []
        for key, _ in pairs:
            if key in seen:
                self.repeated.append(key)
            seen.add(key)


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    return value if len(value) == len(pairs) else _Repeated(pairs)


def _strict_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def json_value(text: str) -> Any:
    """``text`` decoded as this parser decodes a body (NaN and Infinity are no JSON numbers,
    a repeated key is kept for ``body_check``), for JSON typed into a console form;
    ``json.JSONDecodeError`` when it is no JSON. ``body_check`` the value it is part of."""
    return json_loads(text, object_pairs_hook=_object, parse_constant=_strict_constant)


def _field(path: str, key: str | int) -> str:
    """``args.argv[0]``: the spelling errors use everywhere (registry._field_path)."""
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def _unstorable_reason(text: str) -> str | None:
    found = _UNSTORABLE.search(text)
    if found is None:
        return None
    if found.group() == "\x00":
        return "must not contain NUL characters"
    return (
        f"holds a lone UTF-16 surrogate (\\u{ord(found.group()):04x}) at character "
        f"{found.start()}, which is not text: send valid Unicode (a surrogate only as half of "
        "an escaped pair)"
    )


def _refuse(field: str, reason: str):
    raise ValidationFailed(f"{field or 'The request body'} {reason}.", details={field: [reason]})


def body_check(data: Any) -> None:
    """Refuse, naming the field, a repeated key or a string that cannot be stored (NUL, a
    lone surrogate). Iterative: the decoder's own nesting limit holds, not Python's stack."""
    pending: list[tuple[str, Any]] = [("", data)]
    while pending:
        path, value = pending.pop()
        if isinstance(value, str):
            reason = _unstorable_reason(value)
            if reason:
                _refuse(path, reason)
        elif isinstance(value, dict):
            for key in getattr(value, "repeated", ()):
                _refuse(_field(path, key), "is given twice; a JSON object may name each key once")
            for key, item in value.items():
                reason = _unstorable_reason(key)
                if reason:
                    _refuse(_field(path, "<key>"), f"has a key that {reason}")
                pending.append((_field(path, key), item))
        elif isinstance(value, list):
            pending.extend((_field(path, index), item) for index, item in enumerate(value))


class JSONParser(parsers.BaseParser):
    """Strict JSON: a repeated key, NUL or a lone surrogate anywhere is a 400 naming the field
    (a plain decoder keeps the last of two keys, and the others fail only when stored or
    hashed); NaN and Infinity are refused; a body nested deeper than Python's decoder goes is
    a 400; a malformed body is told where the decoder stopped and what to send instead.

    The decoder raises RecursionError there, which DRF does not catch: a few kilobytes of
    ``[[[[...`` would otherwise be a server error.
    """

    media_type = "application/json"
    renderer_class = renderers.JSONRenderer

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            text = stream.read().decode(encoding)
        except UnicodeDecodeError as error:
            raise ParseError(
                f"The request body is not valid {encoding} (byte {error.start}); send JSON "
                "text, with any character outside ASCII encoded as UTF-8 or \\u-escaped."
            ) from None
        try:
            data = json.loads(text, object_pairs_hook=_object, parse_constant=_strict_constant)
        except RecursionError:
            raise ParseError("The request body's JSON is nested too deeply.") from None
        except ValueError as error:
            raise ParseError(
                f"The request body is not valid JSON ({error}); send one JSON object, "
                'such as {"name": "..."}.'
            ) from None
        body_check(data)
        return data
