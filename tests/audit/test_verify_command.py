"""``manage.py audit_verify``: exit 0 with a summary when intact, non-zero naming the break."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from io import StringIO
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from kestrel_one.audit.models import AuditRecord
from tests.audit.helpers import append_records, tampering
from tests.factories import OrganizationFactory

REPO = Path(__file__).resolve().parents[2]


def run_command(*args: str) -> subprocess.CompletedProcess:
    """The real command in a new process, against this test run's database."""
    settings = connection.settings_dict
    url = f"postgres://{settings['USER']}@{settings['HOST']}:{settings['PORT']}/{settings['NAME']}"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "kestrel_one.settings_test"}
    env["TEST_DATABASE_URL"] = url
    return subprocess.run(
        [sys.executable, "manage.py", "audit_verify", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.spec("AUD-1")
@pytest.mark.django_db(transaction=True)
def test_exit_codes_of_a_real_process():
    organization = OrganizationFactory(slug="verify-me")
    append_records(organization, 12)

    intact = run_command("--org", "verify-me")
    assert intact.returncode == 0, intact.stderr
    assert "intact, 12 record(s)" in intact.stdout

    record = AuditRecord.objects.get(organization=organization, sequence=5)
    with tampering():
        AuditRecord.objects.filter(pk=record.pk).update(action="token.revoke")  # skips hashing
    broken = run_command("--org", "verify-me")
    assert broken.returncode == 1
    assert f"record #5 ({record.public_id})" in broken.stderr
    assert "edited" in broken.stderr

    unknown = run_command("--org", "no-such-org")
    assert unknown.returncode == 2
    assert "no-such-org" in unknown.stderr


def test_help_describes_the_command():
    completed = subprocess.run(
        [sys.executable, "manage.py", "audit_verify", "--help"],
        cwd=REPO,
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "kestrel_one.settings_test"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert completed.returncode == 0
    assert "--org SLUG" in completed.stdout
    assert "first bad record" in completed.stdout.replace("\n", " ").replace("  ", " ")


@pytest.mark.spec("AUD-1")
def test_call_command_reports_intact_and_broken_chains(db):
    organization = OrganizationFactory(slug="in-process")
    append_records(organization, 4)
    out = StringIO()
    call_command("audit_verify", "--org", "in-process", stdout=out)
    assert "intact" in out.getvalue()

    with tampering():
        AuditRecord.objects.filter(organization=organization, sequence=4).delete()
    err = StringIO()
    with pytest.raises(SystemExit) as exit_info:
        call_command("audit_verify", "--org", "in-process", stderr=err)
    assert exit_info.value.code == 1
    assert "BROKEN" in err.getvalue()

    with pytest.raises(CommandError):
        call_command("audit_verify", "--org", "missing")


@pytest.mark.spec("AUD-1")
@pytest.mark.django_db(transaction=True)
def test_a_real_process_checks_a_kept_head(tmp_path):
    from kestrel_one.audit.heads import audit_head_sign
    from tests.audit.test_signed_heads import rewrite_tail

    organization = OrganizationFactory(slug="kept-head")
    append_records(organization, 8)
    head = tmp_path / "head.json"
    head.write_text(json.dumps(audit_head_sign(organization)))
    append_records(organization, 2, start=8)

    intact = run_command("--org", "kept-head", "--head", str(head))
    assert intact.returncode == 0, intact.stderr
    assert "record #8 matches" in intact.stdout

    rewrite_tail(organization, start=5)
    assert run_command("--org", "kept-head").returncode == 0  # every hash was recomputed
    rewritten = run_command("--org", "kept-head", "--head", str(head))
    assert rewritten.returncode == 1
    assert "record #8 does not have the hash" in rewritten.stderr

    missing = run_command("--org", "kept-head", "--head", str(tmp_path / "absent.json"))
    assert missing.returncode == 2 and "Cannot read" in missing.stderr
