"""The wire contract: signed commands and results, and every way a token is refused.

Pure unit tests of ``runners.contract.tokens``; the runner-side consequences (nothing executed,
refusals logged) are in ``test_worker_calls.py``.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import hmac
import json
import time
from typing import Any

import jwt
import pytest

from runners.contract.canonical import arguments_digest, canonical_json, digest, token_digest
from runners.contract.tokens import (
    COMMAND_CLAIMS,
    RESULT_CLAIMS,
    CommandRefused,
    ResultRefused,
    generate_private_key_pem,
    load_private_key,
    load_public_key,
    public_key_pem,
    sign_command,
    sign_result,
    unverified_call_id,
    unverified_runner_id,
    verify_command,
    verify_result,
)

pytestmark = pytest.mark.spec("RUN-1", "RUN-2", "RUN-7")

POOL = "blue"
CONTROL_KEY = generate_private_key_pem()
CONTROL_PUBLIC = public_key_pem(CONTROL_KEY)
STRANGER_KEY = generate_private_key_pem()
RUNNER_ID = "run_01JRUNNERA"
RUNNER_KEY = generate_private_key_pem()
RUNNER_PUBLIC = public_key_pem(RUNNER_KEY)
OTHER_RUNNER_ID = "run_01JRUNNERB"
OTHER_RUNNER_KEY = generate_private_key_pem()
OTHER_RUNNER_PUBLIC = public_key_pem(OTHER_RUNNER_KEY)


def command_claims(**overrides: Any) -> dict[str, Any]:
    """A valid fs.write command for pool ``blue``; ``overrides`` replace claims."""
    args = overrides.pop("args", {"path": "marker.txt", "content": "ran"})
    claims = {
        "iss": "kestrel-control",
        "aud": f"runner.{POOL}",
        "jti": "act_01JTESTCALL",
        "org": "org_01JORG",
        "env": "env_01JENV",
        "prj": "prj_01JPRJ",
        "thr": "thr_01JTHR",
        "tool": "fs.write",
        "args": args,
        "args_salt": "",
        "args_digest": digest(args),
        "policy_version": "pol_3",
        "limits": {"timeout_s": 30, "memory_mb": 256, "cpus": 1, "pids": 64, "output_kb": 64},
        "attempt": 1,
    }
    claims.update(overrides)
    return claims


def signed_command(**overrides: Any) -> str:
    return sign_command(command_claims(**overrides), CONTROL_KEY)


def verify(token: Any, **kwargs: Any):
    return verify_command(token, control_public_key=CONTROL_PUBLIC, pool=POOL, **kwargs)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def with_payload(token: str, payload: Any) -> str:
    """``token`` with its payload replaced and the original signature kept (no re-signing)."""
    header, _, signature = token.split(".")
    return f"{header}.{b64(canonical_json(payload))}.{signature}"


def with_header(token: str, header: dict[str, Any]) -> str:
    _, payload, signature = token.split(".")
    return f"{b64(json.dumps(header).encode())}.{payload}.{signature}"


def payload_of(token: str) -> dict[str, Any]:
    return json.loads(unb64(token.split(".")[1]))


def raw_signed(header: dict[str, Any], payload_bytes: bytes, key: bytes = CONTROL_KEY) -> str:
    """A token signed with the control key but with an arbitrary header and payload bytes."""
    return jwt.api_jws.PyJWS().encode(
        payload_bytes, load_private_key(key), algorithm="EdDSA", headers=header
    )


def altered(value: Any) -> Any:
    """A different value of the same shape, for tampering with one claim."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, str):
        return value[:-1] + ("X" if value[-1:] != "X" else "Y")
    if isinstance(value, dict):
        changed = copy.deepcopy(value)
        first = sorted(changed)[0]
        changed[first] = altered(changed[first])
        return changed
    if value is None:
        return "thr_01JOTHER"
    raise AssertionError(f"no alteration for {value!r}")


def refusal_code(token: Any, **kwargs: Any) -> str:
    with pytest.raises(CommandRefused) as refused:
        verify(token, **kwargs)
    return refused.value.code


# --- canonical form --------------------------------------------------------------------


