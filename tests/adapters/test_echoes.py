"""Masking a released credential in what an upstream answers, whole or streamed."""

from __future__ import annotations

import base64

import pytest

from kestrel_one.adapters.echoes import EchoMask, mask_bytes, secret_forms
from kestrel_one.adapters.registry import get_adapter

SECRET = "sk-kestrel-echo-test-0123456789abcdef"


@pytest.fixture
def forms() -> list[str]:
    return secret_forms(SECRET, get_adapter("openai"))


@pytest.mark.spec("CRED-6")
def test_every_form_is_masked_whole(forms):
    encoded = base64.b64encode(SECRET.encode()).decode()
    data = f'{{"a": "{SECRET}", "b": "Bearer {SECRET}", "c": "{encoded}"}}'.encode()
    assert mask_bytes(data, forms) == b'{"a": "[redacted]", "b": "[redacted]", "c": "[redacted]"}'


@pytest.mark.spec("CRED-6")
@pytest.mark.parametrize("cut", [1, 5, 20, len(SECRET) - 1])
def test_a_form_cut_across_chunks_is_masked_and_nothing_else_is_held(forms, cut):
    data = f"data: {{'key': '{SECRET}'}}\n\n".encode()
    at = data.index(SECRET.encode()) + cut
    mask = EchoMask(forms)
    out = mask.feed(data[:at])
    # Only what could begin the credential waits for the next chunk.
    assert out == data[: data.index(SECRET.encode())]
    out += mask.feed(data[at:]) + mask.finish()
    assert out == b"data: {'key': '[redacted]'}\n\n"


def test_ordinary_output_passes_at_once_and_a_false_start_is_released(forms):
    mask = EchoMask(forms)
    assert mask.feed(b"data: hello\n\n") == b"data: hello\n\n"
    assert mask.feed(b"ends with sk-kes") == b"ends with "
    assert mask.feed(b"trel, not a key\n\n") == b"sk-kestrel, not a key\n\n"
    assert mask.feed(b"last sk") == b"last "
    assert mask.finish() == b"sk"
