"""``python manage.py set_password EMAIL``: a person's console password, from standard input."""

from __future__ import annotations

import sys

from django.core.management.base import BaseCommand, CommandError

from kestrel_one.accounts.models import User
from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.services import user_password_set
from kestrel_one.common.errors import ValidationFailed


class Command(BaseCommand):
    help = (
        "Set a person's console password. The password is the first line of standard input "
        "(never an argument, so it stays out of the process list and shell history) and is "
        "never printed. Django's password validators apply. Example: "
        "printf '%s\\n' \"$PASSWORD\" | python manage.py set_password ada@example.com"
    )
    # call_command(..., stdin=stream) in tests, as Django's createsuperuser does.
    stealth_options = ("stdin",)

    def add_arguments(self, parser):
        parser.add_argument("email", help="the person's email address")

    def handle(self, *args, email, **options):
        stdin = options.get("stdin") or sys.stdin
        if stdin.isatty():
            raise CommandError(
                "set_password reads the password from standard input and never prompts; "
                "pipe it in: printf '%s\\n' \"$PASSWORD\" | python manage.py set_password EMAIL"
            )
        password = stdin.readline().removesuffix("\n").removesuffix("\r")
        if not password:
            raise CommandError("No password: the first line of standard input is empty.")
        user = User.objects.filter(email=User.objects.normalize_email(email).lower()).first()
        if user is None:
            raise CommandError(
                f"Nobody has the email {email!r}. Add them first: python manage.py member_add "
                "--org SLUG --email EMAIL --role ROLE"
            )
        try:
            user_password_set(
                actor=system_principal("set_password"),
                user=user,
                password=password,
                via="set_password command",
            )
        except ValidationFailed as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(f"Password set for {user.email}; they can sign in at /login.")
