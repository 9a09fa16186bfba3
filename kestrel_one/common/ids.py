"""Prefixed public identifiers: what leaves the database instead of integer keys.

A public id is a prefix naming the kind (``prj_``) and a ULID: 48 bits of milliseconds then
80 random bits, in Crockford base32. Ids sort by creation time, which keeps cursor pagination
stable without exposing row numbers.
"""

from __future__ import annotations

import secrets
import time
from functools import partial

from django.db import models

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
PREFIXES = frozenset(
    {
        "usr",
        "org",
        "mem",
        "env",
        "prj",
        "thr",
        "act",
        "apr",
        "rcp",
        "art",
        "tok",
        "run",
        "whk",
        "msg",
        "dlv",
        "pol",
        # Surface policy versions (kestrel_one.governance).
        "spv",
        "aud",
        "pln",
        "ver",
        "shr",
        "chk",
        # The model gateway's usage records.
        "mdu",
        "crd",
        "con",
        # MCP servers, their discoveries and risk acceptances (kestrel_one.mcp).
        "mcp",
        "mdi",
        "rsk",
        # The MCP endpoint's sessions (kestrel_one.mcp_endpoint).
        "mcs",
    }
)


def ulid() -> str:
    value = (int(time.time() * 1000) << 80) | secrets.randbits(80)
    chars = []
    for _ in range(26):
        chars.append(_CROCKFORD[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def new_public_id(prefix: str) -> str:
    if prefix not in PREFIXES:
        raise ValueError(f"unknown public id prefix {prefix!r}")
    return f"{prefix}_{ulid()}"


def public_id_factory(prefix: str):
    """A model field default; ``partial`` keeps it importable by migrations."""
    if prefix not in PREFIXES:
        raise ValueError(f"unknown public id prefix {prefix!r}")
    return partial(new_public_id, prefix)


def PublicIdField(prefix: str):
    return models.CharField(
        max_length=40, unique=True, editable=False, default=public_id_factory(prefix)
    )


def url_names_storable(kwargs) -> bool:
    """Whether every value a URL names (a public id, a slug) could be held by a row: a NUL
    (``%00``) cannot be stored in PostgreSQL text, so a lookup of it is a database error, not
    a miss. The bases of the API's and the console's views answer False with the same 404 as
    any missing object, before anything is looked up."""
    return not any(isinstance(value, str) and "\x00" in value for value in kwargs.values())
