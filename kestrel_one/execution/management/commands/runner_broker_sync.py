import json

from django.core.management.base import BaseCommand, CommandError

from kestrel_one.common.errors import KestrelError
from kestrel_one.execution.broker_users import runner_broker_users_reconcile


class Command(BaseCommand):
    help = (
        "Make the broker's runner users match the enrolled runners: recreate the users of "
        "active runners (after a broker restart without an ACL file) and delete those of "
        "revoked ones. The sweep does the same every 15 s; prints the counts as JSON."
    )

    def handle(self, *args, **options):
        try:
            counts = runner_broker_users_reconcile()
        except KestrelError as exc:
            raise CommandError(exc.message) from exc
        self.stdout.write(json.dumps(counts))
