"""Output past the inline cap is kept whole as an artifact, read under the caller's authority."""

from __future__ import annotations

import hashlib

import pytest
from django.conf import settings

from kestrel_one.artifacts.models import Artifact
from kestrel_one.artifacts.storage import storage_exists, storage_read
from kestrel_one.execution.models import Receipt

pytestmark = pytest.mark.spec("AUD-7")

SECRET = "ghp_" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4o5P6q7R8"


def shell_result(stdout: str, stderr: str = "") -> dict:
    return {
        "exit_code": 0,
        "stdout": stdout,
        "stderr": stderr,
        "truncated": False,
        "duration_ms": 12,
        "timed_out": False,
        "oom_killed": False,
        "sandbox": "docker",
    }


@pytest.fixture
def long_output(records):
    stdout = "".join(f"line {n}: building\n" for n in range(4000)) + f"token={SECRET}\n"
    action = records.run("shell.exec", {"argv": ["make"]}, shell_result(stdout, "warn\n"))
    return action, stdout


def test_output_past_the_cap_becomes_an_artifact_and_stays_inline_in_part(long_output):
    action, stdout = long_output
    cap = settings.KESTREL_ARTIFACT_INLINE_BYTES
    assert len(stdout.encode()) > cap
    artifact = Artifact.objects.get(action=action)
    assert artifact.kind == "stdout"
    assert action.result["artifacts"] == {"stdout": artifact.public_id}
    inline = action.result["stdout"]
    assert inline.startswith("line 0: building\n")
    assert f"the full text is artifact {artifact.public_id}" in inline
    assert len(inline.encode()) < cap + 200
    # Short streams stay as they were.
    assert action.result["stderr"] == "warn\n"
    # The receipt keeps the same projection, never the megabytes.
    assert Receipt.objects.get(action=action).result == action.result

    stored = storage_read(artifact.storage_name)
    assert artifact.size == len(stored)
    assert artifact.sha256 == hashlib.sha256(stored).hexdigest()
    text = stored.decode()
    assert text.count("building") == 4000
    # Artifacts are secret-free too (CRED-1).
    assert SECRET not in text and "[redacted]" in text
    assert artifact.project == action.project and artifact.thread == action.thread


def test_metadata_and_content_download_for_readers(world, long_output):
    action, _ = long_output
    artifact = Artifact.objects.get(action=action)
    url = f"/api/v1/orgs/acme/artifacts/{artifact.public_id}"
    for name in ("owner", "member", "viewer"):
        meta = world[name].client().get(url)
        assert meta.status_code == 200, meta.content
        assert meta.json()["sha256"] == artifact.sha256
        assert meta.json()["action"] == action.public_id
        content = world[name].client().get(f"{url}/content")
        assert content.status_code == 200
        body = b"".join(content.streaming_content)
        assert hashlib.sha256(body).hexdigest() == artifact.sha256
        assert content["Content-Type"] == "text/plain; charset=utf-8"
        assert content["Content-Disposition"].startswith("attachment;")
        assert f"{action.public_id}.stdout.txt" in content["Content-Disposition"]
        assert content["X-Content-Type-Options"] == "nosniff"
        assert content["Content-Length"] == str(artifact.size)


@pytest.mark.spec("TEN-4")
def test_limited_members_and_outsiders_get_the_missing_404(world, long_output):
    action, _ = long_output
    artifact = Artifact.objects.get(action=action)
    missing = world["owner"].client().get("/api/v1/orgs/acme/artifacts/art_0000000000000000000000")
    assert missing.status_code == 404
    for name in ("limited",):
        for tail in ("", "/content"):
            response = (
                world[name].client().get(f"/api/v1/orgs/acme/artifacts/{artifact.public_id}{tail}")
            )
            assert response.status_code == 404
            assert response.content == missing.content
    outsider = world["outsider"].client()
    for org in ("acme", "globex"):
        response = outsider.get(f"/api/v1/orgs/{org}/artifacts/{artifact.public_id}/content")
        assert response.status_code == 404
    listed = world["limited"].client().get("/api/v1/orgs/acme/artifacts").json()["results"]
    assert artifact.public_id not in [item["id"] for item in listed]
    assert world["outsider"].client().get("/api/v1/orgs/globex/artifacts").json()["results"] == []


def test_deleting_the_row_deletes_the_file_after_commit(
    long_output, django_capture_on_commit_callbacks
):
    action, _ = long_output
    artifact = Artifact.objects.get(action=action)
    assert storage_exists(artifact.storage_name)
    with django_capture_on_commit_callbacks(execute=True):
        artifact.delete()
    assert not storage_exists(artifact.storage_name)
