"""Actions and plans keep the lineage of the token that requested them (accounts 0004), so
no token of that lineage approves them even after the requesting token is gone."""

from django.db import migrations, models
from django.db.models import OuterRef, Subquery


def fill_lineage(apps, schema_editor):
    ApiToken = apps.get_model("accounts", "ApiToken")
    Action = apps.get_model("execution", "Action")
    Plan = apps.get_model("execution", "Plan")
    Action.objects.filter(requested_by_token__isnull=False).update(
        requested_by_lineage=Subquery(
            ApiToken.objects.filter(pk=OuterRef("requested_by_token_id")).values("lineage")[:1]
        )
    )
    Plan.objects.filter(proposed_by_token__isnull=False).update(
        proposed_by_lineage=Subquery(
            ApiToken.objects.filter(pk=OuterRef("proposed_by_token_id")).values("lineage")[:1]
        )
    )


class Migration(migrations.Migration):
    dependencies = [
        ("execution", "0005_runner_pools_and_broker_users"),
        ("accounts", "0004_token_lineage_projects_checks"),
    ]

    operations = [
        migrations.AddField(
            model_name="action",
            name="requested_by_lineage",
            field=models.CharField(blank=True, default="", max_length=40),
        ),
        migrations.AddField(
            model_name="plan",
            name="proposed_by_lineage",
            field=models.CharField(blank=True, default="", max_length=40),
        ),
        migrations.RunPython(fill_lineage, migrations.RunPython.noop),
    ]
