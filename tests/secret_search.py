"""Searching every place a secret could leak to: projections, rows, Redis keys, log files
and containers, in clear and in the encodings a leak usually takes.

A secret is looked for as written, base64 (standard and URL-safe, with or without padding),
URL-encoded and hex (either case), inside the text and inside whatever base64 runs in it
decode to (Celery message bodies and signed tokens carry their payloads base64-encoded).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import subprocess
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import quote, quote_plus

import redis
from django.db import connection

_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{16,}={0,2}")


def encoded_forms(secret: str) -> set[str]:
    """The forms of ``secret`` a search looks for."""
    raw = secret.encode()
    forms = {
        secret,
        quote(secret, safe=""),
        quote_plus(secret),
        raw.hex(),
        raw.hex().upper(),
    }
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        text = encode(raw).decode()
        forms.update({text, text.rstrip("=")})
    return forms


def decoded_forms(blob: str, depth: int = 0) -> list[str]:
    """``blob`` and what its base64 runs decode to, three levels deep."""
    forms = [blob]
    if depth >= 3:
        return forms
    for run in _BASE64_RUN.findall(blob):
        padded = run + "=" * (-len(run) % 4)
        for decode in (base64.b64decode, base64.urlsafe_b64decode):
            try:
                text = decode(padded).decode("utf-8")
            except (binascii.Error, ValueError):
                continue
            forms.extend(decoded_forms(text, depth + 1))
    return forms


class SecretSearch:
    """Asserts that none of ``secrets`` appears, in any form, where it is pointed at."""

    def __init__(self, secrets: Iterable[str]):
        self.secrets = tuple(secrets)
        self.forms = {secret: encoded_forms(secret) for secret in self.secrets}
        self.searched: list[str] = []  # what was searched, so a test can show it was

    def check(self, where: str, blob: object) -> None:
        text = blob if isinstance(blob, str) else json.dumps(blob, default=str)
        self.searched.append(where)
        for form in decoded_forms(text):
            for secret, encodings in self.forms.items():
                for encoding in encodings:
                    assert encoding not in form, f"{secret!r} is in {where} (as {encoding!r})"

    def check_tables(self) -> int:
        """Every row of every table, read raw (bytea columns come back as bytes: hex too)."""
        tables = 0
        with connection.cursor() as cursor:
            for table in connection.introspection.table_names():
                cursor.execute(f'SELECT * FROM "{table}"')  # noqa: S608 (names from the catalogue)
                rows = [[_text(value) for value in row] for row in cursor.fetchall()]
                self.check(f"table {table}", rows)
                tables += 1
        return tables

    def check_redis(self, url: str) -> int:
        client = redis.Redis.from_url(url)
        keys = 0
        for key, values in redis_values(client):
            self.check(f"redis key {key}", key)
            for value in values:
                self.check(f"redis key {key}", value)
            keys += 1
        return keys

    def check_files(self, paths: Iterable[Path]) -> int:
        files = 0
        for path in paths:
            if path.is_file():
                self.check(f"file {path}", path.read_bytes().decode("utf-8", "replace"))
                files += 1
        return files

    def check_containers(self) -> int:
        """``docker inspect`` of every container there is (running or not)."""
        ids = subprocess.run(
            ["docker", "ps", "-aq"], check=True, capture_output=True, text=True
        ).stdout.split()
        if ids:
            inspected = subprocess.run(
                ["docker", "inspect", *ids], check=True, capture_output=True, text=True
            ).stdout
            self.check("docker inspect", inspected)
        return len(ids)


def _text(value: object) -> object:
    if isinstance(value, memoryview):
        value = value.tobytes()
    if isinstance(value, bytes):
        return value.hex() + " " + value.decode("utf-8", "replace")
    return value


def redis_values(client: redis.Redis) -> Iterator[tuple[str, list[str]]]:
    """Every key of the database ``client`` is on, with its values as text."""
    for key in client.scan_iter("*"):
        kind = client.type(key).decode()
        if kind == "string":
            values = [client.get(key)]
        elif kind == "list":
            values = client.lrange(key, 0, -1)
        elif kind == "hash":
            mapping = client.hgetall(key)
            values = [*mapping.keys(), *mapping.values()]
        elif kind == "set":
            values = list(client.smembers(key))
        elif kind == "zset":
            values = client.zrange(key, 0, -1)
        elif kind == "stream":
            values = [json.dumps(entry, default=str) for entry in client.xrange(key)]
        else:
            values = []
        yield key.decode(), [v.decode("utf-8", "replace") for v in values if v is not None]
