"""One redaction pass for everything that is stored or shown: audit, events, receipts, logs,
webhooks.

Three layers, because secrets reach us in three ways:

1. Secret-like *keys* (``password``, ``api_key``, ``Authorization``...) have their values
   masked whatever the value looks like: a short password has no shape to recognise.
2. Secret-like *values* are masked wherever they appear: known token formats (Kestrel,
   GitHub, Slack, AWS, Stripe, OpenAI, Google, GitLab, npm), JWTs, PEM private keys,
   ``Bearer``/``Basic`` credentials, ``key=value`` assignments and URL passwords, and long
   high-entropy strings, which is how most unknown secrets look.
3. *Encoded* secrets: base64, hex, URL-encoded and JSON-escaped runs are decoded and checked
   again (two levels deep), so wrapping a secret in an encoding does not smuggle it through.

Hex digests (SHA-256 hashes, commit ids) are deliberately not treated as high-entropy
secrets: the audit chain and receipts show them on purpose, and hex carries at most four bits
per character, below the entropy bar. A secret stored as hex is still caught by its key name
or by decoding it (layer 3) when the decoded bytes are themselves a recognisable secret.

``bounded`` then keeps the result under a size budget, shrinking long strings, lists and
dicts with an explicit ``[truncated]`` marker rather than silently dropping data.

A tool call's arguments and its runner's result go through ``redact_arguments`` and
``redact_result`` when they are *received*, before anything is stored (CRED-1), so every
projection built from the stored rows (actions, receipts, plans, events, replay, audit,
webhooks, artifacts) starts from redacted data; serializers redact again on the way out,
because redaction rules only ever grow. Write-only arguments (``WRITE_ONLY_ARGUMENTS``: the
environment overlay) keep no value at all, only a keyed ``fingerprint``. Digests are the
exception by design: ``args_digest`` and the receipt's digests are over the exact values
that were signed and run, salted where redaction changed them so that they test no guess
(docs/records.md, "Redaction and digests").
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import math
import re
from collections import Counter
from functools import lru_cache
from typing import Any
from urllib.parse import unquote

import structlog
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from django.conf import settings

from kestrel_one.common.ids import PREFIXES

MASK = "[redacted]"
TRUNCATED = "[truncated]"

# Deeper nesting than this is cut: it is never legitimate audit data and would only slow us.
MAX_DEPTH = 32
# How many times an encoded run is decoded and re-checked (base64 of URL-encoded, ...).
MAX_DECODE_DEPTH = 2

_SECRET_KEY = re.compile(
    r"(pass(word|wd|phrase)?|pwd|secret|token|api[-_ ]?key|apikey|access[-_ ]?key|"
    r"authori[sz]ation|(^|[^a-z])auth($|[^a-z])|cookie|private[-_ ]?key|credential|"
    r"signature|session|(^|[-_ ])dsn$|conn(ection)?[-_ ]?str(ing)?|"
    r"(signing|encryption|secret|master|ssh|client)[-_ ]?key|bearer|jwt)",
    re.IGNORECASE,
)

# Known formats. Anchors are loose on purpose: a token glued to other text is still a token.
_KNOWN_SECRET = re.compile(
    r"(kst_[A-Za-z0-9]{8,}_[A-Za-z0-9_-]{16,}"  # Kestrel API tokens
    r"|ksh_[A-Za-z0-9_-]{16,}"  # Kestrel share-link tokens (they travel in URLs)
    r"|set-password/[A-Za-z0-9_=-]+/[0-9a-z]{1,13}-[0-9a-f]{20,}"  # one-time sign-in links
    r"|whsec_[A-Za-z0-9+/=]{16,}"  # webhook signing secrets
    r"|-----BEGIN [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----[\s\S]*?"
    r"(-----END [A-Z0-9 ]*PRIVATE KEY( BLOCK)?-----|$)"
    r"|\b(sk|pk|rk)_(live|test)_[A-Za-z0-9]{16,}"  # Stripe
    r"|\bwhsec_[A-Za-z0-9+/=]{16,}"  # Stripe webhook secrets
    r"|gh[pousr]_[A-Za-z0-9]{30,}"  # GitHub classic tokens
    r"|github_pat_[A-Za-z0-9_]{22,}"  # GitHub fine-grained tokens
    r"|glpat-[A-Za-z0-9_-]{20,}"  # GitLab
    r"|npm_[A-Za-z0-9]{36}"  # npm
    r"|xox[abposre]-[A-Za-z0-9-]{10,}"  # Slack
    r"|hooks\.slack\.com/services/[A-Za-z0-9/]+"
    r"|\b(AKIA|ASIA|AGPA|AIDA|AROA|ANPA|ANVA|AIPA)[0-9A-Z]{16}\b"  # AWS access key ids
    r"|\bsk-(ant-|proj-)?[A-Za-z0-9_-]{20,}"  # OpenAI / Anthropic style
    r"|\bAIza[0-9A-Za-z_-]{35}"  # Google API keys
    r"|eyJ[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}\.[A-Za-z0-9_-]{5,}"  # JWTs
    r"|\b(Bearer|Basic|Token|Digest)\s+[A-Za-z0-9._~+/=-]{8,})"
)

# ``password=hunter2``, ``"api_key": "..."``, ``Cookie: a=b`` inside free text: the key
# stays (it says what was there), the value goes.
_ASSIGNMENT = re.compile(
    r"(?P<key>(pass(word|wd|phrase)?|pwd|secret|token|api[-_]?key|apikey|"
    r"access[-_]?key|credential|cookie|session[-_]?id|private[-_]?key)[\w-]{0,40}[\"']?"
    r"\s{0,8}[:=]\s{0,8})(?!\[redacted\])(?P<value>\"[^\"]*\"|'[^']*'|[^\s&;,\"'}\]]+)",
    re.IGNORECASE,
)
# ``scheme://user:password@host``
_URL_PASSWORD = re.compile(
    r"(?P<head>\b[a-z][a-z0-9+.-]{0,30}://[^/\s:@]{1,256}:)[^@\s/]{1,256}(?=@)", re.I
)

# Candidates for layer 3 and for the entropy test.
_BASE64_RUN = re.compile(r"[A-Za-z0-9+/_-]{16,}={0,2}")
_HEX_RUN = re.compile(r"(?:[0-9a-fA-F]{2}){8,}")
# Readable encodings are looked for inside whitespace- or quote-delimited words. Every
# pattern here is linear in the text: redaction runs on untrusted input and must not be a
# way to burn CPU (no nested or unbounded quantifiers in front of a required literal).
_WORD = re.compile(r"[^\s\"'<>]+")
_PERCENT_ESCAPE = re.compile(r"%[0-9A-Fa-f]{2}")
_JSON_ESCAPE = re.compile(r"\\u[0-9a-fA-F]{4}")
_HIGH_ENTROPY_RUN = re.compile(r"[A-Za-z0-9+/_=-]{32,}")
# Our own public ids (prj_01J..., a prefix and a ULID) look random but are never secret, and
# they are what audit records, events and links refer to; they are judged as absent.
_PUBLIC_ID = re.compile(
    r"(?:%s)_[0-9A-HJKMNP-TV-Z]{26}" % "|".join(sorted(PREFIXES))  # noqa: UP031
)
_HEX_ONLY = re.compile(r"^[0-9a-fA-F]+$")
# The fewest characters a match of _KNOWN_SECRET ("Basic " and eight) and of _HEX_RUN and
# _BASE64_RUN can have: shorter text is not searched for them.
SHORTEST_KNOWN_SECRET = 14
SHORTEST_ENCODED_RUN = 16

HIGH_ENTROPY_MIN_LENGTH = 32
# Bits per character. Random base64 or alphanumerics score about 4.7-5.0 at this length;
# identifiers, paths and words stay well under 4.2; hex cannot exceed 4.0.
HIGH_ENTROPY_MIN_BITS = 4.2


def shannon_entropy(text: str) -> float:
    """Bits per character of ``text``'s own symbol distribution."""
    if not text:
        return 0.0
    counts = Counter(text)
    total = len(text)
    return -sum(n / total * math.log2(n / total) for n in counts.values())


