"""The broker's wire contract: requests and answers verify strictly or not at all (CRED-3)."""

from __future__ import annotations

import base64
import json
import time

import pytest

from runners.contract.adapter_broker import (
    AdapterBrokerRefused,
    check_adapter_request,
    new_request_id,
    sign_adapter_answer,
    sign_adapter_request,
    verify_adapter_answer,
    verify_adapter_request,
)
from runners.contract.tokens import generate_private_key_pem, load_private_key

pytestmark = pytest.mark.spec("CRED-3")

RUNNER = load_private_key(generate_private_key_pem())
CONTROL = load_private_key(generate_private_key_pem())
REQUEST = {"adapter": "github", "operation": "issues.list", "args": {"owner": "o", "repo": "r"}}


def request_token(**overrides):
    values = {
        "call_id": "act_parent",
        "command_digest": "a" * 64,
        "request": REQUEST,
        "private_key": RUNNER,
        "runner_id": "run_one",
        "lifetime_s": 60,
        **overrides,
    }
    return sign_adapter_request(**values)


def answer_token(**overrides):
    values = {
        "pool": "default",
        "request_id": "req_" + "1" * 32,
        "call_id": "act_parent",
        "action": "act_child",
        "outcome": "succeeded",
        "result": {"status": 200},
        "error": None,
        "private_key": CONTROL,
        **overrides,
    }
    return sign_adapter_answer(**values)


def verify_request(token, *, key=RUNNER, runner_id="run_one", now=None):
    return verify_adapter_request(
        token, runner_public_key=key.public_key(), runner_id=runner_id, now=now
    )


def verify_answer(token, **overrides):
    values = {
        "control_public_key": CONTROL.public_key(),
        "pool": "default",
        "request_id": "req_" + "1" * 32,
        "call_id": "act_parent",
        **overrides,
    }
    return verify_adapter_answer(token, **values)


def tampered(token: str, change) -> str:
    header, payload, signature = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    change(claims)
    body = base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode()
    return f"{header}.{body}.{signature}"


def test_a_request_verifies_with_its_runners_key_only():
    request = verify_request(request_token())
    assert (request.runner_id, request.call_id, request.request) == (
        "run_one",
        "act_parent",
        REQUEST,
    )
    assert request.request_id.startswith("req_")
    other = load_private_key(generate_private_key_pem())
    refusals = {
        "another key": lambda: verify_request(request_token(private_key=other)),
        "another runner": lambda: verify_request(request_token(), runner_id="run_two"),
        "a changed call": lambda: verify_request(
            tampered(request_token(), lambda c: c.update(call_id="act_other"))
        ),
        "a changed request": lambda: verify_request(
            tampered(request_token(), lambda c: c["request"].update(adapter="slack"))
        ),
        "expired": lambda: verify_request(request_token(), now=time.time() + 3600),
        "an answer for a request": lambda: verify_request(answer_token(), key=CONTROL),
    }
    codes = {}
    for case, verify in refusals.items():
        with pytest.raises(AdapterBrokerRefused) as refused:
            verify()
        codes[case] = refused.value.code
    assert codes == {
        "another key": "bad_signature",
        "another runner": "wrong_runner",
        "a changed call": "bad_signature",
        "a changed request": "bad_signature",
        "expired": "expired",
        "an answer for a request": "malformed",
    }


def test_a_request_carries_only_what_a_workload_may_ask():
    assert check_adapter_request({**REQUEST, "credential": "crd_01ABC", "idempotency_key": "k"})
    for bad, field in (
        ({**REQUEST, "url": "https://evil.example"}, "url"),
        ({**REQUEST, "adapter": "../etc"}, "adapter"),
        ({**REQUEST, "args": []}, "args"),
        ({**REQUEST, "credential": "crd_1", "connection": "con_1"}, "credential"),
        ({**REQUEST, "credential": "ghp_secret"}, "credential"),
        ({**REQUEST, "idempotency_key": "a b\n"}, "idempotency_key"),
        ([REQUEST], "request"),
    ):
        with pytest.raises(AdapterBrokerRefused) as refused:
            check_adapter_request(bad)
        assert refused.value.code == "invalid_request"
        assert refused.value.message.startswith(field)


def test_an_answer_verifies_for_its_pool_request_and_call_only():
    answer = verify_answer(answer_token())
    assert (answer.outcome, answer.action, answer.result) == (
        "succeeded",
        "act_child",
        {"status": 200},
    )
    refusals = {
        "a runner's key": lambda: verify_answer(answer_token(private_key=RUNNER)),
        "another pool": lambda: verify_answer(answer_token(pool="blue")),
        "another request": lambda: verify_answer(answer_token(request_id=new_request_id())),
        "another call": lambda: verify_answer(answer_token(call_id="act_other")),
        "an unknown outcome": lambda: verify_answer(answer_token(outcome="maybe")),
        "a refusal without its error": lambda: verify_answer(answer_token(outcome="denied")),
        "an error with more in it": lambda: verify_answer(
            answer_token(outcome="failed", error={"code": "x", "message": "y", "secret": "z"})
        ),
    }
    codes = {}
    for case, verify in refusals.items():
        with pytest.raises(AdapterBrokerRefused) as refused:
            verify()
        codes[case] = refused.value.code
    assert codes == {
        "a runner's key": "bad_signature",
        "another pool": "wrong_audience",
        "another request": "malformed",
        "another call": "malformed",
        "an unknown outcome": "malformed",
        "a refusal without its error": "malformed",
        "an error with more in it": "malformed",
    }
