"""HTTP endpoints for actions, approvals, receipts, verifications and plans."""

from __future__ import annotations

import math
import re
import time
from collections import Counter

from django.conf import settings
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, status
from rest_framework.exceptions import NotFound
from rest_framework.response import Response

from kestrel_one.api.base import ProjectScopedViewSet
from kestrel_one.api.serializers import RedactedSerializer, StrictSerializer
from kestrel_one.artifacts.models import Checkpoint
from kestrel_one.common.errors import ValidationFailed, echo
from kestrel_one.common.redaction import hidden_paths, redact, redact_arguments, redact_result
from kestrel_one.execution.approvals import approval_decide, verification_record
from kestrel_one.execution.checkpoints import checkpoint_restore
from kestrel_one.execution.idempotency import action_request_once
from kestrel_one.execution.models import (
    TERMINAL_STATES,
    Action,
    ActionState,
    Approval,
    Plan,
    Receipt,
    Verification,
)
from kestrel_one.execution.plans import plan_accept, plan_propose
from kestrel_one.execution.selectors import plan_step_uses, thread_actions
from kestrel_one.threads.models import Thread
from kestrel_one.threads.notify import action_watch

IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,255}$")
# States that will not change without a person: a long poll stops at them too.
SETTLED = TERMINAL_STATES | {ActionState.AWAITING_APPROVAL}
WAIT_PARAMETER = OpenApiParameter(
    "wait", int, description="long-poll up to this many seconds for the action to settle"
)


class ActionSerializer(RedactedSerializer):
    redacted_fields = {
        "args": redact_arguments,
        "decision": redact,
        "result": redact_result,
        "error": redact_result,
    }
    id = serializers.CharField(source="public_id", read_only=True)
    thread = serializers.CharField(source="thread.public_id", read_only=True)
    receipt = serializers.SerializerMethodField()
    approval = serializers.SerializerMethodField()
    plan_step = serializers.SerializerMethodField()
    # Where redaction hid a value of ``args`` from everyone, the approver included, though the
    # call runs with it (the console asks a tick to approve such a call).
    hidden_args = serializers.SerializerMethodField()

    class Meta:
        model = Action
        fields = [
            "id",
            "thread",
            "tool",
            "args",
            "hidden_args",
            "args_digest",
            "action_digest",
            "mode",
            "state",
            "decision",
            "policy_version",
            "limits",
            "requested_by",
            "flags",
            "plan_step",
            "approval",
            "result",
            "error",
            "receipt",
            "created_at",
            "dispatched_at",
            "started_at",
            "finished_at",
        ]

    def get_hidden_args(self, action) -> list[str]:
        return hidden_paths(redact_arguments(action.args))

    def get_receipt(self, action) -> str | None:
        try:
            return action.receipt.public_id
        except Receipt.DoesNotExist:
            return None

    def get_approval(self, action) -> dict | None:
        try:
            approval = action.approval
        except Approval.DoesNotExist:
            return None
        return {
            "id": approval.public_id,
            "decision": approval.decision,
            "by": approval.decided_by.public_id,
            "at": approval.created_at,
        }

    def get_plan_step(self, action) -> dict | None:
        if action.plan_id is None:
            return None
        return {"plan": action.plan.public_id, "step": action.plan_step}


class PlanStepSerializer(StrictSerializer):
    plan = serializers.CharField(max_length=40)
    step = serializers.IntegerField(min_value=0)


class ActionCreateSerializer(StrictSerializer):
    tool = serializers.CharField(max_length=100)
    args = serializers.JSONField()
    plan_step = PlanStepSerializer(required=False)


def wait_seconds(request) -> float:
    raw = request.query_params.get("wait")
    if raw is None:
        return 0.0
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    # NaN compares false with everything, so it would pass every bound below and turn the
    # long poll into a loop that never times out.
    if math.isnan(seconds):
        raise ValidationFailed("wait must be a number of seconds.", details={"wait": ["invalid"]})
    if seconds < 0:
        raise ValidationFailed("wait must not be negative.", details={"wait": ["invalid"]})
    return min(seconds, settings.KESTREL_MAX_WAIT_SECONDS)