def looks_high_entropy(candidate: str) -> bool:
    """A long run that mixes letter cases and digits and carries near-random entropy."""
    if len(candidate) < HIGH_ENTROPY_MIN_LENGTH or _HEX_ONLY.match(candidate):
        return False
    classes = sum(
        (
            any(c.islower() for c in candidate),
            any(c.isupper() for c in candidate),
            any(c.isdigit() for c in candidate),
        )
    )
    return classes >= 3 and shannon_entropy(candidate) >= HIGH_ENTROPY_MIN_BITS


def redact_text(text: str) -> str:
    """Mask every secret-like value in ``text``, including encoded forms of one."""
    return _redact_text(text, depth=0)


def _redact_text(text: str, *, depth: int) -> str:
    # Most strings are short words (keys, names, states): each pass runs only where the text
    # has what its pattern cannot match without, which changes no result (test_redaction).
    if len(text) >= SHORTEST_KNOWN_SECRET:
        text = _KNOWN_SECRET.sub(MASK, text)
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: m.group("head") + MASK, text)
    if ":" in text or "=" in text:
        text = _ASSIGNMENT.sub(_mask_assignment, text)
    if depth < MAX_DECODE_DEPTH:
        if "%" in text or "\\u" in text:
            text = _WORD.sub(lambda m: _decode_word(m.group(), depth), text)
        if len(text) >= SHORTEST_ENCODED_RUN:
            text = _HEX_RUN.sub(lambda m: _mask_if_secret(m.group(), _hex_decode, depth), text)
            text = _BASE64_RUN.sub(
                lambda m: _mask_if_secret(m.group(), _base64_decode, depth), text
            )
    if len(text) < HIGH_ENTROPY_MIN_LENGTH:
        return text
    return _HIGH_ENTROPY_RUN.sub(_mask_high_entropy, text)


