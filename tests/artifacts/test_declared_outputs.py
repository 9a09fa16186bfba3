"""Declared outputs: files a tool returned become artifacts, judged and read under authority."""

from __future__ import annotations

import base64
import hashlib

import pytest

from kestrel_one.accounts.principal import system_principal
from kestrel_one.artifacts.models import Artifact
from kestrel_one.artifacts.storage import storage_read
from kestrel_one.execution.models import Receipt
from kestrel_one.execution.services import action_request
from kestrel_one.governance.services import policy_publish_environment
from kestrel_one.threads.services import thread_create
from runners.contract.arguments import MAX_OUTPUT_FILE_BYTES, MAX_OUTPUTS_TOTAL_BYTES
from tests.artifacts.conftest import person
from tests.factories import EnvironmentFactory, ProjectFactory

pytestmark = pytest.mark.spec("AUD-7")

SECRET = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256))


def output(path: str, data: bytes, **overrides) -> dict:
    """One output as the runner reports it (runners.tools.processes.collect_outputs)."""
    return {
        "path": path,
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "content_b64": base64.b64encode(data).decode("ascii"),
        **overrides,
    }


def shell_result(outputs: list[dict], exit_code: int = 0) -> dict:
    return {
        "exit_code": exit_code,
        "stdout": "built\n",
        "stderr": "",
        "truncated": False,
        "duration_ms": 12,
        "timed_out": False,
        "oom_killed": False,
        "sandbox": "docker",
        "outputs": outputs,
    }


def run_with_outputs(records, paths: list[str], outputs: list[dict], **kwargs):
    return records.run(
        "shell.exec", {"argv": ["make"], "outputs": paths}, shell_result(outputs), **kwargs
    )


def content_of(client, artifact_id: str):
    return client.get(f"/api/v1/orgs/acme/artifacts/{artifact_id}/content")


def test_declared_outputs_become_file_artifacts_that_download_byte_for_byte(world, records):
    report = b"all 12 tests passed\n"
    action = run_with_outputs(
        records,
        ["out/report.txt", "out/chart.png"],
        [output("out/report.txt", report), output("out/chart.png", PNG)],
    )
    assert action.state == "succeeded"
    kept = action.result["outputs"]
    artifacts = {item.name: item for item in Artifact.objects.filter(action=action, kind="file")}
    assert set(artifacts) == {"out/report.txt", "out/chart.png"}
    for item, data in zip(kept, (report, PNG), strict=True):
        artifact = artifacts[item["path"]]
        # The result keeps a reference, never the base64 bytes.
        assert item == {
            "path": artifact.name,
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "artifact": artifact.public_id,
        }
        assert artifact.size == len(data)
        assert artifact.sha256 == hashlib.sha256(data).hexdigest()
        assert (artifact.project, artifact.thread) == (action.project, action.thread)
        response = content_of(world["member"].client(), artifact.public_id)
        assert response.status_code == 200
        assert b"".join(response.streaming_content) == data
        assert response["Content-Disposition"].startswith("attachment;")
        assert response["X-Content-Type-Options"] == "nosniff"
    assert artifacts["out/report.txt"].content_type == "text/plain"
    assert artifacts["out/chart.png"].content_type == "image/png"
    receipt = Receipt.objects.get(action=action)
    assert receipt.result == action.result
    assert "content_b64" not in str(action.result) and "content_b64" not in str(receipt.result)


def test_unknown_file_types_are_octet_stream(records):
    action = run_with_outputs(records, ["build/app.kbin"], [output("build/app.kbin", PNG)])
    artifact = Artifact.objects.get(action=action, kind="file")
    assert artifact.content_type == "application/octet-stream"
    # Binary files are stored as they are.
    assert storage_read(artifact.storage_name) == PNG


def test_text_outputs_are_redacted_like_output_streams(records):
    data = f"deploy log\ntoken={SECRET}\n".encode()
    action = run_with_outputs(records, ["out/deploy.log"], [output("out/deploy.log", data)])
    (item,) = action.result["outputs"]
    assert item["redacted"] is True
    # What the runner reported about the file, and the artifact holding the redacted text.
    assert item["sha256"] == hashlib.sha256(data).hexdigest()
    artifact = Artifact.objects.get(public_id=item["artifact"])
    stored = storage_read(artifact.storage_name)
    assert SECRET.encode() not in stored and b"deploy log" in stored
    assert artifact.sha256 == hashlib.sha256(stored).hexdigest() != item["sha256"]


def test_a_sha256_mismatch_is_refused_and_nothing_is_stored(records):
    bad = output("out/report.txt", b"real bytes\n", sha256=hashlib.sha256(b"other").hexdigest())
    wrong_size = output("out/size.txt", b"sized\n", size=99)
    action = run_with_outputs(records, ["out/report.txt", "out/size.txt"], [bad, wrong_size])
    assert action.result["outputs"] == [
        {"path": "out/report.txt", "error": "sha256_mismatch"},
        {"path": "out/size.txt", "error": "size_mismatch"},
    ]
    assert not Artifact.objects.filter(action=action).exists()