def settle(action: Action, seconds: float, reread: QuerySet[Action] | None = None) -> Action:
    """Long-poll: wait until the action settles or ``seconds`` pass.

    Subscribes to the action's change notices before re-reading it, so a change committed
    between the read and the wait still wakes this request (kestrel_one.threads.notify).
    With ``reread`` (a queryset with the joins the caller's projection reads), the action
    returned is always one read from it, so the last read is the one the caller shows;
    without, ``action`` is refreshed in place.
    """
    if seconds <= 0 or action.state in SETTLED:
        return reread.get(pk=action.pk) if reread is not None else action

    def read() -> Action:
        if reread is not None:
            return reread.get(pk=action.pk)
        action.refresh_from_db()
        return action

    deadline = time.monotonic() + seconds
    current = None
    with action_watch(action.public_id) as wait:
        # Right after subscribing only the state is read: a call just queued has rarely
        # settled yet, and the whole row is read once something changed.
        state = Action.objects.values_list("state", flat=True).get(pk=action.pk)
        while state not in SETTLED:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            wait(remaining)
            current = read()
            state = current.state
    return current if current is not None else read()


class ActionViewSet(mixins.ListModelMixin, ProjectScopedViewSet):
    scope_map = {"GET": "projects:read", "POST": "projects:write"}
    queryset = Action.objects.none()
    serializer_class = ActionSerializer
    lookup_url_kwarg = "act"
    filterset_fields = {"state": ["exact"], "tool": ["exact"]}

    def restrict(self, queryset):
        return thread_actions(self.thread)

    @extend_schema(parameters=[WAIT_PARAMETER], responses={200: ActionSerializer})
    def retrieve(self, request, *args, **kwargs):
        seconds = wait_seconds(request)
        # Read through restrict(): already with the joins the serializer reads.
        action = self.get_object()
        if seconds:
            action = settle(action, seconds, reread=thread_actions(self.thread))
        return Response(ActionSerializer(action).data)

    @extend_schema(
        request=ActionCreateSerializer,
        responses={201: ActionSerializer},
        parameters=[
            WAIT_PARAMETER,
            OpenApiParameter("Idempotency-Key", str, location=OpenApiParameter.HEADER),
        ],
    )
    def create(self, request, *args, **kwargs):
        seconds = wait_seconds(request)
        key = request.headers.get("Idempotency-Key")
        if key is not None and not IDEMPOTENCY_KEY.match(key):
            raise ValidationFailed(
                "Idempotency-Key must be 1-255 visible ASCII characters.",
                details={"Idempotency-Key": ["invalid"]},
            )
        data = ActionCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        status_code, body, action = action_request_once(
            actor=self.principal,
            thread=self.thread,
            key=key,
            raw_body=request.data,
            tool=values["tool"],
            args=values["args"],
            plan_step=values.get("plan_step"),
            # Waiting without a key: the body is read after the wait, reading it now is waste.
            render=None if seconds and key is None else self._action_body,
        )
        if seconds and action is not None:
            action = settle(action, seconds, reread=thread_actions(self.thread))
            body = ActionSerializer(action).data
        return Response(body, status=status_code)

    def _action_body(self, action: Action) -> dict:
        return ActionSerializer(thread_actions(self.thread).get(pk=action.pk)).data


class DecisionSerializer(StrictSerializer):
    reason = serializers.CharField(max_length=2000, required=False, allow_blank=True)


class ActionDecisionViewSet(ProjectScopedViewSet):
    """A person approves or denies one action (never the token that requested it)."""

    scope_map = {"POST": "actions:approve"}
    queryset = Action.objects.none()
    lookup_url_kwarg = "act"

    def restrict(self, queryset):
        return thread_actions(self.thread)

    def _decide(self, request, approve: bool):
        data = DecisionSerializer(data=request.data or {})
        data.is_valid(raise_exception=True)
        action = self.get_object()
        approval_decide(
            actor=self.principal,
            action=action,
            approve=approve,
            reason=data.validated_data.get("reason", ""),
        )
        return Response(ActionSerializer(thread_actions(self.thread).get(pk=action.pk)).data)

    @extend_schema(request=DecisionSerializer, responses={200: ActionSerializer})
    def approve(self, request, *args, **kwargs):
        return self._decide(request, approve=True)

    @extend_schema(request=DecisionSerializer, responses={200: ActionSerializer})
    def deny(self, request, *args, **kwargs):
        return self._decide(request, approve=False)


