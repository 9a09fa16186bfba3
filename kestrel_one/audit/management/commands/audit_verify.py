"""``python manage.py audit_verify --org SLUG``: check one organization's audit chain."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from kestrel_one.audit.models import organization_model
from kestrel_one.audit.selectors import audit_chain_verify
from kestrel_one.audit.services import audit_chain_settle

EXIT_BROKEN = 1


class Command(BaseCommand):
    help = (
        "Chain any records still pending, then walk an organization's audit chain in "
        "sequence order, recompute every record's hash and check the links, the sequence "
        "numbers, the chain head and any retention anchor. Exits 0 and prints a summary "
        "when the chain is intact; exits 1 naming the first bad record (sequence, id and "
        "why) when it is not; exits 2 for an unknown organization."
    )

    def add_arguments(self, parser):
        parser.add_argument("--org", required=True, metavar="SLUG", help="organization slug")

    def handle(self, *args, org: str, **options):
        organization = organization_model().objects.filter(slug=org).first()
        if organization is None:
            raise CommandError(f"No organization with slug {org!r}.", returncode=2)
        audit_chain_settle(organization)
        result = audit_chain_verify(organization)
        if result.ok:
            self.stdout.write(result.summary())
            return
        self.stderr.write(result.summary())
        raise SystemExit(EXIT_BROKEN)
