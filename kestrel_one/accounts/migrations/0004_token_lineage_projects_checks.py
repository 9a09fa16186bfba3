"""Tokens record their minting chain (lineage), integration tokens an explicit project set and
the checks they may speak for.

Existing tokens become roots of their own lineage. An existing integration token keeps what
its creator could see when it is migrated: every project when an operator made it (no
creator) or its creator sees all of them, else exactly the creator's granted projects, and
none when its creator is no longer a member (fail closed).
"""

import django.db.models.deletion
from django.db import migrations, models
from django.db.models import F


def fill_lineage_and_projects(apps, schema_editor):
    ApiToken = apps.get_model("accounts", "ApiToken")
    Membership = apps.get_model("tenancy", "Membership")
    Grant = apps.get_model("tenancy", "ProjectUserObjectPermission")
    ApiToken.objects.filter(lineage="").update(lineage=F("public_id"))
    for token in ApiToken.objects.filter(user__isnull=True).iterator():
        if token.created_by_id is None:
            ApiToken.objects.filter(pk=token.pk).update(all_projects=True)
            continue
        membership = Membership.objects.filter(
            organization_id=token.organization_id, user_id=token.created_by_id
        ).first()
        if membership is None:
            continue
        if membership.all_projects:
            ApiToken.objects.filter(pk=token.pk).update(all_projects=True)
            continue
        granted = Grant.objects.filter(
            user_id=token.created_by_id,
            permission__codename="view_project",
            content_object__organization_id=token.organization_id,
        ).values_list("content_object_id", flat=True)
        token.projects.set(list(granted))


class Migration(migrations.Migration):
    dependencies = [
        ("accounts", "0003_split_org_admin_scope"),
        ("tenancy", "0004_membership_auditor_role"),
    ]

    operations = [
        migrations.AddField(
            model_name="apitoken",
            name="parent",
            field=models.ForeignKey(
                blank=True,
                null=True,
                on_delete=django.db.models.deletion.SET_NULL,
                related_name="children",
                to="accounts.apitoken",
            ),
        ),
        migrations.AddField(
            model_name="apitoken",
            name="lineage",
            field=models.CharField(db_index=True, default="", editable=False, max_length=40),
            preserve_default=False,
        ),
        migrations.AddField(
            model_name="apitoken",
            name="all_projects",
            field=models.BooleanField(default=False),
        ),
        migrations.AddField(
            model_name="apitoken",
            name="projects",
            field=models.ManyToManyField(blank=True, related_name="+", to="tenancy.project"),
        ),
        migrations.AddField(
            model_name="apitoken",
            name="checks",
            field=models.JSONField(default=list),
        ),
        migrations.RunPython(fill_lineage_and_projects, migrations.RunPython.noop),
    ]
