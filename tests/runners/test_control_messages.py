"""Control messages (``thread.end``, ``project.delete``, ``mcp.risk.end``): signed like
commands, never mistaken for one, and every forged, misaddressed, stale or unknown message
refused. Pure unit tests of ``runners.contract.tokens``; what a worker does with them is in
``test_thread_end_runner.py`` and ``test_mcp_servers.py``."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from typing import Any

import pytest

from runners.contract.canonical import canonical_json
from runners.contract.names import control_exchange
from runners.contract.tokens import (
    CONTROL_CLAIMS,
    CommandRefused,
    ControlRefused,
    sign_command,
    sign_control_message,
    verify_command,
    verify_control_message,
)
from tests.runners.test_protocol import (
    CONTROL_KEY,
    CONTROL_PUBLIC,
    POOL,
    STRANGER_KEY,
    b64,
    command_claims,
    payload_of,
)

pytestmark = pytest.mark.spec("RUN-1", "RUN-2")

SCOPE = {"org": "org_01JORG", "env": "env_01JENV", "prj": "prj_01JPRJ", "thr": "thr_01JTHR"}


def claims(**overrides: Any) -> dict[str, Any]:
    return {"aud": f"runner.{POOL}", "type": "thread.end", **SCOPE, "rsk": None, **overrides}


def signed(key: bytes = CONTROL_KEY, **overrides: Any) -> str:
    now = overrides.pop("now", None)
    ttl = overrides.pop("ttl", 120)
    return sign_control_message(claims(**overrides), key, ttl=ttl, now=now)


def refusal_code(token: Any, **kwargs: Any) -> str:
    with pytest.raises(ControlRefused) as refused:
        verify_control_message(token, control_public_key=CONTROL_PUBLIC, pool=POOL, **kwargs)
    return refused.value.code


def test_a_signed_thread_end_verifies_with_every_claim():
    token = signed()
    message = verify_control_message(token, control_public_key=CONTROL_PUBLIC, pool=POOL)
    assert (message.type, message.org, message.env, message.prj, message.thr) == (
        "thread.end",
        *SCOPE.values(),
    )
    assert message.iss == "kestrel-control" and message.aud == "runner.blue"
    assert message.exp - message.iat == 120 and message.jti.startswith("ctl_")
    assert set(payload_of(token)) == CONTROL_CLAIMS
    header = json.loads(base64.urlsafe_b64decode(token.split(".")[0] + "=="))
    assert header == {"alg": "EdDSA", "typ": "kestrel-control+jwt", "kid": "control"}


def test_the_exchange_is_per_pool_and_not_the_command_queue():
    assert control_exchange("blue") == "runner-control.blue" != "runner.blue"


def test_forged_by_another_key_is_refused():
    assert refusal_code(signed(STRANGER_KEY)) == "bad_signature"


def test_unsigned_alg_none_is_refused():
    header = b64(b'{"alg":"none","kid":"control","typ":"kestrel-control+jwt"}')
    payload = b64(canonical_json(payload_of(signed())))
    assert refusal_code(f"{header}.{payload}.") == "bad_signature"


def test_hs256_signed_with_the_public_key_bytes_is_refused():
    header = b64(b'{"alg":"HS256","kid":"control","typ":"kestrel-control+jwt"}')
    payload = b64(canonical_json(payload_of(signed())))
    mac = hmac.new(CONTROL_PUBLIC, f"{header}.{payload}".encode(), hashlib.sha256).digest()
    assert refusal_code(f"{header}.{payload}.{b64(mac)}") == "bad_signature"


def test_a_claim_changed_without_resigning_is_refused():
    header, _, signature = signed().split(".")
    payload = b64(canonical_json({**payload_of(signed()), "thr": "thr_01JSOMEONEELSE"}))
    assert refusal_code(f"{header}.{payload}.{signature}") == "bad_signature"


def test_wrong_audience_is_refused():
    assert refusal_code(signed(aud="runner.green")) == "wrong_audience"


def test_expired_and_future_messages_are_refused():
    assert refusal_code(signed(now=int(time.time()) - 600)) == "expired"
    assert refusal_code(signed(now=int(time.time()) + 600)) == "not_yet_valid"


def test_a_long_lived_message_is_refused():
    assert refusal_code(signed(ttl=3600)) == "malformed"


def test_an_unknown_type_is_refused():
    assert refusal_code(signed(type="runner.shutdown")) == "unknown_type"


@pytest.mark.parametrize(
    "change",
    [
        {"extra": "claim"},
        {"thr": None},
        {"prj": "../etc"},
        {"org": 7},
        {"iss": "someone-else"},
    ],
)
def test_a_malformed_claim_set_is_refused(change):
    assert refusal_code(signed(**change)) == "malformed"


def test_a_command_is_never_a_control_message_nor_the_other_way_round():
    command = sign_command(command_claims(**SCOPE), CONTROL_KEY)
    verify_command(command, control_public_key=CONTROL_PUBLIC, pool=POOL)  # a valid command
    assert refusal_code(command) == "malformed"
    with pytest.raises(CommandRefused) as refused:
        verify_command(signed(), control_public_key=CONTROL_PUBLIC, pool=POOL)
    assert refused.value.code == "malformed"


@pytest.mark.parametrize("token", [None, "", "a.b", "not.a.token", 42])
def test_garbage_is_refused(token):
    assert refusal_code(token) in {"malformed", "bad_signature"}


def test_a_project_delete_names_no_thread_and_a_thread_end_must_name_one():
    """``project.delete`` is about a whole project (``thr`` null); a ``thread.end`` without a
    thread, or a ``project.delete`` naming one, is malformed."""
    token = signed(type="project.delete", thr=None)
    message = verify_control_message(token, control_public_key=CONTROL_PUBLIC, pool=POOL)
    assert (message.type, message.prj, message.thr) == ("project.delete", SCOPE["prj"], None)
    assert refusal_code(signed(type="thread.end", thr=None)) == "malformed"
    assert refusal_code(signed(type="project.delete")) == "malformed"


RISK = "rsk_01JRISKACCEPTANCE"


def test_an_mcp_risk_end_names_the_acceptance_and_no_project_or_thread():
    """``mcp.risk.end`` is about a risk acceptance of the environment (``rsk``); naming a
    project or a thread with it, or an acceptance with another type, is malformed."""
    token = signed(type="mcp.risk.end", prj=None, thr=None, rsk=RISK)
    message = verify_control_message(token, control_public_key=CONTROL_PUBLIC, pool=POOL)
    assert (message.type, message.org, message.env, message.prj, message.thr, message.rsk) == (
        "mcp.risk.end",
        SCOPE["org"],
        SCOPE["env"],
        None,
        None,
        RISK,
    )
    assert refusal_code(signed(type="mcp.risk.end", prj=None, thr=None)) == "malformed"
    assert refusal_code(signed(type="mcp.risk.end", thr=None, rsk=RISK)) == "malformed"
    assert refusal_code(signed(type="mcp.risk.end", prj=None, rsk=RISK)) == "malformed"
    assert refusal_code(signed(type="mcp.risk.end", prj=None, thr=None, rsk="../x")) == (
        "malformed"
    )
    assert refusal_code(signed(rsk=RISK)) == "malformed"
    assert refusal_code(signed(type="project.delete", thr=None, rsk=RISK)) == "malformed"
