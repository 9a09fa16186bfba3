"""The control plane's Celery app (the runner has its own in ``runners.worker``)."""

import logging.config
import os

import structlog
from celery import Celery, Task, bootsteps, signals
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import close_old_connections

from runners.contract.names import REPORT_QUEUE, RUNNER_SENT_TASKS

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kestrel_one.settings")

logger = structlog.get_logger(__name__)

# What a Celery message may ask to run after its own task (links, error links, the rest of
# a chain, a chord's body): the worker would send those with the control plane's own broker
# access, to any queue the message names.
_FOLLOW_UPS = ("callbacks", "errbacks", "chain", "chord")


class ControlTask(Task):
    """Every control-plane task. A runner-sent one (``RUNNER_SENT_TASKS``) whose message
    names tasks to run after it is refused unrun, and those tasks are never sent: a runner
    host writes that message, and the only thing it may ask of the control plane is that a
    signed token be verified. The control plane's own tasks keep Celery's behaviour."""

    def __call__(self, *args, **kwargs):
        if self.name in RUNNER_SENT_TASKS and _drop_follow_ups(self.request):
            logger.warning("runner message refused: it names tasks to run after it", task=self.name)
            return None
        return super().__call__(*args, **kwargs)


def _drop_follow_ups(request) -> bool:
    """Clear ``request``'s follow-up tasks (Celery's tracer reads them from this same request
    after the task, and on failure); whether it had any."""
    carried = False
    for field in _FOLLOW_UPS:
        if getattr(request, field, None):
            carried = True
            setattr(request, field, None)
    return carried


app = Celery("kestrel_one", task_cls=ControlTask)
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()


def _serves_reports(worker) -> bool:
    return REPORT_QUEUE in worker.app.amqp.queues.consume_from


class ReportsServedAlone(bootsteps.Step):
    """A worker that consumes the reports queue consumes no other queue.

    Runner hosts may append to that queue, and a message names its own task: the worker
    that takes it must be one that runs nothing but the runners' signed tasks
    (``RunnerTasksOnly``), so it cannot also be the worker of the control plane's own tasks.
    """

    name = "kestrel.reports-served-alone"

    def __init__(self, worker, **kwargs):
        consumed = set(worker.app.amqp.queues.consume_from)
        if REPORT_QUEUE in consumed and consumed != {REPORT_QUEUE}:
            raise ImproperlyConfigured(
                f"queue {REPORT_QUEUE!r} is served by a worker of its own (-Q {REPORT_QUEUE}); "
                f"this one was also given {', '.join(sorted(consumed - {REPORT_QUEUE}))}"
            )
        super().__init__(worker, **kwargs)


class RunnerTasksOnly(bootsteps.StartStopStep):
    """On the reports queue's worker, every task but the ones runners send is unknown.

    Each of those verifies a token signed with an enrolled runner's key before it does
    anything. Any other task a message there names (a sweep, a webhook delivery, an adapter
    call) is refused unrun, as Celery refuses an unregistered task: logged and dropped. Run
    after the consumer's task table is (re)built, each time the consumer starts.
    """

    name = "kestrel.runner-tasks-only"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def start(self, c):
        if not _serves_reports(c):
            return
        for name in [name for name in c.strategies if name not in RUNNER_SENT_TASKS]:
            del c.strategies[name]


app.steps["worker"].add(ReportsServedAlone)
app.steps["consumer"].add(RunnerTasksOnly)


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
