from django.core.management.base import BaseCommand, CommandError

from kestrel_one.accounts.principal import system_principal
from kestrel_one.common.errors import KestrelError
from kestrel_one.execution.broker_users import runner_broker_user_remove
from kestrel_one.execution.enrollment import runner_revoke
from kestrel_one.execution.models import Runner


class Command(BaseCommand):
    help = (
        "Revoke a runner (platform or organization-dedicated): from then on the control plane "
        "refuses every report it signs, and its broker user is gone (its connections ended), "
        "so it can take no further command."
    )

    def add_arguments(self, parser):
        parser.add_argument("runner", help="the runner's id (run_...)")

    def handle(self, *args, runner, **options):
        found = Runner.objects.filter(public_id=runner).first()
        if found is None:
            raise CommandError(f"no runner {runner!r}")
        revoked = runner_revoke(actor=system_principal("runner_revoke"), runner=found)
        self.stdout.write(f"{revoked.public_id} revoked at {revoked.revoked_at.isoformat()}")
        try:
            runner_broker_user_remove(runner_id=revoked.public_id)
        except KestrelError as exc:
            raise CommandError(
                f"{revoked.public_id} is revoked, but its broker user is not removed yet: "
                f"{exc.message} (the sweep removes it once the broker answers)"
            ) from exc
