"""An accepted plan step runs once, unless the plan says how many times (``uses``)."""

from __future__ import annotations

import pytest
from django.test import override_settings

from kestrel_one.execution.models import Action
from tests.execution.test_actions_api import broker, new_thread, request_action, threads_url

__all__ = ["broker"]


def accepted_plan(world, steps: list[dict]) -> tuple[str, str]:
    member = world["member"].client()
    thread = new_thread(member, world, "plan")
    plan = member.post(f"{threads_url(world)}/{thread}/plans", {"steps": steps}, format="json")
    assert plan.status_code == 201, plan.content
    plan_id = plan.json()["id"]
    accepted = world["admin"].client().post(f"{threads_url(world)}/{thread}/plans/{plan_id}/accept")
    assert accepted.status_code == 200, accepted.content
    return thread, plan_id


@pytest.mark.spec("POL-4", "AUD-3")
def test_an_accepted_step_runs_once(world, broker):
    args = {"path": "src/app.py", "content": "v2"}
    thread, plan_id = accepted_plan(world, [{"tool": "fs.write", "args": args}])
    member = world["member"].client()
    step = {"plan": plan_id, "step": 0}
    first = request_action(member, world, thread, "fs.write", args, plan_step=step)
    assert first.status_code == 201 and first.json()["state"] == "queued", first.content
    again = request_action(member, world, thread, "fs.write", args, plan_step=step)
    assert again.status_code == 409, again.content
    error = again.json()["error"]
    assert error["details"] == {"plan_step.step": ["used 1 of 1"]}
    assert "propose and accept a new plan" in error["message"]
    assert Action.objects.filter(plan__public_id=plan_id).count() == 1  # nothing recorded
    shown = member.get(f"{threads_url(world)}/{thread}/plans/{plan_id}").json()
    assert shown["steps"][0]["uses"] == 1 and shown["steps"][0]["used"] == 1


@pytest.mark.spec("POL-4")
def test_a_plan_can_allow_a_step_several_uses(world, broker):
    args = {"path": "src/app.py"}
    thread, plan_id = accepted_plan(world, [{"tool": "fs.read", "args": args, "uses": 2}])
    member = world["member"].client()
    step = {"plan": plan_id, "step": 0}
    for _ in range(2):
        ran = request_action(member, world, thread, "fs.read", args, plan_step=step)
        assert ran.status_code == 201, ran.content
    third = request_action(member, world, thread, "fs.read", args, plan_step=step)
    assert third.status_code == 409
    assert third.json()["error"]["details"] == {"plan_step.step": ["used 2 of 2"]}


@override_settings(KESTREL_PLAN_STEP_MAX_USES=3)
def test_uses_are_bounded_by_a_setting(world, broker):
    member = world["member"].client()
    thread = new_thread(member, world, "plan")
    for uses in (0, 4):
        refused = member.post(
            f"{threads_url(world)}/{thread}/plans",
            {"steps": [{"tool": "fs.read", "args": {"path": "a"}, "uses": uses}]},
            format="json",
        )
        assert refused.status_code == 400, (uses, refused.content)
        assert refused.json()["error"]["details"] == {"steps[0].uses": ["out of range"]}
        assert "KESTREL_PLAN_STEP_MAX_USES" in refused.json()["error"]["message"]
