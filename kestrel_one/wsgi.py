"""WSGI entry point for gunicorn (``python manage.py serve`` runs it)."""

import os

from django.core.wsgi import get_wsgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "kestrel_one.settings")
application = get_wsgi_application()
