"""Runner workspace inventories: a deleted project's workspace on a host that missed the
``project.delete`` broadcast is removed after all.

Every runner lists the projects whose workspaces its host keeps, when it starts and then
every ``KESTREL_WORKSPACE_INVENTORY_SECONDS`` (runners.inventory), signed with its own key.
It is verified as a heartbeat (``runner_notice_verified``). Each listed project recorded as
deleted (``DeletedProject``) gets its ``project.delete`` control message again, to the
runner's pool, with the scope the first one had; the runner then removes it as it would
have. Nothing else is answered: a listed project that exists is the host's to keep, and one
the control plane never recorded (deleted before these records, or from another control
plane) is logged for an operator, never removed on a runner's word.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from kestrel_one.execution.control import control_announce
from kestrel_one.execution.heartbeats import runner_notice_verified
from kestrel_one.execution.models import DeletedProject
from kestrel_one.tenancy.models import Project
from runners.contract.inventory import verify_workspace_inventory

__all__ = ["InventoryOutcome", "runner_workspaces_reconcile"]

logger = structlog.get_logger(__name__)


@dataclass(frozen=True)
class InventoryOutcome:
    runner: str
    listed: int
    # Deleted projects whose project.delete was sent again (and reached the broker).
    resent: tuple[str, ...]
    # Listed projects that neither exist nor were recorded as deleted.
    unknown: tuple[str, ...]


def runner_workspaces_reconcile(token: str) -> InventoryOutcome:
    """Verify a runner's workspace inventory and send ``project.delete`` again for each
    deleted project it lists; raises ``RunnerNoticeRefused``."""
    runner, inventory = runner_notice_verified(token, verify_workspace_inventory)
    listed = set(inventory.projects)
    deleted = list(
        DeletedProject.objects.filter(project_public_id__in=listed).order_by("project_public_id")
    )
    resent = tuple(
        record.project_public_id
        for record in deleted
        if control_announce(
            type_="project.delete", scope=record.control_scope(), pools=[runner.pool]
        )
    )
    known = {record.project_public_id for record in deleted} | set(
        Project.objects.filter(public_id__in=listed).values_list("public_id", flat=True)
    )
    unknown = tuple(sorted(listed - known))
    if unknown:
        logger.warning(
            "runner keeps workspaces of projects this control plane has no record of",
            runner=runner.public_id,
            projects=list(unknown[:20]),
            count=len(unknown),
        )
    return InventoryOutcome(
        runner=runner.public_id, listed=len(listed), resent=resent, unknown=unknown
    )
