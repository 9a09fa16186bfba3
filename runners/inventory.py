"""Telling the control plane which workspaces this host keeps, so that none of a deleted
project outlives a ``project.delete`` the host missed.

``project.delete`` is a broadcast (docs/runners.md#ending-a-thread): a host that is down or
reconnecting when a project is deleted never hears of it. So the worker's main process sends
its inventory (runners.contract.inventory) when the worker is ready and then every
``KESTREL_WORKSPACE_INVENTORY_SECONDS``: the ids of the projects with a workspace under
``KESTREL_WORKSPACE_ROOT``, signed with the runner's own key. The control plane answers a
deleted project's id with ``project.delete`` again, and the workspace goes as it would have.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

from runners.config import RunnerConfig
from runners.contract.inventory import MAX_INVENTORY_PROJECTS, sign_workspace_inventory
from runners.heartbeat import PROBE_WORKSPACE
from runners.workspace import workspace_projects

__all__ = ["inventory_tokens", "start_workspace_inventory"]

log = logging.getLogger("kestrel.runner")


def inventory_tokens(config: RunnerConfig) -> list[str]:
    """This host's workspace inventory, signed, in as many parts as it takes (at least one,
    so that an empty host is heard from too)."""
    projects = [
        name for name in workspace_projects(config.workspace_root) if name != PROBE_WORKSPACE
    ]
    chunks = [
        projects[start : start + MAX_INVENTORY_PROJECTS]
        for start in range(0, len(projects), MAX_INVENTORY_PROJECTS)
    ] or [[]]
    return [
        sign_workspace_inventory(
            pool=config.pool,
            projects=chunk,
            part=number,
            parts=len(chunks),
            private_key_pem=config.private_key(),
            runner_id=config.runner_id,
        )
        for number, chunk in enumerate(chunks, start=1)
    ]


def start_workspace_inventory(
    config: RunnerConfig,
    send: Callable[[str], None],
    *,
    interval: float | None = None,
) -> threading.Event:
    """Send the inventory from a daemon thread now and then every ``interval`` seconds (the
    config's by default) until the returned event is set."""
    stop = threading.Event()
    every = config.workspace_inventory_s if interval is None else interval

    def send_all() -> None:
        while True:
            try:
                tokens = inventory_tokens(config)
                for token in tokens:
                    send(token)
            except Exception as error:  # a missed inventory is sent again at the next one
                log.warning(json.dumps({"event": "inventory_not_sent", "error": str(error)[:300]}))
            if stop.wait(every):
                return

    threading.Thread(target=send_all, name="runner-workspace-inventory", daemon=True).start()
    return stop