def _mask_high_entropy(match: re.Match) -> str:
    run = match.group()
    return MASK if looks_high_entropy(_PUBLIC_ID.sub("", run)) else run


def _mask_assignment(match: re.Match) -> str:
    value = match.group("value")
    if value in {'""', "''"} or value == MASK:
        return match.group()
    return match.group("key") + MASK


def _decode_word(word: str, depth: int) -> str:
    if _PERCENT_ESCAPE.search(word):
        word = _decoded_if_secret(word, _url_decode, depth)
    if _JSON_ESCAPE.search(word):
        word = _decoded_if_secret(word, _json_unescape, depth)
    return word


def _decoded_if_secret(candidate: str, decode, depth: int) -> str:
    """For readable encodings: show the decoded text with its secrets masked, if it had any."""
    decoded = decode(candidate)
    if decoded is None or decoded == candidate:
        return candidate
    cleaned = _redact_text(decoded, depth=depth + 1)
    return cleaned if cleaned != decoded else candidate


def _mask_if_secret(candidate: str, decode, depth: int) -> str:
    """For opaque encodings (base64, hex): mask the whole run when what it hides is a secret."""
    decoded = decode(candidate)
    if decoded is None:
        return candidate
    return MASK if _redact_text(decoded, depth=depth + 1) != decoded else candidate


def _url_decode(candidate: str) -> str | None:
    return unquote(candidate.replace("+", " ")) if "%" in candidate else None


def _json_unescape(candidate: str) -> str | None:
    try:
        return json.loads(f'"{candidate}"')
    except ValueError:
        return None


def _hex_decode(candidate: str) -> str | None:
    try:
        return _printable(bytes.fromhex(candidate))
    except ValueError:
        return None


def _base64_decode(candidate: str) -> str | None:
    padded = candidate + "=" * (-len(candidate) % 4)
    for altchars in (b"+/", b"-_"):
        try:
            raw = base64.b64decode(padded, altchars=altchars, validate=True)
        except (binascii.Error, ValueError):
            continue
        text = _printable(raw)
        if text is not None:
            return text
    return None


