import json

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.core.validators import validate_email

from kestrel_one.common.errors import KestrelError
from kestrel_one.tenancy.bootstrap import bootstrap


class Command(BaseCommand):
    help = (
        "Create (or reuse) an organization and its owner, and print a new owner API token as "
        'one line of JSON: {"org": SLUG, "user": EMAIL, "token": TOKEN}, plus "password" when '
        "it created the user, so that person can sign in to the console. Both are shown once."
    )

    def add_arguments(self, parser):
        parser.add_argument("--org", required=True, help="the organization's slug")
        parser.add_argument("--email", required=True, help="the owner's email address")

    def handle(self, *args, org, email, **options):
        try:
            validate_email(email)
        except ValidationError as exc:
            raise CommandError(f"--email: {email!r} is not an email address") from exc
        try:
            result = bootstrap(org_slug=org, email=email)
        except ValidationError as exc:
            raise CommandError(f"--org: {'; '.join(exc.messages)}") from exc
        except KestrelError as exc:
            raise CommandError(exc.message) from exc
        self.stdout.write(json.dumps(result))
