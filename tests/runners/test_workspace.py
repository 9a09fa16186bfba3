"""File tools stay inside the workspace: no `..`, no absolute paths, no links (RUN-6)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from runners.contract.errors import InvalidArguments
from runners.dispatch import execute
from runners.sandbox import ExecLimits
from runners.workspace import (
    SANDBOX_UID,
    PathNotFound,
    PathRefused,
    Workspace,
    WrongFileType,
    workspace_for,
)

pytestmark = pytest.mark.spec("RUN-6")


@pytest.fixture
def outside(workspace_root: Path) -> Path:
    """A directory beside the workspace with a secret in it: the thing to protect."""
    directory = workspace_root / "outside"
    directory.mkdir()
    (directory / "secret.txt").write_text("secret")
    return directory


@pytest.fixture
def escapes(workspace: Path, outside: Path) -> Path:
    """Every kind of link a hostile command could have left in the workspace."""
    os.symlink("/etc", workspace / "etc")
    os.symlink(outside, workspace / "out")
    os.symlink(outside / "secret.txt", workspace / "secret-link")
    os.symlink("../outside/secret.txt", workspace / "relative-link")
    os.symlink(outside / "created-by-write", workspace / "dangling")
    os.symlink("inside-target", workspace / "inner-link")
    (workspace / "inside-target").write_text("inside")
    (workspace / "src").mkdir()
    os.symlink(outside, workspace / "src" / "lib")
    return workspace


def _tool(name: str, workspace: Path, **args):
    return execute(name, args, workspace=workspace, backend=None, limits=ExecLimits(), labels={})


def _outside_state(outside: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(outside.iterdir())}


# Links as the last component of a path, and links crossed in the middle of one.
LEAF_LINKS = ["etc", "out", "secret-link", "relative-link", "dangling", "inner-link", "src/lib"]
THROUGH_LINKS = ["etc/passwd", "out/secret.txt", "src/lib/secret.txt"]
LINK_PATHS = LEAF_LINKS + THROUGH_LINKS


@pytest.mark.parametrize("path", LINK_PATHS)
@pytest.mark.parametrize("tool", ["fs.read", "fs.list"])
def test_links_are_refused_not_followed(escapes, outside, tool, path):
    before = _outside_state(outside)
    with pytest.raises(PathRefused) as refused:
        _tool(tool, escapes, path=path)
    assert "symbolic link" in refused.value.reason
    assert _outside_state(outside) == before


@pytest.mark.parametrize("path", THROUGH_LINKS)
def test_deleting_through_a_link_is_refused(escapes, outside, path):
    with pytest.raises(PathRefused):
        _tool("fs.delete", escapes, path=path)
    assert _outside_state(outside) == {"secret.txt": b"secret"}
    assert Path("/etc/passwd").exists()


@pytest.mark.parametrize("path", LINK_PATHS)
def test_writes_through_links_are_refused(escapes, outside, path):
    before = _outside_state(outside)
    with pytest.raises(PathRefused):
        _tool("fs.write", escapes, path=path, content="pwned")
    with pytest.raises(PathRefused):
        _tool("fs.write", escapes, path=f"{path}/new.txt", content="pwned")
    assert _outside_state(outside) == before
    assert not (outside / "created-by-write").exists()
    assert Path("/etc/passwd").read_text() != "pwned"


@pytest.mark.parametrize(
    "path",
    ["../outside/secret.txt", "..", "a/../../outside", "/etc/passwd", "", "a\x00b", "./a", "a/"],
)
@pytest.mark.parametrize("tool", ["fs.read", "fs.write", "fs.list", "fs.delete"])
def test_unsafe_spellings_are_refused_before_anything_opens(workspace, outside, tool, path):
    args = {"path": path, "content": "x"} if tool == "fs.write" else {"path": path}
    with pytest.raises(InvalidArguments) as refused:
        execute(tool, args, workspace=workspace, backend=None, limits=ExecLimits(), labels={})
    assert refused.value.field == "args.path"
    with pytest.raises(PathRefused):
        Workspace(workspace).read(path, max_bytes=10)
    assert _outside_state(outside) == {"secret.txt": b"secret"}


def test_deleting_a_link_removes_the_link_and_never_its_target(escapes, outside):
    for link in LEAF_LINKS:
        assert _tool("fs.delete", escapes, path=link) == {"path": link, "type": "symlink"}
        assert not os.path.lexists(escapes / link)
    assert _outside_state(outside) == {"secret.txt": b"secret"}
    assert Path("/etc/passwd").exists()


def test_write_then_read_round_trips_and_reports_the_hash(workspace):
    content = "héllo\n"
    digest = hashlib.sha256(content.encode()).hexdigest()
    written = _tool("fs.write", workspace, path="src/pkg/mod.py", content=content)
    assert written == {"path": "src/pkg/mod.py", "size": 7, "sha256": digest}
    assert _tool("fs.read", workspace, path="src/pkg/mod.py") == {
        "path": "src/pkg/mod.py",
        "content": content,
        "size": 7,
        "sha256": digest,
        "truncated": False,
    }


def test_writing_the_same_content_twice_gives_the_same_result(workspace):
    first = _tool("fs.write", workspace, path="a.txt", content="same")
    assert _tool("fs.write", workspace, path="a.txt", content="same") == first
    assert sorted(p.name for p in workspace.iterdir()) == ["a.txt"]  # no temp file left


def test_write_replaces_atomically_and_leaves_no_temporary_file(workspace):
    (workspace / "a.txt").write_text("old")
    inode_before = (workspace / "a.txt").stat().st_ino
    _tool("fs.write", workspace, path="a.txt", content="new")
    assert (workspace / "a.txt").read_text() == "new"
    assert (workspace / "a.txt").stat().st_ino != inode_before
    assert [p.name for p in workspace.iterdir()] == ["a.txt"]


@pytest.mark.skipif(os.geteuid() != 0, reason="ownership hand-over only happens as root")
def test_files_and_directories_written_belong_to_the_sandbox_user(workspace):
    _tool("fs.write", workspace, path="new/dir/file.txt", content="x")
    for path in (
        workspace,
        workspace / "new",
        workspace / "new/dir",
        workspace / "new/dir/file.txt",
    ):
        assert path.stat().st_uid == SANDBOX_UID, path


def test_large_reads_are_truncated_but_size_and_hash_cover_the_whole_file(workspace):
    data = os.urandom(1024) * 1500
    (workspace / "big.bin").write_bytes(data)
    result = _tool("fs.read", workspace, path="big.bin")
    assert result["truncated"] is True
    assert result["size"] == len(data)
    assert result["sha256"] == hashlib.sha256(data).hexdigest()


def test_list_describes_entries_without_following_links(escapes):
    result = _tool("fs.list", escapes, path=".")
    entries = {entry["name"]: entry["type"] for entry in result["entries"]}
    assert entries["etc"] == "symlink"
    assert entries["dangling"] == "symlink"
    assert entries["src"] == "dir"
    assert entries["inside-target"] == "file"
    assert result["truncated"] is False


def test_missing_paths_and_wrong_types_are_reported(workspace):
    (workspace / "dir").mkdir()
    (workspace / "dir" / "f").write_text("x")
    with pytest.raises(PathNotFound):
        _tool("fs.read", workspace, path="nope.txt")
    with pytest.raises(PathNotFound):
        _tool("fs.list", workspace, path="nope/deeper")
    with pytest.raises(WrongFileType):
        _tool("fs.read", workspace, path="dir")
    with pytest.raises(WrongFileType):
        _tool("fs.list", workspace, path="dir/f")
    with pytest.raises(WrongFileType):
        _tool("fs.write", workspace, path="dir", content="x")
    with pytest.raises(WrongFileType):
        _tool("fs.delete", workspace, path="dir")  # not empty
    with pytest.raises(WrongFileType):
        _tool("fs.read", workspace, path=".")


def test_special_files_are_not_read(workspace):
    os.mkfifo(workspace / "pipe")
    with pytest.raises(WrongFileType):
        _tool("fs.read", workspace, path="pipe")


@pytest.mark.parametrize("project_id", ["", "..", ".", "a/b", "../x", "a\x00", "-rf", "x" * 129])
def test_project_ids_cannot_name_other_directories(workspace_root, project_id):
    with pytest.raises(PathRefused):
        workspace_for(workspace_root, project_id)


def test_a_workspace_that_is_a_link_is_refused(workspace_root, outside):
    os.symlink(outside, workspace_root / "prj_link")
    with pytest.raises(PathRefused):
        workspace_for(workspace_root, "prj_link")
    with pytest.raises(PathRefused):
        Workspace(workspace_root / "prj_link")
