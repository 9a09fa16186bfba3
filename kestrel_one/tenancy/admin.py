from django.contrib import admin

from kestrel_one.tenancy.models import Environment, Membership, Organization, Project


@admin.register(Organization)
class OrganizationAdmin(admin.ModelAdmin):
    list_display = ["slug", "name", "public_id", "created_at"]
    search_fields = ["slug", "name"]
    readonly_fields = ["public_id"]


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "organization", "role", "all_projects"]
    list_filter = ["role", "organization"]


@admin.register(Environment)
class EnvironmentAdmin(admin.ModelAdmin):
    list_display = ["name", "organization", "public_id"]
    list_filter = ["organization"]


@admin.register(Project)
class ProjectAdmin(admin.ModelAdmin):
    list_display = ["name", "organization", "environment", "public_id"]
    list_filter = ["organization"]
