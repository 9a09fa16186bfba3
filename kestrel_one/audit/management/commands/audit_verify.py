"""``python manage.py audit_verify --org SLUG [--head FILE [--keys FILE]]``: check one
organization's audit chain, and optionally that it still holds a signed head kept earlier."""

from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from kestrel_one.audit.heads import HEAD_MAX_BYTES, audit_head_check
from kestrel_one.audit.models import organization_model
from kestrel_one.audit.selectors import audit_chain_verify
from kestrel_one.audit.services import audit_chain_settle

EXIT_BROKEN = 1


class Command(BaseCommand):
    help = (
        "Chain any records still pending, then walk an organization's audit chain in "
        "sequence order, recompute every record's hash and check the links, the sequence "
        "numbers, the chain head and any retention anchor. With --head FILE (a head from "
        "GET /api/v1/orgs/{org}/audit/head), also check the head's signature against the "
        "control plane's keys (or a JWKS from GET /api/v1/keys given with --keys FILE) and "
        "that the record at its seq still has its hash: a rewritten tail fails even when "
        "every hash after it was recomputed. Exits 0 and prints a summary when the chain is "
        "intact; exits 1 naming the first bad record (sequence, id and why) when it is not; "
        "exits 2 for an unknown organization or an unreadable file."
    )

    def add_arguments(self, parser):
        parser.add_argument("--org", required=True, metavar="SLUG", help="organization slug")
        parser.add_argument(
            "--head", metavar="FILE", type=Path, help="a signed audit head kept earlier (JSON)"
        )
        parser.add_argument(
            "--keys",
            metavar="FILE",
            type=Path,
            help="the JWKS to check the head's signature with (default: this control plane's)",
        )

    def handle(self, *args, org: str, head: Path | None, keys: Path | None, **options):
        organization = organization_model().objects.filter(slug=org).first()
        if organization is None:
            raise CommandError(f"No organization with slug {org!r}.", returncode=2)
        if keys is not None and head is None:
            raise CommandError("--keys checks a --head; give both.", returncode=2)
        kept = _read_json(head) if head is not None else None
        jwks = _read_json(keys) if keys is not None else None
        audit_chain_settle(organization)
        result = audit_chain_verify(organization)
        if not result.ok:
            self.stderr.write(result.summary())
            raise SystemExit(EXIT_BROKEN)
        if kept is not None:
            check = audit_head_check(organization, kept, jwks=jwks)
            if not check.ok:
                self.stderr.write(
                    f"audit chain of {organization.slug}: BROKEN against the kept head: "
                    f"{check.message}"
                )
                raise SystemExit(EXIT_BROKEN)
            self.stdout.write(f"{result.summary()}; {check.message}")
            return
        self.stdout.write(result.summary())


def _read_json(path: Path):
    try:
        with path.open("rb") as handle:
            raw = handle.read(HEAD_MAX_BYTES + 1)
    except OSError as error:
        raise CommandError(f"Cannot read {path}: {error.strerror}.", returncode=2) from None
    if len(raw) > HEAD_MAX_BYTES:
        raise CommandError(f"{path} is larger than {HEAD_MAX_BYTES} bytes.", returncode=2)
    try:
        return json.loads(raw)
    except ValueError as error:
        raise CommandError(f"{path} is not JSON: {error}.", returncode=2) from None