def test_canonical_json_is_sorted_compact_utf8():
    assert canonical_json({"b": 1, "a": [1, {"d": "é", "c": None}]}) == (
        '{"a":[1,{"c":null,"d":"é"}],"b":1}'.encode()
    )


def test_digest_is_sha256_of_the_canonical_form():
    value = {"path": "x", "content": "y"}
    assert digest(value) == hashlib.sha256(b'{"content":"y","path":"x"}').hexdigest()
    assert digest({"content": "y", "path": "x"}) == digest(value)


def test_canonical_json_refuses_nan():
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})


def test_keys_round_trip_and_other_key_types_are_refused():
    assert load_public_key(public_key_pem(CONTROL_KEY)) is not None
    with pytest.raises(ValueError):
        load_public_key(CONTROL_KEY)


# --- commands that verify --------------------------------------------------------------


def test_valid_command_verifies_with_every_claim():
    token = signed_command()
    command = verify(token)
    assert command.call_id == command.jti == "act_01JTESTCALL"
    assert (command.org, command.env, command.prj, command.thr) == (
        "org_01JORG",
        "env_01JENV",
        "prj_01JPRJ",
        "thr_01JTHR",
    )
    assert command.tool == "fs.write"
    assert command.args == {"path": "marker.txt", "content": "ran"}
    assert command.args_digest == digest(command.args)
    assert command.policy_version == "pol_3"
    assert command.limits["memory_mb"] == 256
    assert command.attempt == 1
    assert command.raw == token
    assert command.command_digest == hashlib.sha256(token.encode()).hexdigest()
    assert command.exp - command.iat == 120


def test_command_header_and_payload_are_as_documented():
    token = signed_command()
    header = jwt.get_unverified_header(token)
    assert header == {"alg": "EdDSA", "typ": "kestrel-command+jwt", "kid": "control"}
    # Signed as canonical JSON: the signed bytes are the hashed bytes.
    assert unb64(token.split(".")[1]) == canonical_json(payload_of(token))
    assert set(payload_of(token)) == COMMAND_CLAIMS


def test_thread_may_be_null():
    assert verify(signed_command(thr=None)).thr is None


def test_small_clock_skew_is_tolerated():
    now = int(time.time())
    assert verify(sign_command(command_claims(), CONTROL_KEY, now=now + 3))
    assert verify(sign_command(command_claims(), CONTROL_KEY, ttl=10, now=now - 13))


# --- commands that are refused ---------------------------------------------------------


@pytest.mark.parametrize("claim", sorted(COMMAND_CLAIMS))
def test_each_signed_claim_altered_without_resigning_is_refused(claim):
    token = signed_command()
    payload = payload_of(token)
    payload[claim] = altered(payload[claim])
    assert refusal_code(with_payload(token, payload)) == "bad_signature"


@pytest.mark.parametrize(
    ("header", "code"),
    [
        ({"alg": "EdDSA", "typ": "kestrel-result+jwt", "kid": "control"}, "bad_signature"),
        ({"alg": "EdDSA", "typ": "kestrel-command+jwt", "kid": "run_01JX"}, "bad_signature"),
        # An unencoded-payload header without "crit" is not even a readable JWS header.
        (
            {"alg": "EdDSA", "typ": "kestrel-command+jwt", "kid": "control", "b64": False},
            "malformed",
        ),
    ],
)
def test_header_altered_without_resigning_is_refused(header, code):
    assert refusal_code(with_header(signed_command(), header)) == code


def test_args_changed_with_matching_digest_but_not_resigned_is_refused():
    token = signed_command()
    payload = payload_of(token)
    payload["args"] = {"path": "elsewhere.txt", "content": "evil"}
    payload["args_digest"] = digest(payload["args"])
    assert refusal_code(with_payload(token, payload)) == "bad_signature"


def test_json_nested_deeper_than_the_decoder_goes_is_refused_not_raised():
    deep = b"[" * 100_000 + b"]" * 100_000
    token = signed_command()
    _, payload, signature = token.split(".")
    deep_header = f"{b64(deep)}.{payload}.{signature}"
    assert refusal_code(deep_header) == "malformed"
    with pytest.raises(ResultRefused) as refused:
        unverified_runner_id(deep_header)
    assert refused.value.code == "malformed"
    # A validly signed token whose payload is that deep is refused the same way.
    header = {"alg": "EdDSA", "typ": "kestrel-command+jwt", "kid": "control"}
    deep_payload = raw_signed(header, deep)
    assert refusal_code(deep_payload) == "malformed"
    assert unverified_call_id(deep_payload) is None


