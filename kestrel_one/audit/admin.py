from django.contrib import admin

from kestrel_one.audit.models import AuditRecord


@admin.register(AuditRecord)
class AuditRecordAdmin(admin.ModelAdmin):
    """Read-only: the audit log is append-only, operators included."""

    list_display = [
        "organization",
        "sequence",
        "created_at",
        "actor_id",
        "action",
        "target_id",
        "outcome",
    ]
    list_filter = ["organization", "action", "outcome"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
