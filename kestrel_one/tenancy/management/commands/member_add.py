"""``python manage.py member_add``: add a person to an organization and give them a way in."""

from __future__ import annotations

import json

from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError
from django.core.validators import validate_email

from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.scopes import Role
from kestrel_one.accounts.sign_in_links import public_base_url
from kestrel_one.common.errors import KestrelError
from kestrel_one.tenancy.models import Organization
from kestrel_one.tenancy.services import member_add


class Command(BaseCommand):
    help = (
        "Add a person to an organization with a role, as POST /api/v1/orgs/{org}/members does, "
        'and print one line of JSON: {"org", "user", "role", "membership"}, plus '
        '"sign_in_link" and "sign_in_link_expires_at" when the person has no password yet: a '
        "one-time link (shown once) where they choose one and are signed in. The link starts "
        "with KESTREL_PUBLIC_URL (single-host default http://127.0.0.1:$PORT)."
    )

    def add_arguments(self, parser):
        parser.add_argument("--org", required=True, help="the organization's slug")
        parser.add_argument("--email", required=True, help="the person's email address")
        parser.add_argument(
            "--role", required=True, choices=[r.value for r in Role], help="their role"
        )
        parser.add_argument("--name", default="", help="their name (optional)")

    def handle(self, *args, org, email, role, name, **options):
        try:
            validate_email(email)
        except ValidationError as exc:
            raise CommandError(f"--email: {email!r} is not an email address") from exc
        organization = Organization.objects.filter(slug=org).first()
        if organization is None:
            raise CommandError(f"--org: no organization with the slug {org!r}")
        try:
            # Resolved first: a link that could not say where to go is refused before any change.
            base_url = public_base_url()
            added = member_add(
                actor=system_principal("member_add"),
                organization=organization,
                email=email,
                name=name,
                role=Role(role),
                base_url=base_url,
            )
        except KestrelError as exc:
            raise CommandError(exc.message) from None
        membership = added.membership
        result = {
            "org": organization.slug,
            "user": membership.user.email,
            "role": membership.role,
            "membership": membership.public_id,
        }
        if added.sign_in_link:
            result["sign_in_link"] = added.sign_in_link
            result["sign_in_link_expires_at"] = added.sign_in_link_expires_at.isoformat()
        self.stdout.write(json.dumps(result))
