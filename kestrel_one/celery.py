"""The control plane's Celery app (the runner has its own in ``runners.worker``)."""

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kestrel_one.settings")

app = Celery("kestrel_one")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
