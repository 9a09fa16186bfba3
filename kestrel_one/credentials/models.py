"""Credentials: an organization's (admin-managed) and a person's own App connections (CRED-1,
TEN-5).

Both hold one secret for one adapter of the static registry, sealed by envelope encryption
(kestrel_one.credentials.crypto): the secret is encrypted under a data key of its own, and the
data key is wrapped by the key-encryption key. Nothing here is ever the plaintext.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models

from kestrel_one.common.ids import PublicIdField


class SealedSecret(models.Model):
    """What both kinds of record keep of their secret: ciphertexts and a fingerprint."""

    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="+"
    )
    adapter = models.CharField(max_length=64)
    # The credential kind the adapter takes (registry), kept so a record names what it holds.
    kind = models.CharField(max_length=64)
    # nonce || AES-GCM(data key, secret); nonce || AES-GCM(KEK, data key). Emptied on revoke.
    secret_ciphertext = models.BinaryField(default=b"")
    data_key_wrapped = models.BinaryField(default=b"")
    # Which key-encryption key wrapped the data key (its fingerprint), so rotation and
    # release know which key a record needs.
    key_id = models.CharField(max_length=32, blank=True)
    fingerprint = models.CharField(max_length=80)
    created_by = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    rotated_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        abstract = True

    @property
    def state(self) -> str:
        return "revoked" if self.revoked_at is not None else "active"


class CredentialQuerySet(models.QuerySet):
    def for_org(self, organization) -> CredentialQuerySet:
        return self.filter(organization=organization)

    def active(self) -> CredentialQuerySet:
        return self.filter(revoked_at__isnull=True)


class Credential(SealedSecret):
    """An organization's credential for one adapter, managed by its admins."""

    public_id = PublicIdField("crd")
    name = models.CharField(max_length=100)

    objects = CredentialQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["organization", "adapter"])]
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "name"],
                condition=models.Q(revoked_at__isnull=True),
                name="one_active_credential_name_per_org",
            )
        ]

    def __str__(self) -> str:
        return f"{self.public_id} {self.name} ({self.adapter})"


class ConnectionQuerySet(models.QuerySet):
    def visible_to(self, principal, organization) -> ConnectionQuerySet:
        """Only the caller's own connections in the organization: nobody else's, whatever
        their role (TEN-5). An integration token (no person) and the local agent have none."""
        if not getattr(principal, "is_person", False):
            return self.none()
        return self.filter(organization=organization, owner=principal.user)

    def active(self) -> ConnectionQuerySet:
        return self.filter(revoked_at__isnull=True)


class Connection(SealedSecret):
    """A person's own App connection for one adapter in one organization (TEN-5)."""

    public_id = PublicIdField("con")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    # Why it stopped working: "revoked" by its owner, or "owner_left" the organization.
    revoked_reason = models.CharField(max_length=20, blank=True)

    objects = ConnectionQuerySet.as_manager()

    class Meta:
        indexes = [models.Index(fields=["organization", "owner"])]

    def __str__(self) -> str:
        return f"{self.public_id} ({self.adapter})"
