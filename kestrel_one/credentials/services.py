"""Credential writes: create, rotate and revoke; each audited in its own transaction with
fingerprints only (CRED-1). Connections are a person's own: only they create or revoke them
(TEN-5)."""

from __future__ import annotations

import re

from django.db import IntegrityError, transaction
from django.utils import timezone

from kestrel_one.adapters.registry import ADAPTERS, UnknownAdapter, get_adapter
from kestrel_one.audit.services import audit_record
from kestrel_one.common.errors import Conflict, NotFound, PermissionDenied, ValidationFailed
from kestrel_one.common.ids import new_public_id
from kestrel_one.credentials import crypto
from kestrel_one.credentials.models import Connection, Credential

SECRET_MAX_CHARS = 4096
# Secrets travel in one request header (registry Presentation): printable ASCII without
# spaces, so no CR/LF can split the header and no NUL can cut it.
_SECRET_FORM = re.compile(r"[\x21-\x7e]+")
MAX_CREDENTIALS_PER_ORGANIZATION = 200
MAX_CONNECTIONS_PER_PERSON = 50


def secret_check(secret) -> str:
    """The secret as given, or a refusal that never repeats it."""
    if not isinstance(secret, str) or not secret:
        reason = "must be a non-empty string"
    elif len(secret) > SECRET_MAX_CHARS:
        reason = f"must be at most {SECRET_MAX_CHARS} characters"
    elif not _SECRET_FORM.fullmatch(secret):
        reason = "must be printable ASCII without spaces or control characters"
    else:
        return secret
    raise ValidationFailed(
        f"secret: {reason} (it is not shown here).", details={"secret": [reason]}
    )


def adapter_check(adapter) -> str:
    try:
        return get_adapter(adapter).name
    except UnknownAdapter:
        allowed = ", ".join(sorted(ADAPTERS))
        reason = f"unknown adapter; the adapters are: {allowed}"
        raise ValidationFailed(f"adapter: {reason}.", details={"adapter": [reason]}) from None


def _aad(record, organization) -> bytes:
    return crypto.associated_data(
        organization_id=organization.public_id, record_id=record.public_id, adapter=record.adapter
    )


def _seal_into(record, organization, secret: str) -> None:
    sealed = crypto.seal(secret, aad=_aad(record, organization))
    record.secret_ciphertext = sealed.secret_ciphertext
    record.data_key_wrapped = sealed.data_key_wrapped
    record.key_id = sealed.key_id
    record.fingerprint = crypto.fingerprint(secret)


def _destroy(record) -> None:
    """What revoking leaves: the fingerprint and dates, no ciphertext to open ever again."""
    record.revoked_at = timezone.now()
    record.secret_ciphertext = b""
    record.data_key_wrapped = b""
    record.key_id = ""


# Organization credentials (admins) ---------------------------------------------------------


@transaction.atomic
def credential_create(*, actor, organization, name: str, adapter: str, secret: str) -> Credential:
    adapter = adapter_check(adapter)
    secret = secret_check(secret)
    if Credential.objects.for_org(organization).active().filter(name=name).exists():
        raise _name_taken(name)
    if Credential.objects.for_org(organization).active().count() >= (
        MAX_CREDENTIALS_PER_ORGANIZATION
    ):
        raise Conflict(
            f"An organization may hold at most {MAX_CREDENTIALS_PER_ORGANIZATION} credentials; "
            "revoke one first."
        )
    credential = Credential(
        public_id=new_public_id("crd"),
        organization=organization,
        name=name,
        adapter=adapter,
        kind=ADAPTERS[adapter].credential_kind,
        created_by=actor.actor_id,
    )
    _seal_into(credential, organization, secret)
    try:
        with transaction.atomic():
            credential.save()
    except IntegrityError:
        # A create of the same name committed between the check above and this insert: the
        # one active name per organization (the constraint) is the same refusal.
        raise _name_taken(name) from None
    audit_record(
        organization=organization,
        actor=actor,
        action="credential.create",
        target=credential,
        data={"name": name, "adapter": adapter, "fingerprint": credential.fingerprint},
    )
    return credential


def _name_taken(name: str) -> Conflict:
    return Conflict(
        f"The name '{name}' is already used by another credential in this organization.",
        details={"name": ["taken"]},
    )


