"""One redaction module for audit, events, receipts, logs and webhooks (AUD-2, CRED-1).

The table plants one secret in many shapes, encodings included, and checks that it never
survives; the second half checks that ordinary values (ids, hashes, paths, prose) do.
"""

from __future__ import annotations

import base64
import io
import json
import logging
from urllib.parse import quote

import pytest
import structlog
from django.conf import settings

from kestrel_one.common.redaction import (
    MASK,
    TRUNCATED,
    bounded,
    fingerprint,
    redact,
    redact_arguments,
    redact_log_event,
    redact_result,
    redact_text,
    write_only_values,
)

# The planted secret: a Kestrel token in the real format.
PLANTED = "kst_abcdefghijkl_Q3vJ9xKp2LmN8rT5wYz1BcD4eFg7HiJ0kLmNoPqRsTu"
GITHUB = "ghp_" + "A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8"
SLACK = "xoxb-" + "1234567890-0987654321-AbCdEfGhIjKlMnOpQrStUvWx"
AWS = "AKIA" + "IOSFODNN7EXAMPLE"
STRIPE = "sk_live_" + "4eC39HqLyjWDarjtT1zdp7dc"
JWT = (
    "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9."
    "eyJzdWIiOiIxMjM0NTY3ODkwIiwibmFtZSI6IkpvaG4ifQ."
    "SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"
)
PEM = (
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7\n"
    "-----END PRIVATE KEY-----"
)
HIGH_ENTROPY = "Zq8Lr3Vw0Xn5Tb7Hk2Md9Pf4Sj6Gc1Ya8Ue3Ri0Wo5"


def percent_encode_all(text: str) -> str:
    return "".join(f"%{byte:02X}" for byte in text.encode())


def json_escape_all(text: str) -> str:
    return "".join(f"\\u{ord(char):04x}" for char in text)


SECRET_TEXTS = [
    (
        "kestrel share token in a path",
        "GET /api/v1/shared/ksh_Zq7Zq7Zq7Zq7Zq7Zq7Zq7Zq7Zq7Zq7/content",
    ),
    ("webhook signing secret", "secret whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw was rotated"),
    ("kestrel token", PLANTED),
    ("kestrel token in a sentence", f"the token is {PLANTED}, keep it"),
    ("kestrel token glued to text", f"token:{PLANTED}"),
    ("bearer header", f"Authorization: Bearer {PLANTED}"),
    ("x-kestrel-token header line", f"X-Kestrel-Token: {PLANTED}"),
    ("base64", base64.b64encode(PLANTED.encode()).decode()),
    ("base64 url-safe, unpadded", base64.urlsafe_b64encode(PLANTED.encode()).decode().rstrip("=")),
    ("base64 in a sentence", f"blob={base64.b64encode(PLANTED.encode()).decode()} end"),
    ("hex", PLANTED.encode().hex()),
    ("hex upper case", PLANTED.encode().hex().upper()),
    ("url-encoded, every byte", percent_encode_all(PLANTED)),
    ("url-encoded in a query", f"https://x.example/cb?next=1&t={percent_encode_all(PLANTED)}"),
    ("url-encoded quote()", quote(f"token {PLANTED}")),
    ("json-escaped", json_escape_all(PLANTED)),
    ("json-escaped partly", PLANTED.replace("k", "\\u006b")),
    ("inside a JSON document", json.dumps({"note": PLANTED})),
    ("base64 of url-encoded", base64.b64encode(percent_encode_all(PLANTED).encode()).decode()),
    ("hex of json", json.dumps({"t": PLANTED}).encode().hex()),
    ("github classic", GITHUB),
    ("github fine-grained", "github_pat_11ABCDEFG0123456789_abcdefghijklmnopqrstuvwxyz0123"),
    ("slack bot", SLACK),
    ("slack webhook", "https://hooks.slack.com/services/T000/B000/XXXXXXXXXXXXXXXX"),
    ("aws access key id", f"aws_access_key_id = {AWS}"),
    ("aws key alone", AWS),
    ("stripe live", STRIPE),
    ("openai style", "sk-proj-" + "abcDEF123456ghiJKL789012mnoPQR"),
    ("google api key", "AIza" + "SyA1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q"),
    ("gitlab", "glpat-" + "abcdefghij1234567890"),
    ("jwt", JWT),
    ("pem private key", PEM),
    ("pem openssh key", PEM.replace("PRIVATE KEY", "OPENSSH PRIVATE KEY")),
    ("unterminated pem", "-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA"),
    ("password assignment", "password=hunter2"),
    ("json password in text", '{"db_password": "hunter2"}'),
    ("api key assignment", "API_KEY: hunter2hunter2"),
    ("cookie header", "Cookie: sessionid=abc123def456"),
    ("url userinfo", "postgres://admin:hunter2@db.internal:5432/prod"),
    ("basic auth", "Authorization: Basic YWRtaW46aHVudGVyMg=="),
    ("high entropy run", f"value {HIGH_ENTROPY} here"),
    ("base64 of random bytes", base64.b64encode(bytes(range(7, 47))).decode()),
]

