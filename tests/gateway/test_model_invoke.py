"""``model.invoke`` as a control-tier tool: judged as an action, run by the control tier's
worker, the prompt and completion in thread events, audit and receipt with sizes only."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from django.db import connection

from kestrel_one.audit.models import AuditRecord
from kestrel_one.common.errors import KestrelError
from kestrel_one.execution.models import Action, ActionState
from kestrel_one.execution.services import action_request
from kestrel_one.gateway.invoke import model_invoke_run
from kestrel_one.gateway.models import ModelUsage
from kestrel_one.threads.models import ThreadEvent
from kestrel_one.threads.services import thread_create
from tests.execution.workers import adapters_worker
from tests.gateway.conftest import gateway_world_make
from tests.support import stop

PROMPT = "Summarise the launch checklist"
ARGS = {
    "provider": "openai",
    "model": "gpt-4o-mini",
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
    "max_tokens": 64,
}


def member_principal(world):
    from kestrel_one.accounts.principal import Principal, PrincipalKind

    actor = world.member
    return Principal(PrincipalKind.TOKEN, user=actor.user, token=actor.token)


def thread_of(world):
    return thread_create(
        actor=member_principal(world), project=world.project, title="t", mode="agent"
    )


@pytest.mark.spec("CRED-1", "CRED-2")
def test_a_model_call_runs_in_the_control_tier_and_keeps_its_content_in_the_thread(
    gateway_world, upstream
):
    world = gateway_world
    thread = thread_of(world)
    action = action_request(
        actor=member_principal(world), thread=thread, tool="model.invoke", args=ARGS
    )
    assert action.state == ActionState.QUEUED, action.decision
    # The default credential is made explicit, so the action digest binds it.
    from kestrel_one.execution.arguments import action_arguments

    assert action_arguments(action)["credential"] == world.credentials["openai"].public_id
    assert model_invoke_run(action_id=action.public_id) == "succeeded"
    action.refresh_from_db()
    assert action.state == ActionState.SUCCEEDED
    assert action.result["content"] == "Hello from the Kestrel test upstream."
    assert action.result["usage"]["charged"] == action.result["usage"]["input"] + 6
    usage = ModelUsage.objects.get(public_id=action.result["usage_record"])
    assert usage.action_id == action.pk and usage.surface == "tool"
    assert usage.policy_version == action.policy_version  # the versions that judged the call
    kinds = list(ThreadEvent.objects.filter(thread=thread).values_list("kind", "data"))
    prompts = [d["content"] for k, d in kinds if k == "model.prompt"]
    assert prompts == ["Be brief.", PROMPT]
    completions = [d["content"] for k, d in kinds if k == "model.completion"]
    assert completions == ["Hello from the Kestrel test upstream."]
    receipt = action.receipt
    assert receipt.evidence["request_sha256"] == usage.request_sha256
    assert receipt.evidence["usage_record"] == usage.public_id
    assert len(upstream.requests(host="openai")) == 1
    secret = upstream.secret("openai")
    for record in AuditRecord.objects.filter(organization=world.org):
        stored = json.dumps(record.data)
        assert PROMPT not in stored and "Hello from the Kestrel" not in stored
        assert secret not in stored
    assert PROMPT not in json.dumps(receipt.evidence)


def test_a_long_completion_or_prompt_is_kept_whole_in_numbered_parts(gateway_world, upstream):
    world = gateway_world
    thread = thread_of(world)
    long_prompt = "word " * 2000  # 10000 bytes: four parts of at most 3000
    args = {**ARGS, "messages": [{"role": "user", "content": long_prompt}]}
    action = action_request(
        actor=member_principal(world), thread=thread, tool="model.invoke", args=args
    )
    model_invoke_run(action_id=action.public_id)
    parts = list(
        ThreadEvent.objects.filter(thread=thread, kind="model.prompt").values_list(
            "data", flat=True
        )
    )
    assert [p["part"] for p in parts] == [1, 2, 3, 4] and {p["parts"] for p in parts} == {4}
    assert "".join(p["content"] for p in parts) == long_prompt


@pytest.mark.spec("CRED-1", "AUD-2")
def test_a_secret_across_a_parts_cut_is_redacted_and_no_character_is_lost(gateway_world, upstream):
    """Each part used to be cut from the raw bytes and redacted on its own: a token across
    the 3000-byte cut was two halves no pattern knows, joined whole again by any reader of
    the thread; a character across a cut was dropped from both parts, and 3000 bytes of
    accented text, escaped as JSON, were over the event bound and cut short. The text is
    redacted whole, then cut between characters by its size as JSON."""
    world = gateway_world
    thread = thread_of(world)
    token = "ghp_" + "Ab3dE5gH7jK9mN1pQ3sT5vW7yZ9bC1dE3fG5"
    prompt = "x" * 2980 + " " + token + " " + "é" * 1600  # the cut in the token, then in é
    args = {**ARGS, "messages": [{"role": "user", "content": prompt}]}
    action = action_request(
        actor=member_principal(world), thread=thread, tool="model.invoke", args=args
    )
    model_invoke_run(action_id=action.public_id)
    parts = [
        data["content"]
        for data in ThreadEvent.objects.filter(thread=thread, kind="model.prompt")
        .order_by("sequence")
        .values_list("data", flat=True)
    ]
    assert len(parts) > 1 and all(len(json.dumps(part)) - 2 <= 3000 for part in parts)
    joined = "".join(parts)
    assert token not in joined and token[:20] not in joined
    assert joined == "x" * 2980 + " [redacted] " + "é" * 1600


def test_a_provider_failure_fails_the_action_and_releases_the_budget(gateway_world, upstream):
    world = gateway_world
    thread = thread_of(world)
    args = {**ARGS, "model": "kestrel-upstream-error"}
    action = action_request(
        actor=member_principal(world), thread=thread, tool="model.invoke", args=args
    )
    assert model_invoke_run(action_id=action.public_id) == "failed"
    action.refresh_from_db()
    assert action.state == ActionState.FAILED
    assert action.error["code"] == "upstream_error"
    usage = ModelUsage.objects.get(action=action)
    assert (usage.outcome, usage.charged_tokens) == ("upstream_error", 0)
    # A second delivery of the same task sends nothing.
    assert model_invoke_run(action_id=action.public_id) == "not-queued"
    assert len(upstream.requests(host="openai")) == 1


def test_a_model_the_policy_does_not_name_is_denied_as_an_action(gateway_world, upstream):
    world = gateway_world
    action = action_request(
        actor=member_principal(world),
        thread=thread_of(world),
        tool="model.invoke",
        args={**ARGS, "model": "gpt-4o"},
    )
    assert action.state == ActionState.DENIED
    assert "openai/gpt-4o" in " ".join(action.decision["reasons"])
    assert upstream.requests() == []


@pytest.mark.parametrize(
    "args, field",
    [
        (
            {
                **ARGS,
                "provider": "anthropic",
                "model": "claude-3-5-haiku-latest",
                "temperature": 1.5,
            },
            "args.temperature",
        ),
        ({**ARGS, "provider": "mistral"}, "args.provider"),
    ],
)
def test_arguments_the_provider_refuses_are_refused_at_request_time(
    gateway_world, upstream, args, field
):
    world = gateway_world
    with pytest.raises(KestrelError) as refused:
        action_request(
            actor=member_principal(world), thread=thread_of(world), tool="model.invoke", args=args
        )
    assert refused.value.status == 400
    assert field in json.dumps(refused.value.details)


def test_without_a_credential_the_call_is_refused_at_request_time(gateway_world, upstream):
    from kestrel_one.accounts.principal import system_principal
    from kestrel_one.credentials.services import credential_revoke

    world = gateway_world
    credential_revoke(actor=system_principal("tests"), credential=world.credentials["openai"])
    with pytest.raises(KestrelError) as refused:
        action_request(
            actor=member_principal(world), thread=thread_of(world), tool="model.invoke", args=ARGS
        )
    assert refused.value.code == "credential_missing"


@pytest.mark.django_db(transaction=True)
def test_a_real_adapters_worker_runs_the_call(upstream, tmp_path: Path):
    world = gateway_world_make(upstream)
    thread = thread_of(world)
    database = connection.settings_dict
    worker = adapters_worker(tmp_path, database=database, upstream_env=upstream.env())
    try:
        action = action_request(
            actor=member_principal(world), thread=thread, tool="model.invoke", args=ARGS
        )
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            action.refresh_from_db()
            if action.state in (ActionState.SUCCEEDED, ActionState.FAILED):
                break
            time.sleep(0.2)
    finally:
        stop(worker)
    log = (tmp_path / "adapters.log").read_text()
    assert action.state == ActionState.SUCCEEDED, (action.state, action.error, log[-3000:])
    assert action.result["content"] == "Hello from the Kestrel test upstream."
    assert upstream.secret("openai") not in log
    assert ModelUsage.objects.get(action=action).state == "settled"
    assert Action.objects.get(pk=action.pk).receipt.runner == "control-tier"


@pytest.mark.spec("RUN-1", "CRED-5")
def test_arguments_changed_after_the_decision_are_refused_by_the_worker(gateway_world, upstream):
    """Changed between the decision and the worker (another model, say): the worker checks
    the action digest, as adapter.invoke's does, and sends nothing."""
    from kestrel_one.execution.arguments import (
        action_arguments,
        arguments_sealed,
        arguments_shown,
    )

    world = gateway_world
    action = action_request(
        actor=member_principal(world), thread=thread_of(world), tool="model.invoke", args=ARGS
    )
    assert action.state == ActionState.QUEUED, action.decision
    changed = {**action_arguments(action), "model": "kestrel-echo-credential-ok"}
    shown = arguments_shown(changed)
    Action.objects.filter(pk=action.pk).update(
        args=shown, sealed_args=arguments_sealed(changed, shown)
    )
    assert model_invoke_run(action_id=action.public_id) == "failed"
    action.refresh_from_db()
    assert action.error["code"] == "arguments_changed"
    assert upstream.requests(host="openai") == []
    assert not ModelUsage.objects.filter(action=action).exists()  # nothing reserved
