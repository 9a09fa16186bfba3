"""The runner's Celery app: its settings, worker signals and the two tasks it consumes.

Started by ``python -m runners worker`` (``celery -A runners.worker worker -Q
runner.<pool>``). ``runner.execute`` hands each command token to this process's
``runners.runner.Runner``; ``runner.control`` takes the pool's broadcast control messages.
Delivery is set for no loss (acks late, prefetch 1); docs/runners.md ("One call on the
runner", "Celery settings and redelivery") has the reasoning.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from typing import Any

import kombu.exceptions
import redis
from celery import Celery
from celery.exceptions import Reject
from celery.signals import (
    celeryd_after_setup,
    worker_init,
    worker_process_shutdown,
    worker_ready,
    worker_shutdown,
)
from kombu.common import Broadcast

from runners.adapter_broker import RedisAdapterTransport
from runners.callstate import CallState
from runners.config import RunnerConfig
from runners.contract.broker import is_redis_url, redis_client_url
from runners.contract.broker_access import pool_namespace, runner_transport_options
from runners.contract.names import (
    ADAPTER_REQUEST_TASK,
    CONTROL_TASK,
    EXECUTE_TASK,
    HEARTBEAT_TASK,
    MCP_DISCOVER_TASK,
    MCP_DISCOVERED_TASK,
    REPORT_QUEUE,
    REPORT_TASK,
    WORKSPACES_TASK,
    control_exchange,
)
from runners.heartbeat import HEARTBEAT_EXPIRES_SECONDS, start_heartbeats
from runners.inventory import start_workspace_inventory
from runners.mcp.discovery import discover
from runners.mcp.servers import (
    DockerMcpServers,
    reap_mcp_call,
    remove_stale_mcp_servers,
    stop_mcp_servers,
)
from runners.orphans import reap_orphan_containers, remove_stale_warm_containers
from runners.runner import Runner
from runners.warm_chooser import WarmBackendChooser
from runners.workspace import WorkspaceQuota

__all__ = [
    "app",
    "celery_settings",
    "current_runner",
    "discover_mcp_server",
    "execute_command",
    "handle_control_message",
]

# The broker redelivers an unacknowledged message this long after the longest call could
# have ended; it must exceed callstate.LEASE_SECONDS so a redelivered call finds a dead
# worker's lease expired.
VISIBILITY_MARGIN_SECONDS = 60
# Celery kills a task this long after the longest call (the sandbox's own timeout should
# have ended it first); the message is then requeued and recovered like any lost call.
TIME_LIMIT_MARGIN_SECONDS = 30
# How often the broker looks for messages whose worker died (kombu scans only every
# interval x throttle seconds; its default throttle of 10 would mean every 100 s).
RESTORE_INTERVAL_SECONDS = 10
# Pause before handing a message back when Redis or the broker is unreachable.
INFRASTRUCTURE_RETRY_PAUSE_SECONDS = 5

log = logging.getLogger("kestrel.runner")


def celery_settings(config: RunnerConfig) -> dict[str, Any]:
    """The worker's Celery configuration: at-least-once delivery, JSON only, no backend."""
    return {
        "broker_url": config.broker_url,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {
            "visibility_timeout": config.max_call_seconds + VISIBILITY_MARGIN_SECONDS,
            "unacked_restore_interval": RESTORE_INTERVAL_SECONDS,
            "unacked_restore_throttle": 1,
            # In the pool's namespace, the only keys its broker user reaches besides queues.
            **runner_transport_options(config.pool),
        },
        "result_backend": None,
        "task_ignore_result": True,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": config.queue,
        "task_time_limit": config.max_call_seconds + TIME_LIMIT_MARGIN_SECONDS,
        "worker_send_task_events": False,
        "task_send_sent_event": False,
        # No remote control: its pidbox is one broadcast channel for every worker of the
        # broker, which a runner's broker user may not join (runners.contract.broker_access).
        "worker_enable_remote_control": False,
    }


app = Celery("kestrel-runner", set_as_current=False)
# Loaded when the worker first reads its configuration, not at import: tests and tools
# import this module without a runner environment.
app.add_defaults(lambda: celery_settings(RunnerConfig.from_environment()))

_process_runner: tuple[int, Runner] | None = None
_process_runner_lock = threading.Lock()


