"""``python manage.py serve``: what ``make run`` runs."""

from __future__ import annotations

import os

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from kestrel_one.api.authentication import is_loopback
from kestrel_one.execution.local import start_local_workers, stop_local_workers
from kestrel_one.tenancy.models import Organization

LOCAL_ORG = "local"
LOCAL_OWNER = "owner@localhost"


def binds_loopback_only(host: str) -> bool:
    return host == "localhost" or is_loopback(host.strip("[]"))


class Command(BaseCommand):
    help = (
        "Run Kestrel One: the web service (gunicorn) on 127.0.0.1:8000 by default. In "
        "single-host mode it applies migrations first, on an empty database creates a local "
        "owner and prints once how to sign in and a token, and (when REDIS_URL names a broker) "
        "also runs the control worker with its scheduler and a runner, which execute calls "
        "through the same signed path as hosted runners. It refuses to listen on a "
        "non-loopback address in single-host mode unless KESTREL_SERVER_TOKEN is set."
    )

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
        parser.add_argument(
            "--port",
            type=int,
            default=int(os.environ.get("PORT", "8000")),
            help="port to listen on (default: $PORT or 8000)",
        )
        parser.add_argument("--workers", type=int, default=2, help="web worker processes")
        parser.add_argument("--threads", type=int, default=8, help="threads per web worker")
        parser.add_argument(
            "--web-only",
            action="store_true",
            help="single-host: do not start the control worker and runner",
        )

    def handle(self, *args, host, port, workers, threads, web_only, **options):
        if (
            settings.SINGLE_HOST
            and not binds_loopback_only(host)
            and not settings.KESTREL_SERVER_TOKEN
        ):
            raise CommandError(
                f"Refusing to listen on {host}: in single-host mode a non-loopback address needs "
                "KESTREL_SERVER_TOKEN, so that callers from other machines must present it."
            )
        children = []
        if settings.SINGLE_HOST:
            call_command("migrate", interactive=False, verbosity=0)
            self._first_run_owner(host, port)
            if web_only:
                pass
            elif settings.CELERY_BROKER_URL:
                children = start_local_workers(self.stdout)
            else:
                self.stdout.write(
                    "Execution is off: set REDIS_URL (for example redis://127.0.0.1:6379/0) to "
                    "run the control worker and a runner with the web service."
                )
        try:
            self._run_web(host, port, workers, threads)
        finally:
            stop_local_workers(children)

    def _first_run_owner(self, host: str, port: int) -> None:
        if Organization.objects.exists():
            return
        from kestrel_one.accounts.bootstrap import bootstrap

        created = bootstrap(org_slug=LOCAL_ORG, email=LOCAL_OWNER, set_password=True)
        address = f"http://{'127.0.0.1' if host in {'0.0.0.0', '::'} else host}:{port}"  # noqa: S104
        # Printed once, to the operator's terminal only; nothing stores the plaintext.
        self.stdout.write(
            "\nKestrel One is set up for the first time. Keep these; they are not shown again.\n"
            f"  Sign in:   {address}/login  as {created['user']}  password {created['password']}\n"
            f"  API token: {created['token']}\n"
            f"  Try:       curl -H 'Authorization: Bearer <token>' {address}/api/v1/orgs\n"
        )

    def _run_web(self, host: str, port: int, workers: int, threads: int) -> None:
        from gunicorn.app.base import BaseApplication

        from kestrel_one.wsgi import application

        class WebServer(BaseApplication):
            def load_config(self):
                self.cfg.set("bind", f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
                self.cfg.set("workers", workers)
                self.cfg.set("threads", threads)
                self.cfg.set("worker_class", "gthread")
                self.cfg.set("accesslog", "-")
                # Share links carry their token in the path: the access log is redacted.
                self.cfg.set(
                    "logger_class", "kestrel_one.common.gunicorn_logging.RedactingAccessLogger"
                )
                self.cfg.set("timeout", 120)
                # Never trust X-Forwarded-For for the source address: loopback rules use
                # the socket's peer only.
                self.cfg.set("forwarded_allow_ips", "")

            def load(self):
                return application

        self.stdout.write(f"Kestrel One listening on {host}:{port} ({settings.KESTREL_MODE})")
        self.stdout.flush()
        WebServer().run()
