"""Control-tier tools: their specs only. They run in the control tier, never on a runner.

``adapter.invoke`` calls one operation of a trusted host adapter
(``kestrel_one.adapters.registry``) with a credential the runner never sees (RUN-7, CRED-2).
The spec is here, beside the others, so that one registry names every tool, the policy
judges it as any other call, and the runner can recognise (and refuse) a command naming it.
The adapter, operation and its arguments are checked against the adapter registry by the
control plane, which alone knows it; this schema only fixes the envelope.
"""

from __future__ import annotations

from typing import Any

from policies.request import Request
from runners.contract.arguments import object_schema
from runners.contract.errors import RunnerError
from runners.contract.toolspec import Tier, ToolContext, ToolSpec


class ControlTierTool(RunnerError):
    """A control-tier tool reached a runner: refused, it has nothing to run it with."""

    code = "control_tier_tool"


def refuse_on_runner(args: dict[str, Any], ctx: ToolContext) -> dict[str, Any]:
    raise ControlTierTool("this tool runs in the control tier, never on a runner")


# A crd_/con_ public id: the prefix and a ULID (kestrel_one.common.ids).
_ULID = "[0-9A-HJKMNP-TV-Z]{26}"
IDEMPOTENCY_KEY = {"type": "string", "pattern": r"^[A-Za-z0-9._:-]{1,128}$"}

ADAPTER_INVOKE_SCHEMA = object_schema(
    {
        "adapter": {"type": "string", "pattern": r"^[a-z0-9][a-z0-9_-]{0,62}$"},
        "operation": {"type": "string", "pattern": r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$"},
        "args": {"type": "object"},
        "credential": {"type": "string", "pattern": f"^crd_{_ULID}$"},
        "connection": {"type": "string", "pattern": f"^con_{_ULID}$"},
        "idempotency_key": IDEMPOTENCY_KEY,
    },
    ["adapter", "operation", "args"],
)


def adapter_request(args: Any) -> Request:
    return Request(
        capability="adapter.invoke", adapter=args["adapter"], operation=args["operation"]
    )


ADAPTER_INVOKE = ToolSpec(
    name="adapter.invoke",
    capability="adapter.invoke",
    summary=(
        "Call one operation of a trusted host adapter (GET /api/v1/adapters lists them) with "
        "an org credential or your own connection; the control tier holds the credential."
    ),
    input_schema=ADAPTER_INVOKE_SCHEMA,
    # An external operation is made once per idempotency key by the control tier; the call
    # itself is never retried blindly.
    idempotent=False,
    build_request=adapter_request,
    implementation=refuse_on_runner,
    tier=Tier.CONTROL,
)

TOOLS = (ADAPTER_INVOKE,)