# Words that must not survive: the planted secret and its recognisable pieces.
FORBIDDEN = [
    PLANTED,
    "Q3vJ9xKp2LmN8rT5",
    GITHUB,
    SLACK,
    AWS,
    STRIPE,
    JWT,
    "MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7",
    "MIIEpAIBAAKCAQEA",
    "hunter2",
    "abc123def456",
    HIGH_ENTROPY,
    "T000/B000",
    "abcdefghij1234567890",
]


@pytest.mark.spec("AUD-2", "CRED-1")
@pytest.mark.parametrize(("case", "text"), SECRET_TEXTS, ids=[c for c, _ in SECRET_TEXTS])
def test_secret_values_are_masked_in_every_shape(case, text):
    redacted = redact_text(text)
    assert MASK in redacted, case
    for forbidden in FORBIDDEN:
        assert forbidden not in redacted, (case, forbidden)
    # Masking is stable: redacting twice changes nothing more.
    assert redact_text(redacted) == redacted


SECRET_KEYS = [
    "password",
    "db_password",
    "passphrase",
    "secret",
    "client_secret",
    "token",
    "access_token",
    "Authorization",
    "api_key",
    "X-Api-Key",
    "apikey",
    "cookie",
    "Set-Cookie",
    "private_key",
    "signing_key",
    "credentials",
    "sessionid",
    "auth",
    "dsn",
]


@pytest.mark.spec("AUD-2", "CRED-1")
@pytest.mark.parametrize("key", SECRET_KEYS)
def test_secret_like_keys_mask_any_value(key):
    data = {key: "plain", "nested": [{key: 12345}], "kept": "visible"}
    assert redact(data) == {key: MASK, "nested": [{key: MASK}], "kept": "visible"}


KEPT_TEXTS = [
    ("public id", "prj_01J8ZK3Q4W5E6R7T8Y9U0I1O2P"),
    ("sha-256 digest", "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"),
    ("uuid", "3f2504e0-4f89-11d3-9a0c-0305e82c3301"),
    ("path", "src/kestrel_one/audit/management/commands/audit_verify.py"),
    ("identifier", "ThisIsAVeryLongIdentifierNameForTesting"),
    ("prose", "The approver denied the action because the path was outside src."),
    ("url without secrets", "https://api.github.com:443/repos/acme/launchpad?page=2"),
    ("iso time", "2026-11-29T15:06:00+00:00"),
    ("policy glob", "capabilities.fs.write.paths[0] = src/**"),
    ("no password set", "password="),
    ("api path with ids", "/api/v1/orgs/acme/projects/prj_01M8KX6BSFTSQKWHRZS9QHWS6A/threads"),
    (
        "policy version label",
        "env:pol_01M8KX6BSFTSQKWHRZS9QHWS6A+prj:pol_01M8KX7CBK2V3S9W0Q1TE4N5D8+mode:agent+surface:api",
    ),
]


@pytest.mark.spec("AUD-2")
@pytest.mark.parametrize(("case", "text"), KEPT_TEXTS, ids=[c for c, _ in KEPT_TEXTS])
def test_ordinary_values_are_kept(case, text):
    assert redact_text(text) == text, case


def test_keys_themselves_and_non_string_values():
    data = {PLANTED: 1, "count": 3, "ok": True, "password_set": False, "none": None}
    cleaned = redact(data)
    assert PLANTED not in json.dumps(cleaned)
    assert cleaned["count"] == 3 and cleaned["ok"] is True
    assert cleaned["password_set"] is False, "a boolean hides nothing"
    assert redact((PLANTED, b"password=hunter2")) == [MASK, "password=[redacted]"]


@pytest.mark.spec("AUD-2")
def test_bounded_cuts_with_a_marker_and_stays_under_budget():
    data = {
        "stdout": "line\n" * 10_000,
        "items": list(range(5_000)),
        "wide": {f"k{i}": i for i in range(500)},
        "secret": PLANTED,
    }
    result = bounded(data, max_bytes=2048)
    encoded = json.dumps(result)
    assert len(encoded.encode()) <= 2048
    assert TRUNCATED in encoded
    assert PLANTED not in encoded
    small = {"a": 1}
    assert bounded(small) == small, "small values are untouched"
    huge_flat = {f"key-{i}": "v" * 50 for i in range(5_000)}
    assert len(json.dumps(bounded(huge_flat, max_bytes=512)).encode()) <= 512


