"""Request-time checks of an ``adapter.invoke`` call: fail closed, each 400 naming the field.

Two steps, registered on the judging hook (``governance.judging.ToolChecks``) by this
app's ``ready``: ``adapter_call_request`` checks the call against the static registry (an
unknown adapter or operation, arguments the operation does not take, an external operation
without an idempotency key: CRED-4, CRED-5) and marks an external operation's policy request,
so the policy engine always wants a person's approval for it; ``adapter_call_admit`` checks
the credential reference for this requester (TEN-5) and that the idempotency key is not
already bound to other arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kestrel_one.adapters.models import AdapterInvocation
from kestrel_one.adapters.registry import (
    Effect,
    InvalidOperationArguments,
    UnknownAdapter,
    UnknownOperation,
    get_operation,
    validate_operation_args,
)
from kestrel_one.common.errors import Conflict, ValidationFailed
from kestrel_one.credentials.release import CredentialRefused, credential_default, reference_check
from policies import Request
from runners.contract.canonical import digest


class AdapterCallInvalid(ValidationFailed):
    """A refused ``adapter.invoke`` call: a stable ``code`` and the field at fault."""

    def __init__(self, code: str, message: str, *, field: str, reason: str):
        super().__init__(message, details={field: [reason]})
        self.code = code


class IdempotencyKeyReused(Conflict):
    code = "idempotency_key_reused"


REFERENCE_FIELDS = ("credential", "connection")
# The refusal of an adapter.invoke call of a model provider (``Adapter.model_provider``).
MODEL_PROVIDER = "model_provider"


def credential_reference(canonical: dict[str, Any]) -> dict[str, str] | None:
    """``{"credential": "crd_..."}`` or ``{"connection": "con_..."}`` as the call names it."""
    for name in REFERENCE_FIELDS:
        if name in canonical:
            return {name: canonical[name]}
    return None


def invocation_digest(canonical: dict[str, Any], *, project: str) -> str:
    """What an idempotency key binds: the project the call is made in (its public id), the
    operation's arguments and the credential used. The same key with anything else is another
    call, and is refused: a key is never answered with another project's first call (its
    result, and the effect that call made, are that project's)."""
    return digest(
        {
            "project": project,
            "adapter": canonical["adapter"],
            "operation": canonical["operation"],
            "args": canonical["args"],
            "reference": credential_reference(canonical),
        }
    )


def adapter_call_request(canonical: dict[str, Any], request: Request) -> Request:
    try:
        adapter, operation = get_operation(canonical["adapter"], canonical["operation"])
    except UnknownAdapter as error:
        raise AdapterCallInvalid(
            "unknown_adapter", str(error), field="args.adapter", reason="unknown adapter"
        ) from None
    except UnknownOperation as error:
        raise AdapterCallInvalid(
            "unknown_operation", str(error), field="args.operation", reason="unknown operation"
        ) from None
    if adapter.model_provider:
        # Its calls are model calls: the gateway's alone, so no grant of adapter.invoke can
        # step around the project's model list and token budget.
        raise AdapterCallInvalid(
            MODEL_PROVIDER,
            f"{adapter.name} is a model provider: call its models with the model.invoke tool "
            "(or the project's chat-completions endpoint), which the project's model list and "
            "token budget govern. adapter.invoke does not call it.",
            field="args.adapter",
            reason="a model provider: use model.invoke",
        )
    try:
        validate_operation_args(canonical["adapter"], canonical["operation"], canonical["args"])
    except InvalidOperationArguments as error:
        raise AdapterCallInvalid(
            "invalid_operation_arguments", str(error), field=error.field, reason=error.reason
        ) from None
    if "credential" in canonical and "connection" in canonical:
        raise AdapterCallInvalid(
            "invalid",
            "Name one credential: an org credential (credential) or your own connection "
            "(connection), not both.",
            field="args.connection",
            reason="give credential or connection, not both",
        )
    external = operation.effect == Effect.EXTERNAL
    if external and "idempotency_key" not in canonical:
        raise AdapterCallInvalid(
            "idempotency_key_required",
            f"{canonical['adapter']} {operation.name} has an external effect: give an "
            "idempotency_key, so that a retried or replayed call makes the effect once.",
            field="args.idempotency_key",
            reason="required for an external operation",
        )
    return dataclasses.replace(request, external_effect=external)


def adapter_call_admit(
    *, organization, project=None, user, token, canonical: dict[str, Any]
) -> dict:
    # Imported here: this module is loaded while the app registry is being populated.

    adapter = canonical["adapter"]
    reference = credential_reference(canonical)
    field = f"args.{next(iter(reference))}" if reference else "args.credential"
    try:
        if reference is None:
            default = credential_default(organization=organization, adapter=adapter)
            if default is None:
                raise AdapterCallInvalid(
                    "credential_required",
                    f"Name the credential to use: this organization has no active {adapter} "
                    "credential to default to (an admin adds one; or use your own connection).",
                    field=field,
                    reason="required",
                )
            # Made explicit, so the action's digest (and its approval) binds the credential.
            canonical = {**canonical, "credential": default}
            reference = {"credential": default}
        reference_check(
            organization=organization, adapter=adapter, reference=reference, user=user, token=token
        )
    except CredentialRefused as refused:
        raise AdapterCallInvalid(
            refused.code, refused.message, field=field, reason=refused.message
        ) from None
    key = canonical.get("idempotency_key")
    if key is not None:
        taken = (
            AdapterInvocation.objects.filter(
                organization=organization,
                adapter=adapter,
                operation=canonical["operation"],
                idempotency_key=key,
            )
            .values_list("request_digest", flat=True)
            .first()
        )
        if taken is not None and taken != invocation_digest(canonical, project=project.public_id):
            raise IdempotencyKeyReused(
                "This idempotency key was already used for a call with other arguments, "
                "another credential or in another project; use a new key for a new call.",
                details={"args.idempotency_key": ["already used for other arguments"]},
            )
    return canonical