def current_runner() -> Runner:
    """This process's Runner, built from the environment once per process (after fork)."""
    global _process_runner
    with _process_runner_lock:
        if _process_runner is None or _process_runner[0] != os.getpid():
            config = RunnerConfig.from_environment()
            client = redis.Redis.from_url(
                config.state_url, socket_timeout=10, socket_connect_timeout=5
            )
            worker = f"{config.runner_id}/{socket.gethostname()}/{os.getpid()}"
            state = CallState(client, worker=worker, namespace=pool_namespace(config.pool))
            chooser = WarmBackendChooser.from_environment(thread_ended=state.thread_ended)
            docker_capable = config.sandbox in ("auto", "docker")
            # Warm MCP servers follow the warm sandboxes' settings (runners.mcp.servers).
            mcp = (
                DockerMcpServers(
                    runner_id=config.runner_id,
                    idle_seconds=chooser.idle_seconds,
                    max_servers=chooser.max_containers if chooser.enabled else 0,
                    thread_ended=state.thread_ended,
                    risk_ended=state.risk_ended,
                    max_call_seconds=config.max_call_seconds,
                )
                if docker_capable
                else None
            )
            runner = Runner(
                config=config,
                private_key=config.private_key(),
                control_public_key=config.control_public_key(),
                state=state,
                report=send_report,
                choose_backend=chooser,
                reap_orphans=(
                    (lambda call_id: reap_orphan_containers(call_id) + reap_mcp_call(call_id))
                    if docker_capable
                    else (lambda call_id: 0)
                ),
                end_thread=(
                    (
                        lambda project, thread: (
                            chooser.end_thread(project, thread, runner_id=config.runner_id)
                            + (mcp.end_thread(project, thread) if mcp is not None else 0)
                        )
                    )
                    if docker_capable
                    else (lambda project, thread: 0)
                ),
                end_project=(
                    (
                        lambda project: (
                            chooser.end_project(project, runner_id=config.runner_id)
                            + (mcp.end_project(project) if mcp is not None else 0)
                        )
                    )
                    if docker_capable
                    else (lambda project: 0)
                ),
                end_risk_acceptance=(
                    mcp.end_risk_acceptance if mcp is not None else (lambda acceptance: 0)
                ),
                mcp_servers=mcp,
                discover_mcp=(
                    (
                        lambda request: discover(
                            request,
                            runner_id=config.runner_id,
                            max_seconds=config.max_call_seconds,
                        )
                    )
                    if docker_capable
                    else None
                ),
                report_discovery=send_discovery_report,
                # Answers are pushed on the broker's Redis, where the control plane is.
                adapter_transport=RedisAdapterTransport(
                    send_task=send_adapter_request,
                    redis_url=(
                        redis_client_url(config.broker_url)
                        if is_redis_url(config.broker_url)
                        else config.state_url
                    ),
                ),
            )
            _process_runner = (os.getpid(), runner)
        return _process_runner[1]


@worker_init.connect
def _on_worker_start(sender: Any = None, **_: Any) -> None:
    """Clear what a previous process of this runner left warm, before taking any call."""
    if getattr(sender, "app", None) is not app:
        return  # another Celery app's worker in this process (worker_init is global)
    config = RunnerConfig.from_environment()
    if config.sandbox in ("auto", "docker"):
        removed = remove_stale_warm_containers(config.runner_id)
        log.info(json.dumps({"event": "warm_containers_removed", "count": removed}))
        removed = remove_stale_mcp_servers(config.runner_id)
        log.info(json.dumps({"event": "mcp_servers_removed", "count": removed}))


@celeryd_after_setup.connect
def _consume_control_messages(sender: Any = None, instance: Any = None, **_: Any) -> None:
    """Also consume this pool's control messages, whatever ``-Q`` selected.

    A broadcast queue: each worker gets its own uniquely named queue bound to the fanout
    exchange ``runner-control.<pool>``, so every worker of the pool gets every message. On
    Redis that is PUBLISH/SUBSCRIBE: nothing is stored, a worker that is down or not yet
    subscribed misses the message (acceptable, see the module docstring). The routing key is
    set explicitly because the Redis transport subscribes to ``<exchange>/<routing key>``.
    """
    if getattr(instance, "app", None) is not app:
        return  # another Celery app's worker in this process (the signal is global)
    exchange = control_exchange(RunnerConfig.from_environment().pool)
    instance.app.amqp.queues.select_add(
        Broadcast(exchange, queue=exchange, unique=True, routing_key=exchange)
    )


_heartbeats: threading.Event | None = None
_inventory: threading.Event | None = None


@worker_ready.connect
def _start_heartbeats(sender: Any = None, **_: Any) -> None:
    """The main process tells the control plane it is up, and with which sandbox, from now on
    every 30 s (runners.heartbeat); and which workspaces it keeps, now and then every
    KESTREL_WORKSPACE_INVENTORY_SECONDS (runners.inventory)."""
    global _heartbeats, _inventory
    if getattr(sender, "app", None) is not app:
        return  # another Celery app's worker in this process (the signal is global)
    config = RunnerConfig.from_environment()
    _heartbeats = start_heartbeats(config, send_heartbeat)
    _inventory = start_workspace_inventory(config, send_inventory)


@worker_shutdown.connect
def _stop_heartbeats(**_: Any) -> None:
    for stop in (_heartbeats, _inventory):
        if stop is not None:
            stop.set()


@worker_shutdown.connect
def _unmount_workspaces(sender: Any = None, **_: Any) -> None:
    """The main process, stopping, unmounts its workspaces' quota filesystems (each is
    mounted again on its next call): no loop device outlives the runner."""
    if getattr(sender, "app", None) is not app:
        return  # another Celery app's worker in this process (the signal is global)
    config = RunnerConfig.from_environment()
    if config.workspace_quota_mb:
        count = WorkspaceQuota(config.workspace_root).unmount_all()
        log.info(json.dumps({"event": "workspaces_unmounted", "count": count}))


