"""Credentials are encrypted at rest with envelope encryption bound to their place (CRED-1)."""

from __future__ import annotations

import stat

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connection

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.models import AuditRecord
from kestrel_one.credentials import crypto
from kestrel_one.credentials.models import Connection, Credential
from kestrel_one.credentials.release import CredentialRefused, secret_release
from kestrel_one.credentials.services import (
    connection_create,
    credential_create,
    credential_rotate,
)
from tests.credentials.helpers import assert_secret_free, person

SECRET = "ghp_PlantedCredentialSecret0123456789"
OTHER = "xoxb-PlantedConnectionSecret-987654"


def _make(world, *, name="github-main", secret=SECRET, organization=None):
    return credential_create(
        actor=system_principal("tests"),
        organization=organization or world.org,
        name=name,
        adapter="github",
        secret=secret,
    )


def _release(credential, organization):
    return secret_release(
        organization=organization,
        adapter=credential.adapter,
        reference={"credential": credential.public_id},
        user=None,
        token=None,
    )


@pytest.fixture
def key_file(tmp_path, settings):
    """A KEK of this test's own, so rotating it touches no other test."""
    path = tmp_path / "credentials_key"
    crypto.key_generate(path)
    settings.KESTREL_CREDENTIALS_KEY_FILE = path
    settings.KESTREL_CREDENTIALS_PREVIOUS_KEY_FILE = None
    return path


@pytest.mark.spec("CRED-1")
def test_the_database_holds_no_form_of_the_secret(world, key_file):
    credential = _make(world)
    connection_create(
        actor=person(world["member"]), organization=world.org, adapter="slack", secret=OTHER
    )
    with connection.cursor() as cursor:
        for table in (Credential._meta.db_table, Connection._meta.db_table):
            cursor.execute(f"SELECT * FROM {table}")  # noqa: S608 (our own table names)
            for row in cursor.fetchall():
                for value in row:
                    raw = bytes(value) if isinstance(value, memoryview) else str(value).encode()
                    assert_secret_free(raw, SECRET, OTHER)
                    assert_secret_free(raw.hex(), SECRET, OTHER)
    assert _release(credential, world.org).secret == SECRET
    assert credential.fingerprint.startswith("hmac-sha256:")
    assert_secret_free(credential.fingerprint, SECRET)


@pytest.mark.spec("CRED-1")
def test_a_row_copied_to_another_organization_or_record_does_not_decrypt(world, key_file):
    original = _make(world)
    same_org = _make(world, name="github-other", secret="ghp_aDifferentSecret42")
    foreign = _make(
        world, name="github-globex", secret="ghp_globexSecret77", organization=world.other_org
    )
    sealed = {
        "secret_ciphertext": bytes(original.secret_ciphertext),
        "data_key_wrapped": bytes(original.data_key_wrapped),
        "key_id": original.key_id,
    }
    for target, organization in ((same_org, world.org), (foreign, world.other_org)):
        Credential.objects.filter(pk=target.pk).update(**sealed)
        target.refresh_from_db()
        with pytest.raises(CredentialRefused) as refused:
            _release(target, organization)
        assert refused.value.code == "credential_unreadable"
        assert_secret_free(str(refused.value), SECRET)
    # The row left in place but bound to another adapter (an edited column) does not open.
    Credential.objects.filter(pk=original.pk).update(adapter="slack", kind="slack_bot_token")
    with pytest.raises(CredentialRefused) as refused:
        secret_release(
            organization=world.org,
            adapter="slack",
            reference={"credential": original.public_id},
            user=None,
            token=None,
        )
    assert refused.value.code == "credential_unreadable"


@pytest.mark.spec("CRED-1")
def test_rotating_the_key_rewraps_every_record_and_the_old_key_is_no_longer_needed(
    world, key_file, tmp_path, settings
):
    credential = _make(world)
    rotated = _make(world, name="rotated", secret="ghp_before")
    credential_rotate(actor=system_principal("tests"), credential=rotated, secret="ghp_after99")
    own = connection_create(
        actor=person(world["member"]), organization=world.org, adapter="slack", secret=OTHER
    )
    old_id = credential.key_id
    before = {r.pk: bytes(r.secret_ciphertext) for r in Credential.objects.all()}
    new_file = tmp_path / "credentials_key.new"

    call_command("rotate_credentials_key", "--new-key-file", str(new_file), "--generate")

    assert stat.S_IMODE(new_file.stat().st_mode) == 0o600
    new_id = crypto.key_load(new_file).key_id
    assert new_id != old_id
    for record in [*Credential.objects.all(), *Connection.objects.all()]:
        assert record.key_id == new_id
    # Only the data keys were re-wrapped: the secrets' own ciphertexts are unchanged.
    assert {r.pk: bytes(r.secret_ciphertext) for r in Credential.objects.all()} == before
    assert AuditRecord.objects.filter(
        action="credentials.key_rotate", organization=world.org
    ).exists()

    # The old key gone, the new one configured: everything still opens.
    key_file.unlink()
    settings.KESTREL_CREDENTIALS_KEY_FILE = new_file
    assert _release(credential, world.org).secret == SECRET
    assert _release(Credential.objects.get(pk=rotated.pk), world.org).secret == "ghp_after99"
    released = secret_release(
        organization=world.org,
        adapter="slack",
        reference={"connection": own.public_id},
        user=world["member"].user,
        token=world["member"].token,
    )
    assert released.secret == OTHER

    # And the old key alone opens nothing any more.
    crypto.key_generate(key_file)  # a stranger's key at the old path
    settings.KESTREL_CREDENTIALS_KEY_FILE = key_file
    with pytest.raises(CredentialRefused) as refused:
        _release(credential, world.org)
    assert refused.value.code == "credential_unreadable"


@pytest.mark.spec("CRED-1")
def test_a_rotation_started_under_the_previous_key_finishes_the_rewrap(
    world, key_file, tmp_path, settings
):
    """The zero-downtime order: every process first runs with the new key and the previous
    one; the command then re-wraps what the previous key still holds."""
    credential = _make(world)
    new_file = tmp_path / "next_key"
    crypto.key_generate(new_file)
    settings.KESTREL_CREDENTIALS_KEY_FILE = new_file
    settings.KESTREL_CREDENTIALS_PREVIOUS_KEY_FILE = str(key_file)
    assert _release(credential, world.org).secret == SECRET  # the previous key still opens it
    call_command("rotate_credentials_key", "--new-key-file", str(new_file))
    settings.KESTREL_CREDENTIALS_PREVIOUS_KEY_FILE = None
    key_file.unlink()
    assert _release(credential, world.org).secret == SECRET


def test_hosted_mode_needs_the_key_file_and_single_host_makes_one(tmp_path, settings):
    missing = tmp_path / "absent_key"
    settings.KESTREL_CREDENTIALS_KEY_FILE = missing
    settings.SINGLE_HOST = False
    with pytest.raises(ImproperlyConfigured, match="KESTREL_CREDENTIALS_KEY_FILE"):
        crypto.current_key()
    assert not missing.exists()
    settings.SINGLE_HOST = True
    made = crypto.current_key()
    assert stat.S_IMODE(missing.stat().st_mode) == 0o600
    assert crypto.current_key() == made
    missing.chmod(0o644)
    with pytest.raises(ImproperlyConfigured, match="chmod 600"):
        crypto.current_key()