@transaction.atomic
def credential_rotate(*, actor, credential: Credential, secret: str) -> Credential:
    """Replace the secret (a new data key too); the id and every reference to it stay."""
    secret = secret_check(secret)
    credential = Credential.objects.select_for_update().get(pk=credential.pk)
    if credential.revoked_at is not None:
        raise Conflict("This credential is revoked; create a new one.")
    previous = credential.fingerprint
    _seal_into(credential, credential.organization, secret)
    credential.rotated_at = timezone.now()
    credential.save()
    audit_record(
        organization=credential.organization,
        actor=actor,
        action="credential.rotate",
        target=credential,
        data={
            "name": credential.name,
            "adapter": credential.adapter,
            "fingerprint": credential.fingerprint,
            "previous_fingerprint": previous,
        },
    )
    return credential


@transaction.atomic
def credential_revoke(*, actor, credential: Credential) -> Credential:
    """Revoke for good: the ciphertext is erased, so nothing can release it again."""
    credential = Credential.objects.select_for_update().get(pk=credential.pk)
    if credential.revoked_at is not None:
        return credential
    _destroy(credential)
    credential.save()
    audit_record(
        organization=credential.organization,
        actor=actor,
        action="credential.revoke",
        target=credential,
        data={
            "name": credential.name,
            "adapter": credential.adapter,
            "fingerprint": credential.fingerprint,
        },
    )
    return credential


# Personal App connections (their owner only) -----------------------------------------------


@transaction.atomic
def connection_create(*, actor, organization, adapter: str, secret: str) -> Connection:
    """A connection of the person acting, for their own actions only (TEN-5)."""
    if not getattr(actor, "is_person", False):
        raise PermissionDenied(
            "An App connection belongs to a person: create it with your own token or in the "
            "console, not with an integration token."
        )
    adapter = adapter_check(adapter)
    secret = secret_check(secret)
    if Connection.objects.visible_to(actor, organization).active().count() >= (
        MAX_CONNECTIONS_PER_PERSON
    ):
        raise Conflict(
            f"A person may hold at most {MAX_CONNECTIONS_PER_PERSON} connections in an "
            "organization; revoke one first."
        )
    connection = Connection(
        public_id=new_public_id("con"),
        organization=organization,
        owner=actor.user,
        adapter=adapter,
        kind=ADAPTERS[adapter].credential_kind,
        created_by=actor.actor_id,
    )
    _seal_into(connection, organization, secret)
    connection.save()
    audit_record(
        organization=organization,
        actor=actor,
        action="connection.create",
        target=connection,
        data={
            "owner": actor.user.public_id,
            "adapter": adapter,
            "fingerprint": connection.fingerprint,
        },
    )
    return connection


@transaction.atomic
def connection_revoke(*, actor, connection: Connection) -> Connection:
    connection = (
        Connection.objects.select_for_update()
        .filter(pk=connection.pk)
        .select_related("organization", "owner")
        .first()
    )
    # Anyone but the owner meets the same answer as for a missing connection (TEN-5).
    if connection is None or not (
        getattr(actor, "is_person", False) and actor.user.pk == connection.owner_id
    ):
        raise NotFound("Not found.")
    if connection.revoked_at is not None:
        return connection
    _destroy(connection)
    connection.revoked_reason = "revoked"
    connection.save()
    audit_record(
        organization=connection.organization,
        actor=actor,
        action="connection.revoke",
        target=connection,
        data={
            "owner": connection.owner.public_id,
            "adapter": connection.adapter,
            "fingerprint": connection.fingerprint,
        },
    )
    return connection


def connections_end_for_member(*, organization_id: int, user_id: int) -> int:
    """A person who leaves an organization takes their connections' usability with them: each
    is revoked and erased, and stays so if they come back. Runs in the removal's
    transaction (the membership's delete signal)."""
    return Connection.objects.filter(
        organization_id=organization_id, owner_id=user_id, revoked_at__isnull=True
    ).update(
        revoked_at=timezone.now(),
        revoked_reason="owner_left",
        secret_ciphertext=b"",
        data_key_wrapped=b"",
        key_id="",
    )