def _printable(raw: bytes) -> str | None:
    """Decoded bytes worth re-checking: text, not random binary (which hides nothing)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if not text or sum(c.isprintable() or c in "\n\r\t" for c in text) < 0.95 * len(text):
        return None
    return text


def is_secret_key(key: object) -> bool:
    return bool(_SECRET_KEY.search(str(key)))


def redact(value: Any, *, _depth: int = 0) -> Any:
    """Mask secret-like keys and values in JSON-like data (dict keys are checked too)."""
    if _depth > MAX_DEPTH:
        return TRUNCATED
    if isinstance(value, dict):
        return {
            redact_text(str(key)): _mask_keyed(item)
            if is_secret_key(key)
            else redact(item, _depth=_depth + 1)
            for key, item in value.items()
        }
    if isinstance(value, list | tuple | set | frozenset):
        return [redact(item, _depth=_depth + 1) for item in value]
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, bytes):
        return redact_text(value.decode("utf-8", errors="replace"))
    return value


def _mask_keyed(item: Any) -> Any:
    # Emptiness and booleans hide nothing and say something useful ("no password set").
    if item is None or isinstance(item, bool) or item in ("", [], {}):
        return item
    # One of our public ids names a record, never holds its secret ("credential":
    # "crd_...", "token": "tok_..."): a person approving a call must see which one it uses.
    if isinstance(item, str) and _PUBLIC_ID.fullmatch(item):
        return item
    return MASK


# Arguments whose values are write-only: a mapping of names to values (the environment
# overlay of shell.exec and code.python) is kept and shown as its names and a fingerprint
# of each value. The runner still gets the values, in the signed command.
WRITE_ONLY_ARGUMENTS = frozenset({"env"})
FINGERPRINT_PREFIX = "sha256:"
_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{16}")
_FINGERPRINT_PURPOSE = b"kestrel-one write-only value fingerprints v1"


@lru_cache(maxsize=4)
def _fingerprint_key(root: str) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_FINGERPRINT_PURPOSE).derive(
        root.encode()
    )


def fingerprint(value: str) -> str:
    """What may be kept and shown instead of a write-only value: enough to tell two values
    apart (``sha256:`` and 16 hex digits of an HMAC keyed from ``SECRET_KEY``), not enough
    to guess a short one offline."""
    if _FINGERPRINT.fullmatch(value):
        return value  # already a fingerprint: redacting what was stored changes nothing
    key = _fingerprint_key(settings.SECRET_KEY)
    return FINGERPRINT_PREFIX + hmac.new(key, value.encode(), hashlib.sha256).hexdigest()[:16]


def redact_arguments(args: Any) -> Any:
    """A tool call's arguments as they may be stored and shown: write-only values replaced by
    their fingerprint, everything else through ``redact``."""
    if not isinstance(args, dict):
        return redact(args)
    shown = redact({k: v for k, v in args.items() if k not in WRITE_ONLY_ARGUMENTS})
    for name in WRITE_ONLY_ARGUMENTS & args.keys():
        overlay = args[name]
        shown[name] = (
            {
                redact_text(str(key)): fingerprint(value) if isinstance(value, str) else MASK
                for key, value in overlay.items()
            }
            if isinstance(overlay, dict)
            else MASK
        )
    return shown


def hidden_paths(shown: Any, *, _at: str = "") -> list[str]:
    """Where redaction hid a value in ``shown`` (what ``redact_arguments`` made of a call's
    arguments): the path of each string holding ``MASK`` or a write-only fingerprint, such as
    ``argv[2]`` or ``env.API_KEY``. A person approving the call sees these only masked, while
    the call runs with the real values."""
    if isinstance(shown, dict):
        return [
            path
            for key, item in shown.items()
            for path in hidden_paths(item, _at=f"{_at}.{key}" if _at else str(key))
        ]
    if isinstance(shown, list):
        return [
            path
            for index, item in enumerate(shown)
            for path in hidden_paths(item, _at=f"{_at}[{index}]")
        ]
    if isinstance(shown, str) and (MASK in shown or _FINGERPRINT.fullmatch(shown)):
        return [_at or "(the arguments)"]
    return []


# A write-only value shorter than this is not looked for in output: "1" or "yes" would mask
# half of any text, and says nothing by itself.
KNOWN_VALUE_MIN_CHARS = 6


def write_only_values(args: Any) -> list[str]:
    """The write-only values of a call's exact arguments, to be masked in its output."""
    if not isinstance(args, dict):
        return []
    return [
        value
        for name in WRITE_ONLY_ARGUMENTS & args.keys()
        if isinstance(args[name], dict)
        for value in args[name].values()
        if isinstance(value, str) and len(value) >= KNOWN_VALUE_MIN_CHARS
    ]


