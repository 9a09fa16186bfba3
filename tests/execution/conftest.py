"""Fixtures for the execution path: a thread, an enrolled runner and its private key."""

from __future__ import annotations

import pytest

from kestrel_one.accounts.principal import system_principal
from kestrel_one.execution.enrollment import runner_enroll
from kestrel_one.threads.services import thread_create
from runners.contract.tokens import generate_private_key_pem, public_key_pem


@pytest.fixture
def thread(world):
    return thread_create(
        actor=system_principal("tests"),
        project=world.project,
        title="fix the build",
        mode="agent",
    )


@pytest.fixture
def runner_key() -> bytes:
    return generate_private_key_pem()


@pytest.fixture
def runner(db, runner_key):
    return runner_enroll(
        actor=system_principal("tests"),
        pool="default",
        public_key_pem=public_key_pem(runner_key).decode(),
    )
