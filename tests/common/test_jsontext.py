"""JSON from outside nested deeper than the decoder goes is a decode error, wherever it is
read: a request body, a form's field, an upstream's answer (API-6)."""

from __future__ import annotations

import json

import pytest

from kestrel_one.adapters.services import _parsed_body
from kestrel_one.common.jsontext import json_loads
from kestrel_one.gateway.calls import _parse
from kestrel_one.gateway.providers import StreamReader

DEEP = "[" * 100_000 + "]" * 100_000


def test_json_nested_too_deeply_is_a_decode_error_not_a_recursion_error():
    with pytest.raises(RecursionError):
        json.loads(DEEP)  # what every `except ValueError` around json.loads missed
    for text in (DEEP, DEEP.encode()):
        with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
            json_loads(text)
    assert json_loads('{"a": [1]}') == {"a": [1]}


@pytest.mark.spec("API-6")
def test_an_upstream_answer_nested_too_deeply_is_read_as_no_json():
    """A model provider's or an adapter's upstream answer is not ours: nested too deeply, it
    used to raise out of the gateway's and the adapters' readers (a server error, or an
    invocation's task crashed) instead of being kept as the text it is."""
    assert _parse(DEEP.encode()) is None
    answer = type("Answer", (), {"body": DEEP.encode()})()
    assert _parsed_body(answer) == DEEP
    reader = StreamReader(provider="openai")
    [(_event, payload, _raw)] = reader.feed(f"data: {DEEP}\n\n".encode())
    assert payload is None


def test_a_number_of_too_many_digits_is_a_decode_error_not_a_bare_value_error():
    """Python reads no integer of more than 4,300 digits; json.loads then raises a plain
    ValueError, which an ``except json.JSONDecodeError`` misses."""
    long_number = "[" + "4" * 5000 + "]"
    with pytest.raises(ValueError) as raised:
        json.loads(long_number)
    assert not isinstance(raised.value, json.JSONDecodeError)
    with pytest.raises(json.JSONDecodeError, match="a number has too many digits"):
        json_loads(long_number)


def test_bytes_that_are_no_text_keep_their_own_error():
    # Not a number's digits: the message must not say it was (a UnicodeDecodeError is a
    # ValueError too, and each caller already answers it).
    with pytest.raises(UnicodeDecodeError):
        json_loads(b"\xff\xfe\x00")