def test_size_caps_hold_on_the_control_plane_too(records):
    big = b"z" * (MAX_OUTPUT_FILE_BYTES + 1)
    full = b"f" * MAX_OUTPUT_FILE_BYTES
    count = MAX_OUTPUTS_TOTAL_BYTES // MAX_OUTPUT_FILE_BYTES
    paths = ["big.bin"] + [f"part{n}.bin" for n in range(count + 1)]
    outputs = [output("big.bin", big)] + [output(path, full) for path in paths[1:]]
    action = run_with_outputs(records, paths, outputs)
    kept = action.result["outputs"]
    assert kept[0] == {"path": "big.bin", "error": "too_large"}
    assert all("artifact" in item for item in kept[1 : count + 1])
    assert kept[-1] == {"path": paths[-1], "error": "too_large"}
    assert Artifact.objects.filter(action=action).count() == count


def test_only_declared_paths_are_taken_and_runner_errors_are_kept(records):
    outputs = [
        output("../../etc/shadow", b"root:x\n"),
        output("undeclared.txt", b"sneaky\n"),
        {"path": "out/missing.txt", "error": "not_found"},
        {"path": "out/odd.txt", "error": "<script>"},
        "not an object",
    ]
    paths = ["out/missing.txt", "out/odd.txt", "out/silent.txt"]
    action = run_with_outputs(records, paths, outputs)
    assert action.result["outputs"] == [
        {"path": "out/missing.txt", "error": "not_found"},
        {"path": "out/odd.txt", "error": "invalid"},
        {"path": "out/silent.txt", "error": "not_reported"},
    ]
    assert not Artifact.objects.filter(action=action).exists()


@pytest.mark.spec("TEN-4")
def test_a_member_limited_to_another_project_gets_the_missing_404(world, records):
    action = run_with_outputs(records, ["out/report.txt"], [output("out/report.txt", b"private\n")])
    artifact_id = action.result["outputs"][0]["artifact"]
    missing = world["owner"].client().get("/api/v1/orgs/acme/artifacts/art_0000000000000000000000")
    for tail in ("", "/content"):
        response = world["limited"].client().get(f"/api/v1/orgs/acme/artifacts/{artifact_id}{tail}")
        assert response.status_code == 404
        assert response.content == missing.content
    assert content_of(world["owner"].client(), artifact_id).status_code == 200


@pytest.fixture
def narrow(world):
    """A project whose policy reads only out/**."""
    environment = EnvironmentFactory(organization=world.org, name="narrow")
    policy_publish_environment(
        actor=system_principal("tests"),
        environment=environment,
        document={
            "capabilities": {
                "fs.read": {"paths": ["out/**"]},
                "shell.exec": {"limits": {"timeout_s": 60}},
            }
        },
    )
    project = ProjectFactory(organization=world.org, environment=environment, name="narrow")
    thread = thread_create(
        actor=person(world["owner"]), project=project, title="narrow", mode="agent"
    )
    return project, thread


def test_declaring_an_unreadable_output_denies_the_call_naming_the_path(world, narrow, records):
    # ``records`` stands in for the broker, so the allowed call's dispatch sends nothing.
    project, thread = narrow
    allowed = action_request(
        actor=person(world["owner"]),
        thread=thread,
        tool="shell.exec",
        args={"argv": ["make"], "outputs": ["out/report.txt"]},
    )
    assert allowed.state == "queued"
    assert any("declared output 'out/report.txt'" in r for r in allowed.decision["reasons"])
    denied = action_request(
        actor=person(world["owner"]),
        thread=thread,
        tool="shell.exec",
        args={"argv": ["make"], "outputs": ["out/report.txt", ".env"]},
    )
    assert denied.state == "denied"
    (reason,) = denied.decision["reasons"]
    assert "declared output '.env' may not be read" in reason
    # Explain says the same as the decision (POL-6).
    explained = (
        world["owner"]
        .client()
        .post(
            f"/api/v1/orgs/acme/projects/{project.public_id}/explain",
            {
                "tool": "shell.exec",
                "args": {"argv": ["make"], "outputs": [".env"]},
                "mode": "agent",
            },
            content_type="application/json",
        )
    )
    assert explained.status_code == 200, explained.content
    assert explained.json()["decision"] == "deny"
    assert "'.env'" in explained.json()["reasons"][0]


def test_an_output_whose_read_needs_approval_makes_the_call_need_it(world):
    environment = EnvironmentFactory(organization=world.org, name="review")
    policy_publish_environment(
        actor=system_principal("tests"),
        environment=environment,
        document={
            "capabilities": {
                "fs.read": {"paths": ["**"], "approval": "always"},
                "shell.exec": {"limits": {"timeout_s": 60}},
            }
        },
    )
    project = ProjectFactory(organization=world.org, environment=environment, name="review")
    thread = thread_create(
        actor=person(world["owner"]), project=project, title="review", mode="agent"
    )
    plain = action_request(
        actor=person(world["owner"]), thread=thread, tool="shell.exec", args={"argv": ["make"]}
    )
    assert plain.state == "queued"
    declared = action_request(
        actor=person(world["owner"]),
        thread=thread,
        tool="shell.exec",
        args={"argv": ["make"], "outputs": ["out/report.txt"]},
    )
    assert declared.state == "awaiting_approval"
