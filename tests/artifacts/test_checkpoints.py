"""Checkpoints: a workspace to a bounded archive (runner side), kept as an artifact (control
plane), and restored through the normal action path."""

from __future__ import annotations

import base64
import gzip
import hashlib
import io
import os
import tarfile

import pytest

from kestrel_one.artifacts.models import Artifact, Checkpoint
from kestrel_one.artifacts.storage import storage_read
from kestrel_one.execution.arguments import action_arguments
from kestrel_one.execution.models import Action
from runners import dispatch
from runners.contract.errors import InvalidArguments
from runners.contract.registry import validate_args
from runners.sandbox import ExecLimits
from runners.tools import checkpoints
from runners.workspace import PathRefused, WrongFileType
from tests.artifacts.helpers import workspace_archive

pytestmark = pytest.mark.spec("AUD-5")


def run_tool(name, args, workspace):
    return dispatch.execute(
        name, args, workspace=workspace, backend=None, limits=ExecLimits(), labels={}
    )


def archive_of(members) -> dict:
    """A tar.gz built by hand, so that tests can put anything in it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for member, data in members:
            archive.addfile(member, io.BytesIO(data) if data is not None else None)
    raw = buffer.getvalue()
    return {
        "archive_b64": base64.b64encode(raw).decode(),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }


def member(name, kind=tarfile.REGTYPE, data=b"x", linkname=""):
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.linkname = linkname
    return info, data if kind == tarfile.REGTYPE else None


# --- runner side --------------------------------------------------------------------------


@pytest.mark.spec("RUN-6")
def test_checkpoint_and_restore_round_trip(tmp_path):
    source = tmp_path / "a"
    (source / "src" / "empty").mkdir(parents=True)
    (source / "src" / "app.py").write_text("print('v1')\n")
    (source / "run.sh").write_text("#!/bin/sh\n")
    taken = run_tool("workspace.checkpoint", {}, source)
    assert taken["files"] == 2 and taken["bytes"] == len("print('v1')\n#!/bin/sh\n")
    raw = base64.b64decode(taken["archive_b64"])
    assert hashlib.sha256(raw).hexdigest() == taken["sha256"] == hashlib.sha256(raw).hexdigest()
    # Same workspace, same bytes.
    assert run_tool("workspace.checkpoint", {}, source)["sha256"] == taken["sha256"]

    target = tmp_path / "b"
    target.mkdir()
    (target / "later.txt").write_text("made after the checkpoint\n")
    restored = run_tool(
        "workspace.restore",
        {"archive_b64": taken["archive_b64"], "sha256": taken["sha256"]},
        target,
    )
    assert restored["files"] == 2
    assert (target / "src" / "app.py").read_text() == "print('v1')\n"
    assert (target / "src" / "empty").is_dir()
    assert (target / "later.txt").exists()  # a restore writes back; it does not delete


@pytest.mark.spec("RUN-6")
def test_an_exact_restore_removes_what_came_since_and_follows_no_link(tmp_path):
    source = tmp_path / "a"
    (source / "src").mkdir(parents=True)
    (source / "src" / "app.py").write_text("v1\n")
    (source / "docs").mkdir()
    taken = run_tool("workspace.checkpoint", {}, source)
    args = {"archive_b64": taken["archive_b64"], "sha256": taken["sha256"], "exact": True}

    outside = tmp_path / "outside"
    (outside / "keep").mkdir(parents=True)
    (outside / "keep" / "precious.txt").write_text("not the workspace's\n")
    (source / "src" / "app.py").write_text("v2\n")
    (source / "src" / "new.py").write_text("made later\n")
    (source / "build" / "deep").mkdir(parents=True)
    (source / "build" / "deep" / "out.o").write_bytes(b"\0")
    (source / "docs" / "escape").symlink_to(outside / "keep")
    (source / "link.txt").symlink_to(outside / "keep" / "precious.txt")
    os.mkfifo(source / "pipe")
    (source / ".kestrel-tmp-write").write_text("a write in progress\n")

    restored = run_tool("workspace.restore", args, source)
    # new.py, build, build/deep, build/deep/out.o, docs/escape, link.txt, pipe
    assert restored["removed"] == 7
    remaining = sorted(str(p.relative_to(source)) for p in source.rglob("*"))
    assert remaining == [".kestrel-tmp-write", "docs", "src", "src/app.py"]
    assert (source / "src" / "app.py").read_text() == "v1\n"
    # The links were removed themselves; what they pointed at is untouched.
    assert (outside / "keep" / "precious.txt").read_text() == "not the workspace's\n"
    # Without exact, a restore removes nothing.
    (source / "src" / "new.py").write_text("made later\n")
    plain = run_tool("workspace.restore", {**args, "exact": False}, source)
    assert plain["removed"] == 0 and (source / "src" / "new.py").exists()


@pytest.mark.spec("RUN-6")
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
def test_checkpoint_refuses_links_and_special_files(tmp_path, kind):
    (tmp_path / "ok.txt").write_text("ok")
    if kind == "symlink":
        (tmp_path / "escape").symlink_to("/etc")
    else:
        os.mkfifo(tmp_path / "pipe")
    with pytest.raises(PathRefused):
        run_tool("workspace.checkpoint", {}, tmp_path)


def test_checkpoint_refuses_a_workspace_over_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints, "MAX_CONTENT_BYTES", 1000)
    (tmp_path / "big.bin").write_bytes(os.urandom(2000))
    with pytest.raises(checkpoints.CheckpointRefused, match="bytes of content"):
        run_tool("workspace.checkpoint", {}, tmp_path)
    monkeypatch.setattr(checkpoints, "MAX_CONTENT_BYTES", 10**6)
    monkeypatch.setattr(checkpoints, "MAX_ARCHIVE_BYTES", 1000)
    with pytest.raises(checkpoints.CheckpointRefused, match="archive would exceed"):
        run_tool("workspace.checkpoint", {}, tmp_path)


@pytest.mark.spec("RUN-6")
@pytest.mark.parametrize(
    "bad",
    [
        member("/etc/passwd"),
        member("../outside.txt"),
        member("src/../../outside.txt"),
        member("./src/a.py"),
        member("src//a.py"),
        member("link", tarfile.SYMTYPE, linkname="/etc/passwd"),
        member("hard", tarfile.LNKTYPE, linkname="src/a.py"),
        member("dev", tarfile.CHRTYPE),
        member("fifo", tarfile.FIFOTYPE),
    ],
    ids=[
        "absolute",
        "dotdot",
        "nested-dotdot",
        "dot",
        "double-slash",
        "symlink",
        "hardlink",
        "device",
        "fifo",
    ],
)
def test_restore_refuses_unsafe_members_and_writes_nothing(tmp_path, bad):
    args = archive_of([member("src/a.py", data=b"fine"), bad])
    with pytest.raises((checkpoints.CheckpointRefused, PathRefused)):
        run_tool("workspace.restore", args, tmp_path)
    assert list(tmp_path.iterdir()) == []  # checked whole before anything is written
    assert not (tmp_path.parent / "outside.txt").exists()


def test_restore_refuses_a_wrong_digest_or_a_link_in_the_workspace(tmp_path):
    args = archive_of([member("src/a.py", data=b"fine")])
    with pytest.raises(checkpoints.CheckpointRefused, match="sha256"):
        run_tool("workspace.restore", {**args, "sha256": "0" * 64}, tmp_path)
    (tmp_path / "src").symlink_to(tmp_path.parent)
    with pytest.raises(PathRefused):
        run_tool("workspace.restore", args, tmp_path)
    with pytest.raises(InvalidArguments):
        validate_args("workspace.restore", {"archive_b64": "not base64!", "sha256": "0" * 64})
    with pytest.raises(InvalidArguments):
        validate_args("workspace.checkpoint", {"path": "."})


def test_a_restore_that_fails_part_way_leaves_the_workspace_as_it_was(tmp_path):
    """The archive is sound, but the workspace holds a file where the third member needs a
    directory: nothing the restore would have written before that remains (the first two
    files are not replaced, no directory it made is left), so a failed restore never leaves
    a half-restored workspace (docs/records.md)."""
    (tmp_path / "a.txt").write_bytes(b"old a")
    (tmp_path / "blocker").write_bytes(b"a file, not a directory")
    args = archive_of(
        [
            member("a.txt", data=b"new a"),
            member("fresh/b.txt", data=b"new b"),
            member("blocker/c.txt", data=b"new c"),
        ]
    )
    with pytest.raises(WrongFileType):
        run_tool("workspace.restore", args, tmp_path)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a.txt", "blocker"]
    assert (tmp_path / "a.txt").read_bytes() == b"old a"
    assert (tmp_path / "blocker").read_bytes() == b"a file, not a directory"


@pytest.mark.spec("RUN-3")
@pytest.mark.parametrize("kind", [tarfile.XHDTYPE, tarfile.GNUTYPE_LONGNAME])
def test_an_oversized_extended_header_is_refused_before_it_is_read(tmp_path, kind):
    """A small archive whose extended header declares 900 MB (it decompresses to that) used
    to be read whole into memory by tarfile; it is refused from its declared size, naming
    the limit, before a byte of it is read."""
    declared = 900 * 1024 * 1024
    header = tarfile.TarInfo("././@PaxHeader")
    header.type = kind
    header.size = declared
    block = header.tobuf(format=tarfile.USTAR_FORMAT if kind == tarfile.XHDTYPE else 2)
    raw_tar = block + b"\0" * (2 * 1024 * 1024)  # the start of the declared header's body
    raw = gzip.compress(raw_tar)
    args = {
        "archive_b64": base64.b64encode(raw).decode(),
        "sha256": hashlib.sha256(raw).hexdigest(),
    }
    with pytest.raises(checkpoints.CheckpointRefused, match="extended tar header") as refused:
        run_tool("workspace.restore", args, tmp_path)
    assert str(declared) in str(refused.value)
    assert str(checkpoints.MAX_EXTENDED_HEADER_BYTES) in str(refused.value)
    assert list(tmp_path.iterdir()) == []


# --- control plane ------------------------------------------------------------------------


def test_a_checkpoint_result_is_kept_as_an_artifact_not_in_the_result(world, records):
    reported = workspace_archive({"src/app.py": "print('v1')\n"})
    action = records.run("workspace.checkpoint", {}, reported)
    checkpoint = Checkpoint.objects.get(action=action)
    assert "archive_b64" not in str(action.result) and "archive_b64" not in str(
        action.receipt.result
    )
    assert action.result["checkpoint"] == checkpoint.public_id
    assert storage_read(checkpoint.artifact.storage_name) == base64.b64decode(
        reported["archive_b64"]
    )
    assert checkpoint.artifact.sha256 == reported["sha256"]
    assert checkpoint.artifact.content_type == "application/gzip"
    base = f"/api/v1/orgs/acme/projects/{records.project.public_id}/checkpoints"
    listed = world["viewer"].client().get(base).json()["results"]
    assert [c["id"] for c in listed] == [checkpoint.public_id]
    assert world["limited"].client().get(f"{base}/{checkpoint.public_id}").status_code == 404
    replay = (
        world["owner"]
        .client()
        .get(
            f"/api/v1/orgs/acme/projects/{records.project.public_id}"
            f"/threads/{records.thread.public_id}/replay"
        )
    )
    assert [c["id"] for c in replay.json()["checkpoints"]] == [checkpoint.public_id]


def test_a_report_whose_archive_does_not_match_keeps_no_checkpoint(records):
    reported = {**workspace_archive(), "sha256": "f" * 64}
    action = records.run("workspace.checkpoint", {}, reported)
    assert not Checkpoint.objects.filter(action=action).exists()
    assert not Artifact.objects.filter(action=action).exists()
    assert action.result["checkpoint"] is None and "archive_b64" not in action.result


@pytest.mark.spec("AUD-5", "POL-2")
def test_restore_is_requested_as_an_action_under_policy(world, records, tmp_path):
    action = records.run("workspace.checkpoint", {}, workspace_archive({"a.txt": "v1\n"}))
    checkpoint = Checkpoint.objects.get(action=action)
    url = (
        f"/api/v1/orgs/acme/projects/{records.project.public_id}"
        f"/checkpoints/{checkpoint.public_id}/restore"
    )
    assert world["viewer"].client().post(url, {}, format="json").status_code == 403
    response = world["member"].client().post(url, {}, format="json")
    assert response.status_code == 201, response.content
    restore = Action.objects.get(public_id=response.json()["action"])
    assert restore.tool == "workspace.restore" and restore.state == "queued"
    assert restore.args["sha256"] == checkpoint.artifact.sha256
    # What the runner will be sent (the exact arguments, kept sealed until the command is
    # sent; the stored args show the archive redacted) restores the workspace.
    run_tool("workspace.restore", action_arguments(restore), tmp_path)
    assert (tmp_path / "a.txt").read_text() == "v1\n"

    # In the shared world's project, fs.write covers src/** and out/** only: a restore of the
    # whole workspace would widen that, so it is denied, and nothing is dispatched.
    from tests.api.routes import records_objects

    walker_checkpoint = records_objects(world)[2]
    denied = (
        world["member"]
        .client()
        .post(
            f"/api/v1/orgs/acme/projects/{world.project.public_id}"
            f"/checkpoints/{walker_checkpoint.public_id}/restore",
            {"thread": world.thread.public_id},
            format="json",
        )
    )
    assert denied.status_code == 201 and denied.json()["state"] == "denied"
    other = world["member"].client().post(url, {"thread": world.thread.public_id}, format="json")
    assert other.status_code == 400 and "thread" in other.json()["error"]["details"]


def test_an_exact_restore_is_named_in_the_arguments_an_approval_binds(world, records):
    action = records.run("workspace.checkpoint", {}, workspace_archive({"a.txt": "v1\n"}))
    checkpoint = Checkpoint.objects.get(action=action)
    url = (
        f"/api/v1/orgs/acme/projects/{records.project.public_id}"
        f"/checkpoints/{checkpoint.public_id}/restore"
    )
    member = world["member"].client()
    exact = member.post(url, {"exact": True}, format="json")
    plain = member.post(url, {}, format="json")
    assert exact.status_code == plain.status_code == 201
    exact_action = Action.objects.get(public_id=exact.json()["action"])
    plain_action = Action.objects.get(public_id=plain.json()["action"])
    assert exact_action.args["exact"] is True and "exact" not in plain_action.args
    assert exact_action.args_digest != plain_action.args_digest
    validate_args("workspace.restore", action_arguments(exact_action))
    wrong = member.post(url, {"exact": "yes please"}, format="json")
    assert wrong.status_code == 400 and "exact" in wrong.json()["error"]["details"]
