"""Task, queue, exchange, audience and issuer names: where messages go and who they are for.

Both tiers route by these strings (Celery task names, queue names, JWT ``iss``/``aud``), so
each is spelled here once.
"""

from __future__ import annotations

__all__ = [
    "ADAPTERS_QUEUE",
    "ADAPTER_REQUEST_TASK",
    "COMMAND_ISSUER",
    "CONTROL_QUEUE",
    "CONTROL_TASK",
    "CONTROL_TIER_TASKS",
    "EXECUTE_TASK",
    "HEARTBEAT_TASK",
    "MCP_DISCOVERED_TASK",
    "MCP_DISCOVER_TASK",
    "REPORT_QUEUE",
    "REPORT_TASK",
    "RESULT_AUDIENCE",
    "RUNNER_SENT_TASKS",
    "WORKSPACES_TASK",
    "command_audience",
    "control_exchange",
    "runner_queue",
]

# The control plane: issuer of commands and control messages, audience of reports.
COMMAND_ISSUER = "kestrel-control"
RESULT_AUDIENCE = "kestrel-control"

# The control plane's own queue: its sweeps and deliveries, which trust their message.
CONTROL_QUEUE = "control"
# Runner -> control plane: everything a runner sends (``RUNNER_SENT_TASKS``), each a token
# signed with the runner's key, on a queue of their own. A runner may append to this queue
# only; the worker that consumes it serves nothing else and runs no other task, so a runner
# host cannot start the control plane's unsigned tasks (kestrel_one.celery).
REPORT_QUEUE = "reports"
REPORT_TASK = "control.ingest_result"
HEARTBEAT_TASK = "control.runner_heartbeat"
# Runner -> control plane: the projects whose workspaces it keeps (runners.contract.inventory).
WORKSPACES_TASK = "control.runner_workspaces"
# Runner -> control plane: a workload's signed adapter request, through the broker beside its
# sandbox (runners.adapter_broker); the answer comes back on a list in the pool's namespace.
ADAPTER_REQUEST_TASK = "control.adapter_request"
# Control plane -> runner: one signed command (queue ``runner.<pool>``) and signed control
# messages (the pool's fanout exchange).
EXECUTE_TASK = "runner.execute"
CONTROL_TASK = "runner.control"
# Control plane -> runner: one signed MCP discovery request (runners.contract.mcp_discovery),
# on ``runner.<pool>``; runner -> control plane: its signed report, on ``REPORT_QUEUE``.
MCP_DISCOVER_TASK = "runner.mcp_discover"
MCP_DISCOVERED_TASK = "control.mcp_discovered"
RUNNER_SENT_TASKS = frozenset(
    {REPORT_TASK, HEARTBEAT_TASK, WORKSPACES_TASK, ADAPTER_REQUEST_TASK, MCP_DISCOVERED_TASK}
)

# Control-tier tools (``Tier.CONTROL``): never signed to a runner. Their calls are sent, by
# action id, as these tasks on ``ADAPTERS_QUEUE``, which only control-tier workers consume
# (they hold the credentials key; runners and the control queue's worker need not).
ADAPTERS_QUEUE = "adapters"
CONTROL_TIER_TASKS = {
    "adapter.invoke": "control.adapter_invoke",
    "model.invoke": "control.model_invoke",
}


def runner_queue(pool: str) -> str:
    """The queue commands for runner pool ``pool`` are sent on; exactly one worker takes each."""
    return f"runner.{pool}"


def command_audience(pool: str) -> str:
    """The audience a command for runner pool ``pool`` carries (also its queue name)."""
    return runner_queue(pool)


def control_exchange(pool: str) -> str:
    """The fanout exchange (and routing key) control messages for ``pool`` are published on.

    Every runner worker of the pool binds its own broadcast queue to it, so each one gets a
    copy, unlike ``runner.<pool>`` where exactly one worker takes each command. Not
    ``runner.<pool>.control``: that is the queue of a pool named ``<pool>.control``, whose
    binding table a runner of ``<pool>`` could then write (runners.contract.broker_access).
    """
    return f"runner-control.{pool}"
