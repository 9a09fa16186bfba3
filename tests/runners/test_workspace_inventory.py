"""What a runner host says it keeps: the projects with a workspace on it (runners.inventory)."""

from __future__ import annotations

import threading

from runners import inventory as inventory_module
from runners.contract.inventory import verify_workspace_inventory
from runners.contract.tokens import generate_private_key_pem, public_key_pem
from runners.heartbeat import PROBE_WORKSPACE
from runners.inventory import inventory_tokens, start_workspace_inventory
from runners.workspace import WorkspaceQuota
from tests.runners.support import runner_config

RUNNER_ID = "run_inventory"


def config_in(tmp_path, root):
    key = generate_private_key_pem()
    config = runner_config(
        tmp_path,
        runner_id=RUNNER_ID,
        pool="default",
        runner_key=key,
        control_public_key=public_key_pem(generate_private_key_pem()),
        workspace_root=root,
    )
    return config, public_key_pem(key)


def listed(tokens, public_key) -> list[tuple]:
    parts = [
        verify_workspace_inventory(token, runner_public_key=public_key, runner_id=RUNNER_ID)
        for token in tokens
    ]
    return [(part.part, part.parts, part.projects) for part in parts]


def test_the_inventory_lists_every_projects_workspace_and_nothing_else(tmp_path):
    root = tmp_path / "workspaces"
    root.mkdir()
    for name in ("prj_a", "prj_b", PROBE_WORKSPACE):
        (root / name).mkdir()
    (root / "prj_file").write_text("not a workspace")
    (root / "prj_link").symlink_to(root / "prj_a")
    quota = WorkspaceQuota(root)
    quota.folder.mkdir()
    quota.image("prj_c").write_bytes(b"")  # an image whose workspace directory is gone
    (quota.folder / "prj_a.lock").write_bytes(b"")
    config, public_key = config_in(tmp_path, root)
    assert listed(inventory_tokens(config), public_key) == [(1, 1, ("prj_a", "prj_b", "prj_c"))]


def test_a_large_inventory_comes_in_parts_and_an_empty_one_still_comes(tmp_path, monkeypatch):
    root = tmp_path / "workspaces"
    root.mkdir()
    config, public_key = config_in(tmp_path, root)
    assert listed(inventory_tokens(config), public_key) == [(1, 1, ())]
    for name in ("prj_1", "prj_2", "prj_3"):
        (root / name).mkdir()
    monkeypatch.setattr(inventory_module, "MAX_INVENTORY_PROJECTS", 2)
    assert listed(inventory_tokens(config), public_key) == [
        (1, 2, ("prj_1", "prj_2")),
        (2, 2, ("prj_3",)),
    ]


def test_the_inventory_is_sent_as_the_runner_starts(tmp_path):
    root = tmp_path / "workspaces"
    root.mkdir()
    (root / "prj_kept").mkdir()
    config, public_key = config_in(tmp_path, root)
    sent: list[str] = []
    arrived = threading.Event()

    def send(token: str) -> None:
        sent.append(token)
        arrived.set()

    stop = start_workspace_inventory(config, send, interval=3600)
    try:
        assert arrived.wait(30), "no inventory was sent at start"
    finally:
        stop.set()
    assert listed(sent[:1], public_key) == [(1, 1, ("prj_kept",))]
