"""Whole-number query parameters, read one way on every route."""

from __future__ import annotations

from kestrel_one.common.errors import ValidationFailed


def whole_number_param(request, name: str, default: int) -> int:
    """``?name=``: ASCII digits only, else a 400 naming it; ``default`` when absent.

    ``str.isdigit()`` alone admits superscript and fullwidth digits, which ``int()`` then
    rejects or reads.
    """
    value = request.query_params.get(name)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit()):
        raise ValidationFailed(f"{name} must be a whole number ≥ 0.", details={name: ["invalid"]})
    return int(value)


def page_limit(request, *, default: int, maximum: int) -> int:
    """``?limit=``, clamped to 1..``maximum``: a page always holds something."""
    return max(1, min(whole_number_param(request, "limit", default), maximum))
