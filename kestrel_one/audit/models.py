"""The per-organization audit log: append-only rows chained by hash."""

from __future__ import annotations

from django.db import models

from kestrel_one.common.ids import PublicIdField


class AuditChain(models.Model):
    """The head of one organization's audit chain; locking it serializes chaining."""

    organization = models.OneToOneField(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="audit_chain"
    )
    last_sequence = models.BigIntegerField(default=0)
    last_hash = models.CharField(max_length=64, default="0" * 64)
    # Where the stored chain starts once retention has trimmed its oldest records: the
    # first remaining record follows ``anchor_sequence`` and links to ``anchor_hash``. The
    # trim's own audit record repeats both, so a moved anchor does not verify.
    anchor_sequence = models.BigIntegerField(default=0)
    anchor_hash = models.CharField(max_length=64, default="0" * 64)
    anchored_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"audit chain of {self.organization_id} at {self.last_sequence}"


class AuditRecord(models.Model):
    """One sensitive action: who did what to which object, with what outcome."""

    public_id = PublicIdField("aud")
    organization = models.ForeignKey(
        "tenancy.Organization", on_delete=models.CASCADE, related_name="audit_records"
    )
    # Empty until the record is chained (kestrel_one.audit.services.audit_chain_settle),
    # shortly after the transaction that wrote it commits.
    sequence = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField()
    actor_type = models.CharField(max_length=16)
    actor_id = models.CharField(max_length=64)
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=32, blank=True)
    target_id = models.CharField(max_length=64, blank=True)
    outcome = models.CharField(max_length=16, default="success")
    data = models.JSONField(default=dict)
    request_id = models.CharField(max_length=64, blank=True)
    source_address = models.CharField(max_length=64, blank=True)
    prev_hash = models.CharField(max_length=64, blank=True)
    hash = models.CharField(max_length=64, blank=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["organization", "sequence"], name="audit_sequence_per_org"
            )
        ]
        indexes = [
            models.Index(fields=["organization", "action"]),
            models.Index(fields=["organization", "created_at"]),
            models.Index(
                fields=["organization", "id"],
                condition=models.Q(sequence__isnull=True),
                name="audit_pending_per_org",
            ),
        ]
        ordering = ["organization_id", "sequence"]

    def __str__(self) -> str:
        return f"#{self.sequence} {self.action} by {self.actor_id}"


def organization_model():
    """The model the log belongs to (tenancy's Organization), read from the records' foreign
    key: audit is the lowest of the apps and names no module of the apps above it."""
    return AuditRecord._meta.get_field("organization").related_model