def test_unsigned_alg_none_is_refused():
    header = b64(b'{"alg":"none","kid":"control","typ":"kestrel-command+jwt"}')
    payload = b64(canonical_json(payload_of(signed_command())))
    assert refusal_code(f"{header}.{payload}.") == "bad_signature"


def test_hs256_signed_with_the_public_key_bytes_is_refused():
    header = b64(b'{"alg":"HS256","kid":"control","typ":"kestrel-command+jwt"}')
    payload = b64(canonical_json(payload_of(signed_command())))
    mac = hmac.new(CONTROL_PUBLIC, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    assert refusal_code(f"{header}.{payload}.{b64(mac)}") == "bad_signature"


def test_command_signed_by_another_key_is_refused():
    token = sign_command(command_claims(), STRANGER_KEY)
    assert refusal_code(token) == "bad_signature"


def test_wrong_audience_is_refused():
    assert refusal_code(signed_command(aud="runner.green")) == "wrong_audience"
    assert refusal_code(signed_command(aud="kestrel-control")) == "wrong_audience"


def test_expired_command_is_refused():
    now = int(time.time())
    token = sign_command(command_claims(), CONTROL_KEY, ttl=120, now=now - 200)
    assert refusal_code(token) == "expired"
    # The same token was valid when it was issued.
    assert verify(token, now=now - 190).jti == "act_01JTESTCALL"


def test_command_from_the_future_is_refused():
    now = int(time.time())
    assert refusal_code(signed_command(nbf=now + 60, exp=now + 180)) == "not_yet_valid"
    assert refusal_code(sign_command(command_claims(), CONTROL_KEY, now=now + 60)) == (
        "not_yet_valid"
    )


def test_signed_digest_that_does_not_match_the_args_is_refused():
    token = signed_command(args_digest=digest({"path": "other", "content": "x"}))
    assert refusal_code(token) == "digest_mismatch"


def test_a_salted_digest_binds_the_salt_too():
    """A call whose shown arguments hide a value is digested with the control plane's salt
    (docs/records.md); the command carries it, and the runner checks both."""
    args = {"path": "marker.txt", "content": "ran"}
    salt = "a" * 64
    salted = arguments_digest(args, salt)
    assert salted != digest(args)
    command = verify(signed_command(args=args, args_salt=salt, args_digest=salted))
    assert (command.args_salt, command.args_digest) == (salt, salted)
    assert refusal_code(signed_command(args=args, args_salt="b" * 64, args_digest=salted)) == (
        "digest_mismatch"
    )
    assert refusal_code(signed_command(args=args, args_digest=salted)) == "digest_mismatch"


def test_unknown_tool_is_refused():
    assert refusal_code(signed_command(tool="net.fetch")) == "unknown_tool"


def test_invalid_arguments_are_refused():
    assert refusal_code(signed_command(args={"path": "../escape", "content": "x"})) == (
        "invalid_arguments"
    )
    assert refusal_code(signed_command(args={"path": "x"})) == "invalid_arguments"


def test_extra_claim_is_refused():
    assert refusal_code(signed_command(sub="admin")) == "malformed"


@pytest.mark.parametrize("claim", sorted(COMMAND_CLAIMS))
def test_each_missing_claim_is_refused(claim):
    now = int(time.time())
    claims = command_claims(iat=now, nbf=now, exp=now + 120)
    del claims[claim]
    token = raw_signed({"typ": "kestrel-command+jwt", "kid": "control"}, canonical_json(claims))
    assert refusal_code(token) == "malformed"


@pytest.mark.parametrize(
    "overrides",
    [
        {"attempt": 0},
        {"attempt": "1"},
        {"attempt": True},
        {"thr": 5},
        {"jti": "act/../../etc"},
        {"jti": ""},
        {"prj": "prj 1"},
        {"org": None},
        {"policy_version": ""},
        {"iss": "someone-else"},
        {"args_digest": "ABC"},
        {"args_salt": "ABC"},
        {"args_salt": None},
        {"limits": {"timeout_s": 30, "memory_mb": 256, "cpus": 1, "pids": 64}},
        {
            "limits": {
                "timeout_s": 30,
                "memory_mb": 256,
                "cpus": 1,
                "pids": 64,
                "output_kb": 64,
                "network": 1,
            }
        },
        {"limits": {"timeout_s": -1, "memory_mb": 256, "cpus": 1, "pids": 64, "output_kb": 64}},
        {"limits": {"timeout_s": 30, "memory_mb": 2.5, "cpus": 1, "pids": 64, "output_kb": 64}},
        {"limits": {"timeout_s": 30, "memory_mb": 256, "cpus": 0, "pids": 64, "output_kb": 64}},
        {"limits": {"timeout_s": 30, "memory_mb": 4, "cpus": 1, "pids": 64, "output_kb": 64}},
        {"limits": "unlimited"},
        {"args": ["path", "x"]},
        {"iat": "now"},
        {"exp": 1.5},
    ],
    ids=lambda overrides: ",".join(overrides),
)
def test_claims_of_the_wrong_type_are_refused(overrides):
    assert refusal_code(signed_command(**overrides)) == "malformed"


def test_command_living_longer_than_an_hour_is_refused():
    token = sign_command(command_claims(), CONTROL_KEY, ttl=7200)
    assert refusal_code(token) == "malformed"


@pytest.mark.parametrize(
    "header",
    [
        {"typ": "JWT", "kid": "control"},
        {"typ": "kestrel-result+jwt", "kid": "control"},
        {"typ": "kestrel-command+jwt", "kid": "run_01JRUNNERA"},
        {"typ": "kestrel-command+jwt", "kid": "control", "cty": "json"},
    ],
)
def test_validly_signed_wrong_header_is_refused(header):
    now = int(time.time())
    claims = command_claims(iat=now, nbf=now, exp=now + 120)
    assert refusal_code(raw_signed(header, canonical_json(claims))) == "malformed"


def test_duplicate_keys_in_the_signed_payload_are_refused():
    now = int(time.time())
    body = canonical_json(command_claims(iat=now, nbf=now, exp=now + 120))
    duplicated = body[:-1] + b',"tool":"shell.exec"}'
    token = raw_signed({"typ": "kestrel-command+jwt", "kid": "control"}, duplicated)
    assert refusal_code(token) == "malformed"


def test_signed_payload_that_is_not_an_object_is_refused():
    token = raw_signed({"typ": "kestrel-command+jwt", "kid": "control"}, b"[1,2]")
    assert refusal_code(token) == "malformed"


@pytest.mark.parametrize("token", ["", "abc", "a.b", "a.b.c", "...", None, 42, b"x.y.z"])
def test_garbage_is_refused(token):
    assert refusal_code(token) in {"malformed", "bad_signature"}


def test_unverified_call_id_reads_only_plausible_ids():
    assert unverified_call_id(signed_command()) == "act_01JTESTCALL"
    assert unverified_call_id("garbage") is None
    assert unverified_call_id(signed_command(jti="../../x")) is None


# --- results ---------------------------------------------------------------------------


def result_claims(**overrides: Any) -> dict[str, Any]:
    claims = {
        "call_id": "act_01JTESTCALL",
        "command_digest": token_digest(signed_command()),
        "attempt": 1,
        "event": "finished",
        "outcome": "succeeded",
        "result": {"path": "marker.txt", "size": 3, "sha256": "0" * 64},
        "error": None,
        "sandbox": None,
        "started_at": "2026-01-02T03:04:05.678Z",
        "finished_at": "2026-01-02T03:04:06.000+00:00",
    }
    claims.update(overrides)
    return claims


def signed_result(key: bytes = RUNNER_KEY, runner_id: str = RUNNER_ID, **overrides: Any) -> str:
    return sign_result(result_claims(**overrides), key, runner_id)


def verify_report(token: Any, key: bytes = RUNNER_PUBLIC, runner_id: str = RUNNER_ID, **kw):
    return verify_result(token, runner_public_key=key, runner_id=runner_id, **kw)


def result_refusal(token: Any, **kwargs: Any) -> str:
    with pytest.raises(ResultRefused) as refused:
        verify_report(token, **kwargs)
    return refused.value.code


def test_result_round_trip():
    token = signed_result()
    assert unverified_runner_id(token) == RUNNER_ID
    report = verify_report(token)
    assert report.runner_id == RUNNER_ID
    assert report.aud == "kestrel-control"
    assert report.exp - report.iat == 3600
    assert report.event == "finished" and report.outcome == "succeeded"
    assert report.raw == token
    assert jwt.get_unverified_header(token) == {
        "alg": "EdDSA",
        "typ": "kestrel-result+jwt",
        "kid": RUNNER_ID,
    }
    assert set(payload_of(token)) == RESULT_CLAIMS


def test_started_and_failed_reports_verify():
    started = signed_result(event="started", outcome=None, result=None, finished_at=None)
    assert verify_report(started).event == "started"
    failed = signed_result(
        outcome="failed", result=None, error={"code": "runner_lost", "message": "gone"}
    )
    assert verify_report(failed).error == {"code": "runner_lost", "message": "gone"}


@pytest.mark.parametrize("claim", sorted(RESULT_CLAIMS))
def test_each_result_claim_altered_without_resigning_is_refused(claim):
    token = signed_result()
    payload = payload_of(token)
    payload[claim] = altered(payload[claim]) if claim != "error" else {"code": "x"}
    assert result_refusal(with_payload(token, payload)) == "bad_signature"


def test_result_signed_by_another_runner_key_is_refused():
    assert result_refusal(signed_result(key=OTHER_RUNNER_KEY)) == "bad_signature"


def test_result_with_a_borrowed_kid_is_refused():
    # Signed with runner A's key while claiming to be runner B: B's key does not verify it.
    token = signed_result(key=RUNNER_KEY, runner_id=OTHER_RUNNER_ID)
    assert unverified_runner_id(token) == OTHER_RUNNER_ID
    assert (
        result_refusal(token, key=OTHER_RUNNER_PUBLIC, runner_id=OTHER_RUNNER_ID) == "bad_signature"
    )


def test_result_for_another_runner_id_is_refused():
    assert result_refusal(signed_result(), runner_id=OTHER_RUNNER_ID) == "wrong_runner"
    token = sign_result(result_claims(iss=OTHER_RUNNER_ID), RUNNER_KEY, RUNNER_ID)
    assert result_refusal(token) == "wrong_runner"


def test_result_for_another_audience_is_refused():
    assert result_refusal(signed_result(aud="runner.blue")) == "wrong_audience"


def test_expired_result_is_refused():
    token = sign_result(result_claims(), RUNNER_KEY, RUNNER_ID, now=int(time.time()) - 7200)
    assert result_refusal(token) == "expired"


@pytest.mark.parametrize(
    "overrides",
    [
        {"event": "done"},
        {"outcome": "maybe"},
        {"event": "started"},
        {"outcome": "succeeded", "result": None},
        {"outcome": "failed", "error": None, "result": None},
        {"outcome": "failed", "error": {"code": "x"}, "result": None},
        {"command_digest": "nope"},
        {"attempt": 0},
        {"started_at": "yesterday"},
        {"finished_at": "2026-01-02T03:04:06+02:00"},
        {"extra": 1},
    ],
    ids=lambda overrides: ",".join(f"{k}={v}" for k, v in overrides.items()),
)
def test_malformed_reports_are_refused(overrides):
    assert result_refusal(signed_result(**overrides)) == "malformed"


def test_result_with_alg_none_is_refused():
    header = b64(
        json.dumps({"alg": "none", "typ": "kestrel-result+jwt", "kid": RUNNER_ID}).encode()
    )
    payload = b64(canonical_json(payload_of(signed_result())))
    assert result_refusal(f"{header}.{payload}.") == "bad_signature"


@pytest.mark.parametrize("token", ["", "a.b.c", None])
def test_unverified_runner_id_refuses_garbage(token):
    with pytest.raises(ResultRefused):
        unverified_runner_id(token)