class ReceiptSerializer(RedactedSerializer):
    redacted_fields = ActionSerializer.redacted_fields
    id = serializers.CharField(source="public_id", read_only=True)
    action = serializers.CharField(source="action.public_id", read_only=True)

    class Meta:
        model = Receipt
        fields = [
            "id",
            "action",
            "call_id",
            "tool",
            "args",
            "args_digest",
            "action_digest",
            "scope",
            "outcome",
            "result",
            "error",
            "policy_version",
            "decision",
            "runner",
            "sandbox",
            "command_digest",
            "report_digest",
            "evidence",
            "started_at",
            "finished_at",
            "created_at",
        ]


class ReceiptViewSet(ProjectScopedViewSet):
    scope_map = {"GET": "projects:read"}
    queryset = Receipt.objects.none()
    parent_lookups = (("act", "action", "actions"),)

    def restrict(self, queryset):
        return queryset.filter(action=self.action).select_related("action")

    @extend_schema(responses={200: ReceiptSerializer})
    def retrieve(self, request, *args, **kwargs):
        receipt = self.get_queryset().first()
        if receipt is None:
            raise NotFound()
        return Response(ReceiptSerializer(receipt).data)


class VerificationSerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="public_id", read_only=True)
    action = serializers.CharField(source="action.public_id", read_only=True)

    class Meta:
        model = Verification
        fields = ["id", "action", "accepted", "evidence", "verified_by", "check_name", "created_at"]


class VerificationCreateSerializer(StrictSerializer):
    accepted = serializers.BooleanField()
    evidence = serializers.CharField(max_length=10000)
    check = serializers.RegexField(
        r"^[a-z0-9][a-z0-9._-]{0,99}$",
        required=False,
        help_text="The named check recording this; omit when a person decides.",
    )


class VerificationViewSet(mixins.ListModelMixin, ProjectScopedViewSet):
    """Task acceptance on evidence, kept apart from the receipt's observed effects. Listed
    oldest first a page at a time (``limit``, ``cursor``), as every list is."""

    scope_map = {"GET": "projects:read", "POST": "projects:write"}
    queryset = Verification.objects.none()
    serializer_class = VerificationSerializer
    parent_lookups = (("act", "action", "actions"),)

    def restrict(self, queryset):
        return queryset.filter(action=self.action).select_related("action")

    @extend_schema(request=VerificationCreateSerializer, responses={201: VerificationSerializer})
    def create(self, request, *args, **kwargs):
        data = VerificationCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        verification = verification_record(
            actor=self.principal,
            action=self.action,
            accepted=values["accepted"],
            evidence=values["evidence"],
            check_name=values.get("check", ""),
        )
        return Response(VerificationSerializer(verification).data, status=status.HTTP_201_CREATED)


class PlanSerializer(RedactedSerializer):
    redacted_fields = {
        "steps": lambda steps: [
            {**step, "args": redact_arguments(step.get("args"))}
            if isinstance(step, dict)
            else redact(step)
            for step in steps
        ]
    }
    id = serializers.CharField(source="public_id", read_only=True)
    steps = serializers.SerializerMethodField(
        help_text="Each step's tool, canonical args and digest, how many times it may run "
        "once accepted (uses) and how many actions have named it so far (used)."
    )
    thread = serializers.CharField(source="thread.public_id", read_only=True)
    accepted_by = serializers.CharField(
        source="accepted_by.public_id", default=None, read_only=True, allow_null=True
    )

    class Meta:
        model = Plan
        fields = [
            "id",
            "thread",
            "steps",
            "state",
            "flags",
            "proposed_by",
            "accepted_by",
            "accepted_at",
            "created_at",
        ]

    def get_steps(self, plan) -> list[dict]:
        # A list of plans passes every plan's counts in one query (plan_step_uses).
        uses = self.context.get("step_uses")
        used = uses.get(plan.pk, Counter()) if uses is not None else plan_step_uses([plan])[plan.pk]
        return [
            {**step, "uses": step.get("uses", 1), "used": used.get(index, 0)}
            for index, step in enumerate(plan.steps)
        ]


