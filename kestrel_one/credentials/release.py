"""Releasing a credential's secret to the control tier, for one invocation (CRED-1, TEN-5).

The contract the adapter and gateway workers code against (design of issue 17):

- ``reference_check`` at request time: the reference names a usable record for this
  organization, adapter and requester; nothing is decrypted.
- ``secret_release`` in the worker, right before the one request that presents it.
- ``credential_default``: the organization's one active credential for an adapter.

A connection is usable only by its owner (or a token acting for that same person), while the
owner is still a member of the organization, while it is not revoked, and only for its own
adapter. Everyone else gets exactly the refusal a missing record gets (TEN-5). No refusal,
message or exception carries secret material.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kestrel_one.adapters.registry import ADAPTERS
from kestrel_one.common.errors import echo
from kestrel_one.credentials import crypto
from kestrel_one.credentials.models import Connection, Credential
from kestrel_one.tenancy.models import Membership

__all__ = [
    "CredentialRefused",
    "Released",
    "credential_default",
    "reference_check",
    "secret_release",
]


class CredentialRefused(Exception):
    """A credential reference that cannot be used; ``code`` and ``message`` are secret-free.

    Codes: ``unknown_adapter``, ``credential_reference_invalid``, ``credential_not_found``
    (missing, revoked, another adapter's, another person's), ``credential_ambiguous``
    (several org credentials and none named), ``credential_unreadable`` (the key this server
    holds does not open it).
    """

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Released:
    """A secret released for one invocation. Never log, store or return it."""

    secret: str = field(repr=False)
    record: str
    fingerprint: str
    kind: str


def _adapter(adapter) -> str:
    if not isinstance(adapter, str) or adapter not in ADAPTERS:
        raise CredentialRefused(
            "unknown_adapter",
            f"unknown adapter {echo(adapter)!r}; the adapters are: {', '.join(sorted(ADAPTERS))}",
        )
    return adapter


def _reference(reference) -> tuple[str, str]:
    if (
        not isinstance(reference, dict)
        or len(reference) != 1
        or not set(reference) <= {"credential", "connection"}
        or not isinstance(next(iter(reference.values())), str)
    ):
        raise CredentialRefused(
            "credential_reference_invalid",
            'name exactly one of {"credential": "crd_..."} or {"connection": "con_..."}',
        )
    ((noun, public_id),) = reference.items()
    return noun, public_id


def _not_found(noun: str, public_id: str, adapter: str) -> CredentialRefused:
    # One message for missing, revoked, another adapter's and another person's (TEN-5).
    return CredentialRefused(
        "credential_not_found",
        f"no usable {noun} {echo(public_id)} for adapter {adapter} in this organization",
    )


def _persons(user, token) -> set[int]:
    persons = set()
    if user is not None:
        persons.add(user.pk)
    if token is not None:
        # An integration token acts for no person: it can never use a connection.
        persons.add(token.user_id)
    return persons


def _usable_record(*, organization, adapter, reference, user, token):
    adapter = _adapter(adapter)
    noun, public_id = _reference(reference)
    kind = ADAPTERS[adapter].credential_kind
    if noun == "credential":
        record = (
            Credential.objects.for_org(organization)
            .active()
            .filter(public_id=public_id, adapter=adapter, kind=kind)
            .first()
        )
        if record is None:
            raise _not_found(noun, public_id, adapter)
        return record
    record = (
        Connection.objects.active()
        .filter(organization=organization, public_id=public_id, adapter=adapter, kind=kind)
        .first()
    )
    if (
        record is None
        # Exactly its owner: a token of another person, or one acting for nobody, is refused,
        # and so is a user and a token that disagree.
        or _persons(user, token) != {record.owner_id}
        or (token is not None and token.organization_id != organization.pk)
        or not Membership.objects.filter(
            organization=organization, user_id=record.owner_id
        ).exists()
    ):
        raise _not_found(noun, public_id, adapter)
    return record


def reference_check(*, organization, adapter: str, reference: dict, user, token) -> None:
    """Refuse (``CredentialRefused``) a reference this requester may not use; decrypts
    nothing."""
    _usable_record(
        organization=organization, adapter=adapter, reference=reference, user=user, token=token
    )


def secret_release(*, organization, adapter: str, reference: dict, user, token) -> Released:
    """The secret, checked exactly as ``reference_check`` checks it, for one invocation."""
    record = _usable_record(
        organization=organization, adapter=adapter, reference=reference, user=user, token=token
    )
    aad = crypto.associated_data(
        organization_id=organization.public_id, record_id=record.public_id, adapter=record.adapter
    )
    try:
        secret = crypto.unseal(
            secret_ciphertext=record.secret_ciphertext,
            data_key_wrapped=record.data_key_wrapped,
            key_id=record.key_id,
            aad=aad,
        )
    except crypto.SealBroken:
        raise CredentialRefused(
            "credential_unreadable",
            f"{record.public_id} cannot be decrypted with this server's credentials key "
            "(docs/credentials.md, key rotation)",
        ) from None
    return Released(
        secret=secret, record=record.public_id, fingerprint=record.fingerprint, kind=record.kind
    )


def credential_default(*, organization, adapter: str) -> str | None:
    """The public id of the organization's one active credential for ``adapter``; None when
    there is none; ``CredentialRefused`` when there are several (name one)."""
    adapter = _adapter(adapter)
    ids = list(
        Credential.objects.for_org(organization)
        .active()
        .filter(adapter=adapter)
        .order_by("public_id")
        .values_list("public_id", flat=True)[:2]
    )
    if len(ids) > 1:
        raise CredentialRefused(
            "credential_ambiguous",
            f"this organization holds several {adapter} credentials; name one with "
            '"credential": "crd_..."',
        )
    return ids[0] if ids else None
