"""Test settings: the real services (PostgreSQL, Redis) at 127.0.0.1 unless told otherwise."""

import os
import tempfile

os.environ.setdefault("KESTREL_DATA_DIR", os.path.join(tempfile.gettempdir(), "kestrel-test-data"))

from kestrel_one.settings import *  # noqa: F403
from kestrel_one.settings import env_str

DATABASES = {
    "default": dj_database_url.parse(  # noqa: F405
        env_str("TEST_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
    )
}
# Separate names let two suites run on one server at once (TEST_DATABASE_NAME=...).
DATABASES["default"]["TEST"] = {"NAME": env_str("TEST_DATABASE_NAME", "test_kestrel")}
REDIS_URL = env_str("TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
CELERY_BROKER_URL = REDIS_URL
CACHES[KESTREL_RATE_CACHE]["LOCATION"] = REDIS_URL  # noqa: F405
KESTREL_EMBEDDED_BROKER = False
# Every live-server test's client comes from 127.0.0.1, and the count lives in Redis across
# tests: the test of the bound sets its own.
KESTREL_OAUTH_TOKEN_RATE = "100000/min"  # noqa: S105 - a rate, not a secret
# Argon2 is deliberately slow; tests create many users.
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
# Requests from Django's test client come from 127.0.0.1; tests default to the hosted rule
# (nothing anonymous) and opt into single-host behaviour explicitly.
SINGLE_HOST = False
HOSTED = True
KESTREL_SERVER_TOKEN = None
KESTREL_SIGNING_KEY_FILE = KESTREL_DATA_DIR / "control_signing_key.pem"  # noqa: F405
KESTREL_CREDENTIALS_KEY_FILE = KESTREL_DATA_DIR / "credentials_key"  # noqa: F405
# Tests read the overview's chart as it is now (test_dashboard.py tests the cache itself).
KESTREL_CONSOLE_CHART_SECONDS = 0
