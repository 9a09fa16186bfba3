"""Control messages to runners: signed notices every runner of a pool receives.

Commands go to ``runner.<pool>``, where exactly one worker takes each. A control message
must reach every worker of the pool instead, so it is published on the pool's fanout
exchange (``runners.contract.names.control_exchange``), to which each runner worker binds its own
broadcast queue. On the Redis broker that is PUBLISH/SUBSCRIBE: nothing is stored, and a
worker that is down or reconnecting misses the message. That is acceptable for what is sent
here: for ``thread.end`` and ``mcp.risk.end`` a runner's idle timeout and its cleanup at
start remove what the message would have removed, only later; a missed ``project.delete``
(remove the deleted project's workspace) is sent again when the host's next workspace
inventory lists the workspace (``kestrel_one.execution.inventory``, docs/runners.md).

Messages are signed with the command-signing key, as ``kestrel-control+jwt`` tokens bound to
org/env and the project, thread or risk acceptance they concern, with a short lifetime;
runners verify them exactly like commands.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.dispatch import receiver
from kombu import Exchange

from kestrel_one.celery import app
from kestrel_one.execution.keys import control_private_key
from kestrel_one.execution.models import Action, DeletedProject
from kestrel_one.tenancy.signals import project_deleting
from kestrel_one.threads.selectors import thread_scope
from kestrel_one.threads.signals import thread_ended
from runners.contract.names import CONTROL_TASK, command_audience, control_exchange
from runners.contract.tokens import sign_control_message

logger = logging.getLogger(__name__)

# Long enough for a runner whose every slot is busy to get to it; a runner refuses it after.
CONTROL_MESSAGE_TTL_SECONDS = 120
# A notice that may be lost anyway is not worth holding a request for a dead broker.
PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0, "interval_step": 0.2}


@receiver(thread_ended, dispatch_uid="execution-thread-end-notice")
def thread_end_notice(sender, thread, **kwargs) -> None:
    """On a thread's end (inside its transaction): after commit, tell every runner pool the
    thread's actions were sent to."""
    pools = sorted(set(thread.actions.values_list("pool", flat=True)))
    if pools:
        scope = thread_scope(thread)
        transaction.on_commit(lambda: thread_end_announce(scope=scope, pools=pools), robust=True)


@receiver(project_deleting, dispatch_uid="execution-project-delete-notice")
def project_delete_notice(sender, project, **kwargs) -> None:
    """On a project's deletion (inside its transaction, before its rows go): record it as
    deleted (``DeletedProject``, for the hosts that miss this notice: runners.inventory), and
    after commit tell every runner pool its actions were sent to that its workspace is to be
    removed."""
    deleted = DeletedProject.objects.create(
        project_public_id=project.public_id,
        organization_public_id=project.organization.public_id,
        environment_public_id=project.environment.public_id,
    )
    pools = sorted(set(Action.objects.filter(project=project).values_list("pool", flat=True)))
    if pools:
        scope = deleted.control_scope()
        transaction.on_commit(
            lambda: control_announce(type_="project.delete", scope=scope, pools=pools),
            robust=True,
        )


def mcp_risk_end_notice(acceptance) -> None:
    """An MCP server's risk acceptance ended (withdrawn, its expiry recorded, or voided by a
    change or the removal of the server; inside that transaction): after commit, tell every
    runner pool that ran a call of the server to stop the servers it started under the
    acceptance, whose containers have the network it gave."""
    server = acceptance.server
    calls = Action.objects.filter(
        organization_id=server.organization_id, tool="mcp.call", args__server=server.public_id
    )
    pools = sorted(set(calls.values_list("pool", flat=True)))
    if pools:
        scope = {
            "org": server.organization.public_id,
            "env": server.environment.public_id,
            "rsk": acceptance.public_id,
        }
        transaction.on_commit(
            lambda: control_announce(type_="mcp.risk.end", scope=scope, pools=pools),
            robust=True,
        )


def thread_end_announce(*, scope: dict, pools: list[str]) -> int:
    """Tell every runner of each pool that the thread in ``scope`` ended; how many pools
    were told (``control_announce``)."""
    return control_announce(type_="thread.end", scope=scope, pools=pools)


def control_announce(*, type_: str, scope: dict, pools: list[str]) -> int:
    """Send control message ``type_`` about ``scope`` (``org``, ``env`` and what the type
    names of ``prj``, ``thr`` and ``rsk``) to every runner of each pool; how many pools were
    told. Runs after the transaction that decided it committed; never raises, because what
    it announces has happened whether or not the runners hear of it (failures are logged,
    without the token; a runner that missed a ``thread.end`` or an ``mcp.risk.end`` drops
    the warm sandboxes or servers at their idle timeout, one that missed a
    ``project.delete`` is sent it again after its next workspace inventory)."""
    told = 0
    for pool in pools:
        try:
            token = sign_control_message(
                {
                    "aud": command_audience(pool),
                    "type": type_,
                    "prj": None,
                    "thr": None,
                    "rsk": None,
                    **scope,
                },
                control_private_key(),
                ttl=CONTROL_MESSAGE_TTL_SECONDS,
            )
            exchange = Exchange(control_exchange(pool), type="fanout")
            app.send_task(
                CONTROL_TASK,
                args=[token],
                exchange=exchange,
                routing_key=control_exchange(pool),
                declare=[exchange],
                retry_policy=PUBLISH_RETRY_POLICY,
            )
        except Exception as error:
            logger.warning(
                "%s notice for %s to pool %s not sent (%s)",
                type_,
                scope.get("thr") or scope.get("prj") or scope.get("rsk"),
                pool,
                type(error).__name__,
            )
            continue
        told += 1
    return told
