"""Control messages to runners: signed notices every runner of a pool receives.

Commands go to ``runner.<pool>``, where exactly one worker takes each. A control message
must reach every worker of the pool instead, so it is published on the pool's fanout
exchange (``runners.contract.names.control_exchange``), to which each runner worker binds its own
broadcast queue. On the Redis broker that is PUBLISH/SUBSCRIBE: nothing is stored, and a
worker that is down or reconnecting misses the message. That is acceptable for what is sent
here (today only ``thread.end``): a runner's idle timeout and its cleanup at start remove
what the message would have removed, only later.

Messages are signed with the command-signing key, as ``kestrel-control+jwt`` tokens bound to
org/env/prj/thr with a short lifetime; runners verify them exactly like commands.
"""

from __future__ import annotations

import logging

from django.db import transaction
from django.dispatch import receiver
from kombu import Exchange

from kestrel_one.celery import app
from kestrel_one.execution.keys import control_private_key
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


def thread_end_announce(*, scope: dict, pools: list[str]) -> int:
    """Tell every runner of each pool that the thread in ``scope`` ended; how many pools
    were told. Runs after the ending transaction committed; never raises, because the
    thread has ended whether or not the runners hear of it (failures are logged, without
    the token)."""
    told = 0
    for pool in pools:
        try:
            token = sign_control_message(
                {"aud": command_audience(pool), "type": "thread.end", **scope},
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
                "thread.end notice for %s to pool %s not sent (%s); runners will drop its "
                "warm sandboxes at their idle timeout",
                scope["thr"],
                pool,
                type(error).__name__,
            )
            continue
        told += 1
    return told
