from django.contrib import admin, messages

from kestrel_one.accounts.principal import system_principal
from kestrel_one.execution.enrollment import runner_revoke
from kestrel_one.execution.models import Action, Runner


@admin.register(Runner)
class RunnerAdmin(admin.ModelAdmin):
    """Operators see every runner (platform and dedicated) and can revoke them."""

    list_display = [
        "public_id",
        "pool",
        "organization",
        "name",
        "enrolled_at",
        "revoked_at",
        "last_seen_at",
    ]
    list_filter = ["pool", "organization"]
    search_fields = ["public_id", "name"]
    readonly_fields = [
        "public_id",
        "organization",
        "pool",
        "public_key",
        "enrolled_by",
        "enrolled_at",
        "revoked_at",
        "last_seen_at",
    ]
    fields = ["public_id", "name", *readonly_fields[1:]]
    actions = ["revoke"]

    def has_add_permission(self, request) -> bool:
        return False  # enrollment needs the runner's public key: `manage.py runner_enroll`

    @admin.action(description="Revoke the selected runners")
    def revoke(self, request, queryset):
        for runner in queryset:
            runner_revoke(actor=system_principal(f"admin:{request.user.email}"), runner=runner)
        self.message_user(request, f"Revoked {queryset.count()} runner(s).", messages.SUCCESS)


@admin.register(Action)
class ActionAdmin(admin.ModelAdmin):
    """Read-only: actions change state only through their services."""

    list_display = ["public_id", "tool", "state", "organization", "project", "created_at"]
    list_filter = ["state", "tool"]
    search_fields = ["public_id"]

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False