@pytest.mark.spec("CRED-1")
def test_log_lines_never_carry_secrets():
    event = redact_log_event(
        None,
        "info",
        {
            "event": f"called with {PLANTED}",
            "authorization": f"Bearer {PLANTED}",
            "args": {"env": {"GITHUB_TOKEN": GITHUB}, "argv": ["curl", "-u", f"me:{STRIPE}"]},
            "count": 2,
        },
    )
    assert PLANTED not in str(event) and GITHUB not in str(event) and STRIPE not in str(event)
    assert event["count"] == 2

    # Through the configured logging: structlog and the stdlib both reach the processor.
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    formatter_config = dict(settings.LOGGING["formatters"]["json"])
    handler.setFormatter(formatter_config.pop("()")(**formatter_config))
    logger = logging.getLogger("tests.redaction")
    logger.addHandler(handler)
    try:
        try:
            raise ValueError(f"bad token {PLANTED}")
        except ValueError:
            structlog.get_logger("tests.redaction").exception("failed", token=PLANTED)
        logger.warning("stdlib %s", PLANTED)
    finally:
        logger.removeHandler(handler)
    output = stream.getvalue()
    assert '"event": "failed"' in output and "stdlib" in output
    assert "ValueError" in output, "the traceback is kept, redacted"
    assert PLANTED not in output


# The shortest text each pass of redact_text can change. A pass is skipped for text without
# what its pattern needs (a length, "://", ":" or "=", "%" or "\\u"), so each of these must
# still be masked: one too strict a guard and it would come through.
SHORTEST_SECRETS = [
    ("known format", "Basic abcdefgh", MASK),
    ("assignment with =", "pwd=x", "pwd=" + MASK),
    ("assignment with :", "pwd:x", "pwd:" + MASK),
    ("url password", "a://b:c@d", "a://b:" + MASK + "@d"),
    ("url-encoded", "%70wd=x", "pwd=" + MASK),
    ("json-escaped", "\\u0070wd=x", "pwd=" + MASK),
    ("hex", b"Basic abcdefgh".hex(), MASK),
    ("base64", base64.b64encode(b"pwd=x1234567").decode(), MASK),
    ("high entropy", "aB3dE5gH7jK9mN1pQ3sT5vW7yZ9bC1dF", MASK),
]


@pytest.mark.spec("CRED-1")
@pytest.mark.parametrize(
    ("case", "text", "shown"), SHORTEST_SECRETS, ids=[c for c, _, _ in SHORTEST_SECRETS]
)
def test_the_shortest_secret_of_each_pass_is_masked(case, text, shown):
    assert redact_text(text) == shown


def test_the_length_guards_are_the_patterns_shortest_matches():
    # The guards in _redact_text are written as numbers; the patterns say what they must be.
    from re import _parser  # the parser's width is the one place that computes a minimum

    from kestrel_one.common import redaction

    def shortest(pattern) -> int:
        return _parser.parse(pattern.pattern, pattern.flags).getwidth()[0]

    assert shortest(redaction._KNOWN_SECRET) == redaction.SHORTEST_KNOWN_SECRET
    assert shortest(redaction._HEX_RUN) == redaction.SHORTEST_ENCODED_RUN
    assert shortest(redaction._BASE64_RUN) == redaction.SHORTEST_ENCODED_RUN
    assert shortest(redaction._HIGH_ENTROPY_RUN) == redaction.HIGH_ENTROPY_MIN_LENGTH


def test_redaction_is_linear_on_hostile_input():
    # No timing assertion: this finishes at all only if no pattern backtracks badly.
    for hostile in ("y" * 50_000, "a-" * 25_000, "%41" * 20_000, "password-" * 6_000):
        assert len(redact_text(hostile)) >= len(hostile) // 2


@pytest.mark.spec("CRED-1")
def test_environment_values_are_write_only_whatever_they_look_like():
    args = {"argv": ["deploy"], "env": {"REGION": "eu-west-1", "API_KEY": "plain"}}
    shown = redact_arguments(args)
    assert shown["argv"] == ["deploy"]
    assert set(shown["env"]) == {"REGION", "API_KEY"}
    assert "eu-west-1" not in json.dumps(shown) and "plain" not in json.dumps(shown)
    assert shown["env"]["REGION"] == fingerprint("eu-west-1") != fingerprint("eu-west-2")
    assert shown["env"]["REGION"].startswith("sha256:") and len(shown["env"]["REGION"]) == 23
    # Redacting what was stored again changes nothing (the API's second pass).
    assert redact_arguments(shown) == shown


@pytest.mark.spec("CRED-1")
def test_a_calls_own_write_only_values_are_masked_in_its_output():
    values = write_only_values({"env": {"TOKEN": "plainvalue-42", "N": "1"}})
    assert values == ["plainvalue-42"]  # too short to look for: "1"
    result = {"stdout": "got plainvalue-42 and 1\n", "exit_code": 0}
    assert redact_result(result, known=values) == {
        "stdout": "got [redacted] and 1\n",
        "exit_code": 0,
    }
