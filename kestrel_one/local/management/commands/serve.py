"""``python manage.py serve``: what ``make run`` runs."""

from __future__ import annotations

import logging
import os
import signal

from django.conf import settings
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError
from django.db import transaction

from kestrel_one.api.authentication import is_loopback
from kestrel_one.common.broker import broker_status
from kestrel_one.local.broker import BrokerNotStarted, EmbeddedBroker
from kestrel_one.local.runtime import (
    DataFolderInUse,
    RuntimeDirectoryError,
    RuntimePaths,
    ServeLock,
    data_folder_make_private,
    ensure_private_directory,
    runtime_paths,
)
from kestrel_one.local.workers import start_local_workers, stop_local_workers
from kestrel_one.tenancy.bootstrap import agent_token_create, bootstrap
from kestrel_one.tenancy.models import Organization

LOCAL_ORG = "local"
LOCAL_OWNER = "owner@localhost"


def binds_loopback_only(host: str) -> bool:
    return host == "localhost" or is_loopback(host.strip("[]"))


class Command(BaseCommand):
    help = (
        "Run Kestrel One: the web service (gunicorn) on 127.0.0.1:8000 by default. In "
        "single-host mode it applies migrations first, on an empty database creates a local "
        "owner and prints once how to sign in and a token, starts its own broker (a "
        "redis-server on a Unix socket in the data folder) unless REDIS_URL names one, and runs "
        "the control worker with its scheduler and a runner, which execute calls through the "
        "same signed path as hosted runners. It refuses to listen on a non-loopback address "
        "in single-host mode unless KESTREL_SERVER_TOKEN is set. In hosted mode it refuses to "
        "start when nobody answers at REDIS_URL."
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
        if settings.SINGLE_HOST:
            # The data folder holds the database, keys and workspaces: whatever serve and its
            # workers create in it is this user's alone (kestrel_one/local/runtime.py).
            os.umask(0o077)
        paths = runtime_paths(settings.KESTREL_DATA_DIR)
        if settings.HOSTED and not broker_status(fresh=True).reachable:
            raise CommandError(
                f"Refusing to start: nobody answers at REDIS_URL ({broker_status().label}). "
                "Calls could not be dispatched and would wait for nothing; start Redis or fix "
                "REDIS_URL, then start again."
            )
        # Until gunicorn installs its own handlers: SIGTERM unwinds through the finally below,
        # so what was started is stopped.
        signal.signal(signal.SIGTERM, _exit_on_signal)
        lock = ServeLock(paths) if settings.SINGLE_HOST else None
        broker: EmbeddedBroker | None = None
        children = []
        try:
            try:
                if lock is not None:
                    lock.acquire()
                    for change in data_folder_make_private(paths.data_dir):
                        self.stdout.write(f"Data:    permissions corrected: {change}")
                ensure_private_directory(paths.run_dir)
                ensure_private_directory(paths.web_worker_tmp_dir)
            except (DataFolderInUse, RuntimeDirectoryError) as error:
                raise CommandError(str(error)) from None
            except OSError as error:
                if settings.SINGLE_HOST:
                    raise CommandError(
                        f"Cannot use the data folder {paths.data_dir}: {error}. Set "
                        "KESTREL_DATA_DIR to a folder this user can write."
                    ) from None
                # A hosted web host may have no writable data folder; gunicorn then runs
                # without its control socket.
                paths = None
            if settings.SINGLE_HOST:
                call_command("migrate", interactive=False, verbosity=0)
                self._first_run_owner(host, port)
                if web_only:
                    self.stdout.write(
                        "Broker:  not started (--web-only): calls that would execute are "
                        "refused (503)."
                    )
                else:
                    broker, broker_up = self._start_broker(paths)
                    self._report_sandbox()
                    if broker_up or not settings.KESTREL_EMBEDDED_BROKER:
                        children = start_local_workers(self.stdout)
            self._run_web(host, port, workers, threads, paths)
        finally:
            stop_local_workers(children)
            if broker is not None:
                broker.stop()
            if lock is not None:
                lock.release()

    def _start_broker(self, paths: RuntimePaths) -> tuple[EmbeddedBroker | None, bool]:
        """Start the embedded broker, or check the one REDIS_URL names; print one line."""
        if not settings.KESTREL_EMBEDDED_BROKER:
            status = broker_status(fresh=True)
            if status.reachable:
                self.stdout.write(f"Broker:  {status.label} (REDIS_URL)")
            else:
                self.stdout.write(
                    f"Broker:  {status.label} (REDIS_URL) does not answer: calls that would "
                    "execute are refused (503) until it does."
                )
            return None, status.reachable
        broker = EmbeddedBroker(paths)
        try:
            broker.start()
        except BrokerNotStarted as error:
            self.stdout.write(
                f"Broker:  none, {error}. Calls that would execute are refused (503)."
            )
            return None, False
        self.stdout.write(f"Broker:  {broker.label} (no TCP port)")
        return broker, True

    def _report_sandbox(self) -> None:
        """Say which sandbox the local runner will have; it probes again for itself."""
        # Here only: the sandbox backends load the Docker SDK, which the web process never
        # imports (tests/runners/test_web_imports.py).
        from runners.heartbeat import SandboxWatch
        from runners.sandbox import DockerBackend
        from runners.sandbox.docker import DEFAULT_TOOL_IMAGE

        workspaces = settings.KESTREL_DATA_DIR / "workspaces"
        workspaces.mkdir(parents=True, exist_ok=True)
        watch = SandboxWatch(os.environ.get("KESTREL_SANDBOX", "auto"), workspaces)
        # The line below says it; the watch's own log lines are for a runner's log.
        runner_log = logging.getLogger("kestrel.runner")
        level = runner_log.level
        runner_log.setLevel(logging.CRITICAL)
        try:
            name = watch.current()
        finally:
            runner_log.setLevel(level)
        if isinstance(watch.backend, DockerBackend):
            watch.backend.client.close()
            self.stdout.write(f"Sandbox: docker ({DEFAULT_TOOL_IMAGE})")
        elif name != "none":
            self.stdout.write(f"Sandbox: {name}")
        else:
            self.stdout.write(
                f"Sandbox: none, {watch.detail}. shell.exec and code.python calls fail closed "
                "(nothing ever runs unsandboxed); file tools still work."
            )

    def _first_run_owner(self, host: str, port: int) -> None:
        if Organization.objects.exists():
            return
        with transaction.atomic():
            created = bootstrap(org_slug=LOCAL_ORG, email=LOCAL_OWNER, owner_token=False)
            agent_token = agent_token_create(org_slug=LOCAL_ORG)
        address = f"http://{'127.0.0.1' if host in {'0.0.0.0', '::'} else host}:{port}"  # noqa: S104
        # Printed once, to the operator's terminal only; nothing stores the plaintext. The
        # person signs in with the password; agents get the agent token, which can never
        # approve, accept a plan, publish a policy or make tokens.
        self.stdout.write(
            "\nKestrel One is set up for the first time. Keep these; they are not shown again.\n"
            f"  Sign in:     {address}/login  as {created['user']}  "
            f"password {created.get('password', '(unchanged)')}\n"
            f"  Agent token: {agent_token}  (reads and requests actions; never approves)\n"
            f"  Try:         curl -H 'Authorization: Bearer {agent_token}' {address}/api/v1/orgs\n"
        )

    def _run_web(
        self, host: str, port: int, workers: int, threads: int, paths: RuntimePaths | None
    ) -> None:
        # Only when serving: gunicorn, and the WSGI application with every route and view.
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
                # Its control socket and its workers' heartbeat files go under the data
                # folder, so two services with different folders never take each other's.
                if paths is None:
                    self.cfg.set("control_socket_disable", True)
                else:
                    self.cfg.set("control_socket", str(paths.web_control_socket))
                    self.cfg.set("control_socket_mode", 0o600)
                    self.cfg.set("worker_tmp_dir", str(paths.web_worker_tmp_dir))
                # Never trust X-Forwarded-For for the source address: loopback rules use
                # the socket's peer only.
                self.cfg.set("forwarded_allow_ips", "")

            def load(self):
                return application

        self.stdout.write(f"Kestrel One listening on {host}:{port} ({settings.KESTREL_MODE})")
        self.stdout.flush()
        WebServer().run()


def _exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)
