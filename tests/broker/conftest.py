"""The broker tests use the runner tests' real sandboxes and workspaces."""

from tests.execution.conftest import runner, runner_key, thread  # noqa: F401 - fixtures
from tests.runners.conftest import (  # noqa: F401 - fixtures
    bwrap_backend,
    call_labels,
    docker_client,
    engine,
    project,
    runner_id,
    runner_redis,
    workspace,
    workspace_root,
)
