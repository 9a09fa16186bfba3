"""The control plane's Celery app (the runner has its own in ``runners.worker``)."""

import logging.config
import os

from celery import Celery, signals
from django.conf import settings
from django.db import close_old_connections

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kestrel_one.settings")

app = Celery("kestrel_one")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


@signals.setup_logging.connect
def _log_as_the_web_process(**_) -> None:
    """A worker logs through ``settings.LOGGING`` as the web process does: JSON, with every
    line redacted (``redact_log_event``) and at ``KESTREL_LOG_LEVEL``.

    Without a receiver of this signal Celery replaces the root logger's handlers with its
    own plain formatter, which skips the redaction, in the only processes that decrypt
    credentials (adapters, the model gateway, webhook deliveries). With one, Celery leaves
    logging to it.
    """
    logging.config.dictConfig(settings.LOGGING)


@signals.worker_init.connect
def _keep_database_connections(**_) -> None:
    """Keep a worker's database connections across tasks, as a web worker keeps them across
    requests (``CONN_MAX_AGE``, health checks).

    Celery's Django fixup closes every connection after every task unless
    ``CELERY_DB_REUSE_MAX`` is set, and then never checks them; a new connection per task
    cost PostgreSQL a backend start for every runner report. So settings.py sets it, and
    around each task Django's own rule applies instead: a connection that is broken, or
    older than ``CONN_MAX_AGE``, is closed. Connected when a worker starts, so tasks run
    eagerly in tests are left alone.
    """
    signals.task_prerun.connect(_close_old_connections, weak=False)
    signals.task_postrun.connect(_close_old_connections, weak=False)


def _close_old_connections(**_) -> None:
    close_old_connections()