@worker_shutdown.connect
def _stop_mcp_servers(sender: Any = None, **_: Any) -> None:
    """The main process, stopping, stops this runner's warm MCP servers (runners.mcp.relay
    processes outlive the worker processes by design, not the runner)."""
    if getattr(sender, "app", None) is not app:
        return  # another Celery app's worker in this process (the signal is global)
    config = RunnerConfig.from_environment()
    if config.sandbox in ("auto", "docker"):
        count = stop_mcp_servers(config.runner_id)
        log.info(json.dumps({"event": "mcp_servers_stopped", "count": count}))


@worker_process_shutdown.connect
def _on_process_shutdown(**_: Any) -> None:
    """A worker process that stops removes its idle warm containers."""
    if _process_runner is not None and _process_runner[0] == os.getpid():
        chooser = _process_runner[1].choose_backend
        if isinstance(chooser, WarmBackendChooser):
            chooser.close()


def send_report(result_token: str) -> None:
    """Send a signed report to the control plane, by task name (no shared code).

    Sent without declaring the queue (``declare=[]``): declaring writes the queue's binding
    table, which a runner's broker user may only read; the control plane declares it.
    """
    app.send_task(REPORT_TASK, args=[result_token], queue=REPORT_QUEUE, declare=[])


def send_discovery_report(report_token: str) -> None:
    """Send a signed MCP discovery report (runners.contract.mcp_discovery) to the control
    plane; not declared (``declare=[]``), as a call's report."""
    app.send_task(MCP_DISCOVERED_TASK, args=[report_token], queue=REPORT_QUEUE, declare=[])


def send_adapter_request(request_token: str) -> None:
    """Send a workload's signed adapter request (runners.adapter_broker) to the control plane.

    From a broker thread, while the worker's own thread waits for its call's sandbox; the
    producer pool hands each thread a connection of its own. Not declared (``declare=[]``),
    as a report.
    """
    app.send_task(ADAPTER_REQUEST_TASK, args=[request_token], queue=REPORT_QUEUE, declare=[])


def send_inventory(inventory_token: str) -> None:
    """Send one signed part of the workspace inventory, as a heartbeat."""
    _send_notice(WORKSPACES_TASK, inventory_token)


def send_heartbeat(heartbeat_token: str) -> None:
    """Send a signed heartbeat; one that waited past its lifetime is dropped unread."""
    _send_notice(HEARTBEAT_TASK, heartbeat_token)


def _send_notice(task: str, token: str) -> None:
    """Send a runner's signed notice (a heartbeat, a workspace inventory) to the control plane.

    On a connection of its own, opened for this one message: the notice threads then share no
    connection or pool with the worker's own loop in the main process. Dropped unread once it
    is past its lifetime.
    """
    with app.connection_for_write() as connection:
        app.send_task(
            task,
            args=[token],
            queue=REPORT_QUEUE,
            expires=HEARTBEAT_EXPIRES_SECONDS,
            retry=False,
            connection=connection,
            declare=[],
        )


@app.task(
    name=EXECUTE_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
)
def execute_command(command_token: str) -> str:
    """Run one signed command; refusals end here, infrastructure failures requeue it."""
    try:
        return current_runner().handle(command_token).value
    except (redis.RedisError, kombu.exceptions.OperationalError) as error:
        # Call state or the broker is unreachable: the call's fate is unknown here, so
        # hand the message back; its state decides what the next delivery does.
        log.error(
            json.dumps({"event": "infrastructure_error", "error": str(error)[:500]}, sort_keys=True)
        )
        time.sleep(INFRASTRUCTURE_RETRY_PAUSE_SECONDS)
        raise Reject(str(error), requeue=True) from None


@app.task(name=CONTROL_TASK, acks_late=False, ignore_result=True)
def handle_control_message(control_token: str) -> str:
    """Act on one signed control message; a refused one ends here, nothing is retried.

    Acknowledged on receipt: a broadcast copy is this worker's alone, so handing it back
    could only deliver it again here.
    """
    return current_runner().handle_control(control_token).value


@app.task(
    name=MCP_DISCOVER_TASK,
    acks_late=True,
    reject_on_worker_lost=True,
    ignore_result=True,
)
def discover_mcp_server(request_token: str) -> str:
    """Answer one signed MCP discovery request (``Runner.handle_discovery``). Discovery has
    no effect beyond a container it removes, so a delivery a dead worker left is run again;
    a broker that is unreachable for the report hands the message back."""
    try:
        return current_runner().handle_discovery(request_token).value
    except kombu.exceptions.OperationalError as error:
        log.error(
            json.dumps({"event": "infrastructure_error", "error": str(error)[:500]}, sort_keys=True)
        )
        time.sleep(INFRASTRUCTURE_RETRY_PAUSE_SECONDS)
        raise Reject(str(error), requeue=True) from None
