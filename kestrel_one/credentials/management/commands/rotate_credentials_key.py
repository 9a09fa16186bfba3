"""Re-wrap every credential's data key under a new key-encryption key (docs/credentials.md).

The secrets' own ciphertexts do not change; only each record's wrapped data key and key id.
One transaction: either every record is under the new key or none is. Afterwards point
KESTREL_CREDENTIALS_KEY_FILE at the new file and restart; the old key is then no longer needed.
"""

from __future__ import annotations

from pathlib import Path

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from kestrel_one.accounts.principal import system_principal
from kestrel_one.audit.services import audit_record
from kestrel_one.credentials import crypto
from kestrel_one.credentials.models import Connection, Credential


class Command(BaseCommand):
    help = "Re-wrap every credential under the key in --new-key-file (created with --generate)."

    def add_arguments(self, parser):
        parser.add_argument("--new-key-file", required=True, type=Path)
        parser.add_argument(
            "--generate",
            action="store_true",
            help="Write a new random key to --new-key-file first (it must not exist).",
        )

    def handle(self, *args, new_key_file: Path, generate: bool, **options):
        try:
            if generate:
                new = crypto.key_generate(new_key_file)
            else:
                new = crypto.key_load(new_key_file)
            old = crypto.known_keys()
        except FileExistsError:
            raise CommandError(
                f"{new_key_file} exists; --generate writes a new file only"
            ) from None
        except ImproperlyConfigured as error:
            raise CommandError(str(error)) from None
        try:
            counts = rotate(old=old, new=new)
        except crypto.SealBroken as error:
            raise CommandError(f"nothing was changed: {error}") from None
        self.stdout.write(
            f"Re-wrapped {counts['rewrapped']} credentials and connections under key "
            f"{new.key_id} ({counts['unchanged']} were already under it). Now set "
            f"KESTREL_CREDENTIALS_KEY_FILE={new_key_file} and restart every process; then the "
            "old key file is no longer needed."
        )


@transaction.atomic
def rotate(*, old: dict[str, crypto.KeyEncryptionKey], new: crypto.KeyEncryptionKey) -> dict:
    keys = {**old, new.key_id: new}
    counts = {"rewrapped": 0, "unchanged": 0}
    touched: dict[int, list[str]] = {}
    for model in (Credential, Connection):
        records = (
            model.objects.select_for_update()
            .filter(revoked_at__isnull=True)
            .select_related("organization")
            .order_by("pk")
        )
        for record in records:
            if record.key_id == new.key_id:
                counts["unchanged"] += 1
                continue
            aad = crypto.associated_data(
                organization_id=record.organization.public_id,
                record_id=record.public_id,
                adapter=record.adapter,
            )
            record.data_key_wrapped = crypto.rewrap(
                data_key_wrapped=record.data_key_wrapped,
                key_id=record.key_id,
                aad=aad,
                old=keys,
                new=new,
            )
            record.key_id = new.key_id
            record.save(update_fields=["data_key_wrapped", "key_id"])
            counts["rewrapped"] += 1
            touched.setdefault(record.organization_id, [record.organization, 0])
            touched[record.organization_id][1] += 1
    for organization, count in touched.values():
        audit_record(
            organization=organization,
            actor=system_principal("rotate_credentials_key"),
            action="credentials.key_rotate",
            data={"key_id": new.key_id, "records": count},
        )
    return counts
