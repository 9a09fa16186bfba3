from django.contrib import admin
from django.contrib.auth.admin import UserAdmin as BaseUserAdmin

from kestrel_one.accounts.models import ApiToken, User


@admin.register(User)
class UserAdmin(BaseUserAdmin):
    ordering = ["email"]
    list_display = ["email", "name", "is_active", "is_staff", "date_joined"]
    search_fields = ["email", "name"]
    readonly_fields = ["public_id", "date_joined", "last_login"]
    fieldsets = [
        (None, {"fields": ["public_id", "email", "name", "password"]}),
        (
            "Status",
            {"fields": ["is_active", "is_staff", "is_superuser", "date_joined", "last_login"]},
        ),
    ]
    add_fieldsets = [(None, {"fields": ["email", "password1", "password2"]})]
    filter_horizontal: list = []
    list_filter = ["is_active", "is_staff"]


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    """Operators can see and revoke tokens; the hash is never shown."""

    list_display = [
        "public_id",
        "name",
        "organization",
        "user",
        "expires_at",
        "revoked_at",
        "last_used_at",
    ]
    list_filter = ["organization"]
    search_fields = ["public_id", "name", "key_id"]
    fields = [
        "public_id",
        "name",
        "organization",
        "user",
        "scopes",
        "parent",
        "lineage",
        "all_projects",
        "projects",
        "checks",
        "expires_at",
        "revoked_at",
        "last_used_at",
        "created_at",
    ]
    # What a token may do is set only through token_create's rules, never edited here.
    readonly_fields = [
        "public_id",
        "organization",
        "user",
        "scopes",
        "parent",
        "lineage",
        "all_projects",
        "projects",
        "checks",
        "expires_at",
        "last_used_at",
        "created_at",
    ]

    def has_add_permission(self, request) -> bool:
        return False