def redact_result(result: Any, *, known: list[str] | tuple[str, ...] = ()) -> Any:
    """A runner's reported result or error as it may be stored and shown: ``known`` values
    (the call's own write-only values, which a tool may print) masked wherever they appear,
    then everything through ``redact``."""
    if known:
        result = _mask_known(result, sorted(set(known), key=len, reverse=True))
    return redact(result)


def _mask_known(value: Any, known: list[str], depth: int = 0) -> Any:
    if depth > MAX_DEPTH:
        return TRUNCATED
    if isinstance(value, dict):
        return {key: _mask_known(item, known, depth + 1) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_mask_known(item, known, depth + 1) for item in value]
    if isinstance(value, str):
        for secret in known:
            value = value.replace(secret, MASK)
    return value


def bounded(value: Any, *, max_bytes: int = 8192) -> Any:
    """Redact, then keep the JSON form under ``max_bytes``, marking what was cut.

    Long strings are shortened first, then long lists and dicts, halving the allowance
    until the value fits; each cut leaves ``[truncated]`` where it happened. If even the
    tightest shape is too big (a very wide structure), the result is a preview string.
    """
    clean = redact(value)
    if _json_size(clean) <= max_bytes:
        return clean
    max_items = 64
    max_chars = max(16, max_bytes // 4)
    while max_chars >= 16:
        shrunk = _shrink(clean, max_chars=max_chars, max_items=max_items, depth=0)
        if _json_size(shrunk) <= max_bytes:
            return shrunk
        max_chars //= 2
        max_items = max(4, max_items // 2)
    encoded = json.dumps(clean, sort_keys=True, default=str)
    return {TRUNCATED: True, "preview": encoded[: max(0, max_bytes - 64)]}


def _json_size(value: Any) -> int:
    return len(json.dumps(value, sort_keys=True, default=str).encode())


def _shrink(value: Any, *, max_chars: int, max_items: int, depth: int) -> Any:
    if depth > MAX_DEPTH:
        return TRUNCATED
    if isinstance(value, str):
        if len(value) <= max_chars:
            return value
        return f"{value[:max_chars]}{TRUNCATED}"
    if isinstance(value, list):
        kept = [
            _shrink(item, max_chars=max_chars, max_items=max_items, depth=depth + 1)
            for item in value[:max_items]
        ]
        if len(value) > max_items:
            kept.append(f"{TRUNCATED} {len(value) - max_items} more")
        return kept
    if isinstance(value, dict):
        keys = sorted(value, key=str)
        shrunk = {
            key: _shrink(value[key], max_chars=max_chars, max_items=max_items, depth=depth + 1)
            for key in keys[:max_items]
        }
        if len(keys) > max_items:
            shrunk[TRUNCATED] = f"{len(keys) - max_items} more keys"
        return shrunk
    return value


# Log events carry these as Python objects for the formatter, not as text to show.
_LOG_PASSTHROUGH = frozenset({"exc_info", "stack_info", "_record", "_from_structlog"})


def redact_log_event(logger, method_name: str, event_dict: dict) -> dict:
    """structlog processor: no log line carries a secret, whatever the caller bound.

    Exceptions are rendered to text first so their messages and tracebacks are redacted
    like everything else.
    """
    if event_dict.get("exc_info"):
        event_dict = structlog.processors.format_exc_info(logger, method_name, event_dict)
    return {
        key: value
        if key in _LOG_PASSTHROUGH
        else (_mask_keyed(value) if is_secret_key(key) else redact(value))
        for key, value in event_dict.items()
    }
