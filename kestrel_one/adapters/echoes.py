"""A released credential as an upstream might echo it back, and its masking in what is
passed on: an adapter's answer (adapters.services) and a model provider's, whole or streamed
(gateway.calls). The credential never reaches the workload, even through its own provider.
"""

from __future__ import annotations

import base64
from typing import Any
from urllib.parse import quote

from kestrel_one.adapters.registry import Adapter
from kestrel_one.common.redaction import MASK

__all__ = ["EchoMask", "mask_bytes", "mask_forms", "secret_forms"]


def secret_forms(secret: str, adapter: Adapter) -> list[str]:
    """The credential as an upstream might echo it back: plain, as presented, base64 (plain
    and URL-safe, padded or not), hex and URL-encoded; longest first."""
    raw = secret.encode()
    forms = {
        secret,
        adapter.presentation.header_value(secret),
        base64.b64encode(raw).decode(),
        base64.b64encode(raw).decode().rstrip("="),
        base64.urlsafe_b64encode(raw).decode(),
        base64.urlsafe_b64encode(raw).decode().rstrip("="),
        raw.hex(),
        raw.hex().upper(),
        quote(secret, safe=""),
    }
    return sorted((form for form in forms if len(form) >= 6), key=len, reverse=True)


def mask_forms(value: Any, forms: list[str]) -> Any:
    """``value`` (strings, in lists and dicts, keys too) with every one of ``forms`` masked."""
    if isinstance(value, dict):
        return {mask_forms(str(k), forms): mask_forms(v, forms) for k, v in value.items()}
    if isinstance(value, list):
        return [mask_forms(item, forms) for item in value]
    if isinstance(value, str):
        for form in forms:
            if form in value:
                value = value.replace(form, MASK)
        return value
    return value


def mask_bytes(data: bytes, forms: list[str]) -> bytes:
    """``data`` with every one of ``forms`` (as UTF-8) masked."""
    for form in forms:
        encoded = form.encode()
        if encoded in data:
            data = data.replace(encoded, MASK.encode())
    return data


class EchoMask:
    """``mask_bytes`` over a stream: a form cut across two chunks is still masked. Of each
    chunk's end, only what could begin a form is held back until the next chunk (``feed``)
    or the end (``finish``), so ordinary output is passed on at once."""

    def __init__(self, forms: list[str]) -> None:
        self._forms = forms
        self._encoded = [form.encode() for form in forms]
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        data = mask_bytes(self._held + chunk, self._forms)
        keep = self._partial_form_at_end(data)
        self._held = data[len(data) - keep :]
        return data[: len(data) - keep]

    def finish(self) -> bytes:
        held, self._held = self._held, b""
        return held

    def _partial_form_at_end(self, data: bytes) -> int:
        """The length of the longest end of ``data`` that is the start of a form."""
        longest = 0
        for form in self._encoded:
            for size in range(min(len(form) - 1, len(data)), longest, -1):
                if data.endswith(form[:size]):
                    longest = size
                    break
        return longest