class StepSerializer(StrictSerializer):
    tool = serializers.CharField(max_length=100)
    args = serializers.JSONField()
    uses = serializers.IntegerField(
        required=False,
        default=1,
        help_text="How many times the step may run once accepted (at most "
        "KESTREL_PLAN_STEP_MAX_USES); 1 by default.",
    )


class PlanCreateSerializer(StrictSerializer):
    steps = StepSerializer(many=True, allow_empty=False, max_length=100)


class PlanViewSet(mixins.ListModelMixin, mixins.RetrieveModelMixin, ProjectScopedViewSet):
    """In Plan mode a client proposes ordered steps; a person accepts them explicitly."""

    scope_map = {"GET": "projects:read", "POST": "projects:write"}
    queryset = Plan.objects.none()
    serializer_class = PlanSerializer
    lookup_url_kwarg = "plan"

    def restrict(self, queryset):
        return queryset.filter(thread=self.thread).select_related("thread", "accepted_by")

    @extend_schema(request=PlanCreateSerializer, responses={201: PlanSerializer})
    def create(self, request, *args, **kwargs):
        data = PlanCreateSerializer(data=request.data)
        data.is_valid(raise_exception=True)
        plan = plan_propose(
            actor=self.principal, thread=self.thread, steps=data.validated_data["steps"]
        )
        return Response(PlanSerializer(plan).data, status=status.HTTP_201_CREATED)


class PlanAcceptViewSet(ProjectScopedViewSet):
    scope_map = {"POST": "actions:approve"}
    queryset = Plan.objects.none()
    lookup_url_kwarg = "plan"

    def restrict(self, queryset):
        return queryset.filter(thread=self.thread)

    @extend_schema(request=None, responses={200: PlanSerializer})
    def accept(self, request, *args, **kwargs):
        plan = plan_accept(actor=self.principal, plan=self.get_object())
        return Response(PlanSerializer(plan).data)


class CheckpointRestoreSerializer(StrictSerializer):
    thread = serializers.CharField(
        max_length=40,
        required=False,
        help_text="The thread (in the checkpoint's project) to request the restore in; the "
        "checkpoint's own thread by default.",
    )
    exact = serializers.BooleanField(
        required=False,
        default=False,
        help_text="Also remove the files and directories created since the checkpoint, so the "
        "workspace ends exactly as it was. By default they are left in place.",
    )


class CheckpointRestoreViewSet(ProjectScopedViewSet):
    """Ask a runner to restore a checkpoint, as an action subject to policy and approvals."""

    scope_map = {"POST": "projects:write"}
    queryset = Checkpoint.objects.none()
    lookup_url_kwarg = "chk"

    def restrict(self, queryset):
        return queryset.filter(project=self.project).select_related("artifact", "thread")

    @extend_schema(request=CheckpointRestoreSerializer, responses={201: OpenApiTypes.OBJECT})
    def restore(self, request, *args, **kwargs):
        data = CheckpointRestoreSerializer(data=request.data or {})
        data.is_valid(raise_exception=True)
        checkpoint = self.get_object()
        thread_id = data.validated_data.get("thread")
        # The thread is looked up through this project only; another project's is missing.
        thread = (
            Thread.objects.filter(public_id=thread_id, project=self.project).first()
            if thread_id
            else checkpoint.thread
        )
        if thread is None:
            missing = (
                f"no thread {echo(thread_id)} in this project"
                if thread_id
                else "The checkpoint's thread is gone; name a thread of this project."
            )
            raise ValidationFailed(missing, details={"thread": [missing]})
        action = checkpoint_restore(
            actor=self.principal,
            checkpoint=checkpoint,
            thread=thread,
            exact=data.validated_data["exact"],
        )
        # The archive travels in the action's arguments; the response names the action
        # instead of echoing megabytes back.
        return Response(
            {
                "checkpoint": checkpoint.public_id,
                "action": action.public_id,
                "thread": thread.public_id,
                "state": action.state,
                "decision": action.decision,
            },
            status=status.HTTP_201_CREATED,
        )
