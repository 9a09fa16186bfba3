"""``org:admin`` was split into one scope per power: tokens that held it hold all of those."""

from django.db import migrations

FORMER_ORG_ADMIN = [
    "environments:write",
    "members:write",
    "policies:write",
    "projects:manage",
    "retention:write",
    "runners:write",
    "tokens:admin",
    "webhooks:write",
]


def split_org_admin(apps, schema_editor):
    ApiToken = apps.get_model("accounts", "ApiToken")
    for token in ApiToken.objects.all().only("pk", "scopes").iterator():
        if "org:admin" in token.scopes:
            scopes = {*token.scopes, *FORMER_ORG_ADMIN, "tokens:write"} - {"org:admin"}
            ApiToken.objects.filter(pk=token.pk).update(scopes=sorted(scopes))


class Migration(migrations.Migration):
    dependencies = [("accounts", "0002_initial")]

    operations = [migrations.RunPython(split_org_admin, migrations.RunPython.noop)]
