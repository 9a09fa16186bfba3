"""Reads for threads."""

from __future__ import annotations


def scope_of(*, organization, environment, project, thread) -> dict:
    """The org/env/prj/thr scope that approvals, commands, receipts and control messages bind
    to; the one place it is spelled."""
    return {
        "org": organization.public_id,
        "env": environment.public_id,
        "prj": project.public_id,
        "thr": thread.public_id,
    }


def thread_scope(thread) -> dict:
    """A thread's scope, through its project's environment."""
    project = thread.project
    return scope_of(
        organization=thread.organization,
        environment=project.environment,
        project=project,
        thread=thread,
    )
