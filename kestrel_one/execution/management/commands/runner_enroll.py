import json
import sys
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from kestrel_one.accounts.principal import system_principal
from kestrel_one.common.errors import KestrelError
from kestrel_one.execution.broker_users import runner_broker_url
from kestrel_one.execution.enrollment import runner_enroll, runner_pool_route
from kestrel_one.execution.keys import control_public_key_pem
from kestrel_one.tenancy.models import Organization


class Command(BaseCommand):
    help = (
        "Register a runner identity for a pool and print, as one line of JSON, what the runner "
        "process needs: its id, its pool, the control plane's public key, the broker's address "
        "and the runner's own broker password (shown this once). Give the runner's public key "
        "(from `python -m runners keygen` on the runner host); the private key never leaves "
        "that host."
    )

    def add_arguments(self, parser):
        parser.add_argument("--pool", required=True, help="the runner pool (queue runner.<pool>)")
        parser.add_argument(
            "--public-key",
            required=True,
            type=Path,
            help="path to the runner's Ed25519 public key (PEM), or - for standard input",
        )
        parser.add_argument("--org", help="dedicate the runner (and its pool) to this organization")
        parser.add_argument(
            "--route-calls",
            action="store_true",
            help="with --org: send the organization's calls to this pool from now on",
        )
        parser.add_argument("--name", default="", help="a label for operators")

    def handle(self, *args, pool, public_key, org, route_calls, name, **options):
        pem = sys.stdin.read() if str(public_key) == "-" else self._read(public_key)
        organization = None
        if org:
            organization = Organization.objects.filter(slug=org).first()
            if organization is None:
                raise CommandError(f"--org: no organization with slug {org!r}")
        if route_calls and organization is None:
            raise CommandError("--route-calls needs --org: only a dedicated pool is routed to")
        actor = system_principal("runner_enroll")
        try:
            runner = runner_enroll(
                actor=actor, pool=pool, public_key_pem=pem, organization=organization, name=name
            )
            if route_calls:
                runner_pool_route(actor=actor, organization=organization, pool=pool)
        except KestrelError as exc:
            raise CommandError(exc.message) from exc
        # The control plane's own broker credentials are never printed; the runner's
        # password is, this once, for its KESTREL_BROKER_PASSWORD_FILE.
        environment = {
            "KESTREL_RUNNER_ID": runner.public_id,
            "KESTREL_RUNNER_POOL": runner.pool,
            "KESTREL_BROKER_URL": runner_broker_url(),
        }
        if organization is not None:
            environment["KESTREL_RUNNER_ORGANIZATION"] = organization.public_id
        if runner.broker_password:
            environment["KESTREL_BROKER_PASSWORD_FILE"] = "a 0600 file holding broker_password"  # noqa: S105
        self.stdout.write(
            json.dumps(
                {
                    "runner": runner.public_id,
                    "pool": runner.pool,
                    "organization": org,
                    "control_public_key": control_public_key_pem(),
                    "broker_password": runner.broker_password,
                    "environment": environment,
                }
            )
        )

    def _read(self, path: Path) -> str:
        try:
            return path.read_text()
        except OSError as exc:
            raise CommandError(f"--public-key: cannot read {path}: {exc.strerror}") from exc
