"""Kestrel One settings: one module, driven by environment variables.

Two shapes share this file. ``KESTREL_MODE=single-host`` (the default) keeps everything under
``KESTREL_DATA_DIR`` with SQLite and listens on loopback. ``KESTREL_MODE=hosted`` requires its
external services to be named explicitly and refuses to start otherwise.
"""

from __future__ import annotations

import json
import os
import secrets
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit

import dj_database_url
import structlog
from django.core.exceptions import ImproperlyConfigured

from kestrel_one.common.egress import host_overrides_parse
from kestrel_one.common.redaction import redact_log_event
from kestrel_one.local.runtime import runtime_paths
from runners.contract.broker import kombu_url
from runners.contract.names import REPORT_QUEUE, RUNNER_SENT_TASKS
from runners.contract.tokens import DEFAULT_MAX_REPORT_BYTES

BASE_DIR = Path(__file__).resolve().parent.parent


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name, "")
    return value if value != "" else default


def env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value == "":
        return default
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, got {value!r}")


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be an integer, got {value!r}") from exc


def env_required(*names: str) -> dict[str, str]:
    missing = [name for name in names if not os.environ.get(name)]
    if missing:
        raise ImproperlyConfigured(
            f"KESTREL_MODE=hosted requires {', '.join(missing)} to be set in the environment"
        )
    return {name: os.environ[name] for name in names}


KESTREL_MODE = env_str("KESTREL_MODE", "single-host")
if KESTREL_MODE not in {"single-host", "hosted"}:
    raise ImproperlyConfigured(
        f"KESTREL_MODE must be 'single-host' or 'hosted', got {KESTREL_MODE!r}"
    )
SINGLE_HOST = KESTREL_MODE == "single-host"
HOSTED = not SINGLE_HOST

KESTREL_DATA_DIR = Path(env_str("KESTREL_DATA_DIR", str(BASE_DIR / "var"))).resolve()
# The single-host shared secret: when set, every API caller must present it (or an API token),
# loopback included. Never logged, never shown.
KESTREL_SERVER_TOKEN = env_str("KESTREL_SERVER_TOKEN")


def _single_host_secret_key() -> str:
    """Keep one generated key per data folder so sessions survive a restart."""
    KESTREL_DATA_DIR.mkdir(parents=True, exist_ok=True)
    key_file = KESTREL_DATA_DIR / "secret_key"
    if not key_file.exists():
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_urlsafe(64))
    return key_file.read_text().strip()


if HOSTED:
    _hosted = env_required(
        "DATABASE_URL", "REDIS_URL", "DJANGO_SECRET_KEY", "KESTREL_ALLOWED_HOSTS"
    )
    SECRET_KEY = _hosted["DJANGO_SECRET_KEY"]
    DATABASES = {
        "default": dj_database_url.parse(
            _hosted["DATABASE_URL"], conn_max_age=60, conn_health_checks=True
        )
    }
    REDIS_URL = _hosted["REDIS_URL"]
    KESTREL_EMBEDDED_BROKER = False
    ALLOWED_HOSTS = [h.strip() for h in _hosted["KESTREL_ALLOWED_HOSTS"].split(",") if h.strip()]
else:
    SECRET_KEY = env_str("DJANGO_SECRET_KEY") or _single_host_secret_key()
    # Connections are kept (and checked before reuse) as in hosted mode: a new PostgreSQL
    # connection per request or task cost more CPU than the request itself (docs/performance.md).
    DATABASES = {
        "default": dj_database_url.parse(
            env_str("DATABASE_URL", f"sqlite:///{KESTREL_DATA_DIR / 'kestrel.sqlite3'}"),
            conn_max_age=60,
            conn_health_checks=True,
        )
    }
    # SQLite (the default): writers queue for the one write lock instead of failing at once
    # with "database is locked". WAL lets readers go on beside the writer; every transaction
    # begins IMMEDIATE, so it takes the write lock at its start and never fails upgrading a
    # read to a write under someone else's commit; a busy one waits up to the timeout.
    KESTREL_SQLITE_TIMEOUT_SECONDS = env_int("KESTREL_SQLITE_TIMEOUT_SECONDS", 30)
    if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
        DATABASES["default"]["OPTIONS"] = {
            "init_command": "PRAGMA journal_mode=WAL",
            "transaction_mode": "IMMEDIATE",
            "timeout": KESTREL_SQLITE_TIMEOUT_SECONDS,
        }
    REDIS_URL = env_str("REDIS_URL")
    # Without REDIS_URL the broker is embedded: a redis-server that `serve` runs on a Unix
    # socket in the data folder, and no TCP port (kestrel_one/local/broker.py).
    KESTREL_EMBEDDED_BROKER = REDIS_URL is None
    if KESTREL_EMBEDDED_BROKER:
        REDIS_URL = runtime_paths(KESTREL_DATA_DIR).broker_url
    ALLOWED_HOSTS = [
        "127.0.0.1",
        "localhost",
        "[::1]",
        *filter(None, (env_str("KESTREL_ALLOWED_HOSTS") or "").split(",")),
    ]

DEBUG = env_bool("DJANGO_DEBUG", False)

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_filters",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "guardian",
    "axes",
    "csp",
    "django_htmx",
    "oauth2_provider",
    "kestrel_one.accounts",
    "kestrel_one.tenancy",
    "kestrel_one.audit",
    "kestrel_one.governance",
    "kestrel_one.threads",
    "kestrel_one.execution",
    "kestrel_one.webhooks",
    "kestrel_one.artifacts",
    "kestrel_one.credentials",
    "kestrel_one.adapters",
    "kestrel_one.gateway",
    "kestrel_one.mcp",
    "kestrel_one.mcp_endpoint",
    "kestrel_one.sandbox_broker",
    "kestrel_one.api",
    "kestrel_one.local",
    "kestrel_one.oauth",
    "kestrel_one.console",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "kestrel_one.api.middleware.RequestIdMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    "csp.middleware.CSPMiddleware",
    "django_htmx.middleware.HtmxMiddleware",
    # Last, as django-axes asks: it turns a lockout found during sign-in into the response.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "kestrel_one.urls"
WSGI_APPLICATION = "kestrel_one.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

AUTH_USER_MODEL = "accounts.User"
AUTHENTICATION_BACKENDS = [
    # First: refuses any sign-in for a locked-out email and address before a password is checked.
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
    "kestrel_one.accounts.backends.ServerTokenBackend",
    "guardian.backends.ObjectPermissionBackend",
]
PASSWORD_HASHERS = [
    "django.contrib.auth.hashers.Argon2PasswordHasher",
    "django.contrib.auth.hashers.PBKDF2PasswordHasher",
]
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {
        "NAME": "django.contrib.auth.password_validation.MinimumLengthValidator",
        "OPTIONS": {"min_length": 12},
    },
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
]
# Console sign-in lockout (django-axes): after KESTREL_LOGIN_FAILURE_LIMIT failures for one
# email from one address, that pair is refused for KESTREL_LOGIN_LOCKOUT_MINUTES; a success
# resets the count. Keyed on the pair, so the same person at another address can still
# sign in (behind a reverse proxy every client shares one address: docs/operations.md).
AXES_FAILURE_LIMIT = env_int("KESTREL_LOGIN_FAILURE_LIMIT", 5)
AXES_COOLOFF_TIME = timedelta(minutes=env_int("KESTREL_LOGIN_LOCKOUT_MINUTES", 15))
if AXES_FAILURE_LIMIT < 1 or AXES_COOLOFF_TIME < timedelta(minutes=1):
    raise ImproperlyConfigured(
        "KESTREL_LOGIN_FAILURE_LIMIT and KESTREL_LOGIN_LOCKOUT_MINUTES must be at least 1"
    )
AXES_LOCKOUT_PARAMETERS = [["username", "ip_address"]]
AXES_RESET_ON_SUCCESS = True
AXES_USERNAME_CALLABLE = "kestrel_one.accounts.backends.sign_in_username"
AXES_CLIENT_IP_CALLABLE = "kestrel_one.accounts.backends.sign_in_address"
AXES_LOCKOUT_CALLABLE = "kestrel_one.accounts.views.locked_out"
AXES_DISABLE_ACCESS_LOG = True  # no row per successful sign-in; only failures are counted
AXES_VERBOSE = False  # no banner at every start; failures and lockouts are still logged
# Masked in what django-axes logs and keeps of a failed attempt (its email is its own column).
AXES_SENSITIVE_PARAMETERS = [
    "username",
    "ip_address",
    "password",
    "server_token",
    "csrfmiddlewaretoken",
]
GUARDIAN_RAISE_403 = False
ANONYMOUS_USER_NAME = None  # guardian: no anonymous user row; anonymity never carries grants

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = False
USE_TZ = True

STATIC_URL = "static/"
# Static files are served from the installed apps (whitenoise finders); hosted deployments
# may run collectstatic into KESTREL_STATIC_ROOT instead.
STATIC_ROOT = env_str("KESTREL_STATIC_ROOT")
STORAGES = {
    "default": {"BACKEND": "django.core.files.storage.FileSystemStorage"},
    "staticfiles": {"BACKEND": "django.contrib.staticfiles.storage.StaticFilesStorage"},
}
# Artifacts and checkpoints (docs/records.md): a folder under the data directory by default;
# any Django storage backend (for example django-storages' S3 backend) by naming it and its
# options as JSON.
KESTREL_ARTIFACT_STORAGE_BACKEND = env_str(
    "KESTREL_ARTIFACT_STORAGE_BACKEND", "django.core.files.storage.FileSystemStorage"
)
try:
    _artifact_storage_options = json.loads(env_str("KESTREL_ARTIFACT_STORAGE_OPTIONS", "{}"))
except ValueError as exc:
    raise ImproperlyConfigured("KESTREL_ARTIFACT_STORAGE_OPTIONS must be a JSON object") from exc
if not isinstance(_artifact_storage_options, dict):
    raise ImproperlyConfigured("KESTREL_ARTIFACT_STORAGE_OPTIONS must be a JSON object")
if KESTREL_ARTIFACT_STORAGE_BACKEND.endswith("FileSystemStorage"):
    _artifact_storage_options.setdefault("location", str(KESTREL_DATA_DIR / "artifacts"))
    # Nobody but the service reads these files; they are served through the API only.
    _artifact_storage_options.setdefault("file_permissions_mode", 0o600)
    _artifact_storage_options.setdefault("directory_permissions_mode", 0o700)
STORAGES["artifacts"] = {
    "BACKEND": KESTREL_ARTIFACT_STORAGE_BACKEND,
    "OPTIONS": _artifact_storage_options,
}
WHITENOISE_USE_FINDERS = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Browser sessions are short-lived, HttpOnly and never accepted by the REST API.
# Absolute lifetime from sign-in (not renewed per request), 2 hours by default and never more
# than KESTREL_SESSION_MAX_SECONDS (12 hours): a longer value is cut to it.
KESTREL_SESSION_MAX_SECONDS = 12 * 60 * 60
SESSION_COOKIE_AGE = min(
    max(env_int("KESTREL_SESSION_SECONDS", 2 * 60 * 60), 60), KESTREL_SESSION_MAX_SECONDS
)
SESSION_SAVE_EVERY_REQUEST = False
# Django's database sessions, with the expiry held to sign-in + SESSION_COOKIE_AGE.
SESSION_ENGINE = "kestrel_one.accounts.sessions"
SESSION_COOKIE_HTTPONLY = True
SESSION_COOKIE_SAMESITE = "Lax"
SESSION_EXPIRE_AT_BROWSER_CLOSE = True
CSRF_COOKIE_SAMESITE = "Lax"
CSRF_COOKIE_HTTPONLY = True
CSRF_FAILURE_VIEW = "kestrel_one.console.errors.csrf_failure"
LOGIN_URL = "/login"
LOGIN_REDIRECT_URL = "/console/"
# Sudo mode (kestrel_one/console/sudo.py): approving, accepting a plan, publishing a policy,
# minting a token with actions:approve and accepting a networking risk need a sign-in (or a
# password confirmation) this recent. 5 minutes by default, at least 30 seconds.
KESTREL_CONSOLE_SUDO_SECONDS = max(env_int("KESTREL_CONSOLE_SUDO_SECONDS", 5 * 60), 30)
# The overview's chart of actions per day is kept this long (per organization and set of
# visible projects, in Django's cache): its aggregate reads every action of 14 days.
KESTREL_CONSOLE_CHART_SECONDS = max(env_int("KESTREL_CONSOLE_CHART_SECONDS", 60), 0)
# Every response carries a Content-Security-Policy without 'unsafe-inline' or 'unsafe-eval'
# (django-csp): the console's scripts and styles are files served from this origin (htmx
# comes from django-htmx's static files), and nothing may frame it or post elsewhere.
CONTENT_SECURITY_POLICY = {
    "DIRECTIVES": {
        "default-src": ["'self'"],
        "script-src": ["'self'"],
        "style-src": ["'self'"],
        "img-src": ["'self'", "data:"],
        "connect-src": ["'self'"],
        "font-src": ["'self'"],
        "object-src": ["'none'"],
        "base-uri": ["'none'"],
        "form-action": ["'self'"],
        "frame-ancestors": ["'none'"],
    }
}
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"

if HOSTED:
    # TLS terminates at a trusted reverse proxy (docs/operations.md); it must set this header.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env_bool("KESTREL_SSL_REDIRECT", True)
    SECURE_REDIRECT_EXEMPT = [r"^api/v1/health$"]
    SECURE_HSTS_SECONDS = env_int("KESTREL_HSTS_SECONDS", 31536000)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = True
    SECURE_HSTS_PRELOAD = True
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["kestrel_one.api.authentication.KestrelTokenAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["kestrel_one.api.permissions.IsPrincipal"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["kestrel_one.api.parsers.JSONParser"],
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "DEFAULT_FILTER_BACKENDS": ["kestrel_one.api.filters.FilterBackend"],
    "DEFAULT_PAGINATION_CLASS": "kestrel_one.api.pagination.PublicIdCursorPagination",
    "PAGE_SIZE": 50,
    "EXCEPTION_HANDLER": "kestrel_one.api.errors.exception_handler",
    "UNAUTHENTICATED_USER": None,
    # No OPTIONS metadata: the OpenAPI schema describes every route, and DRF's metadata
    # assumed a serializer and an object lookup that singleton and action routes lack (500s).
    # OPTIONS is answered 405 like any method a route does not have.
    "DEFAULT_METADATA_CLASS": None,
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Kestrel One API",
    "DESCRIPTION": "Governed effects for AI agents and integrations. Errors are "
    '`{"error": {"code", "message", "details"}}`.',
    "VERSION": "1.0.0",
    "SERVE_INCLUDE_SCHEMA": False,
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "REDOC_DIST": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
}

# Refusal records (403s, refused tokens and runner reports) per actor and kind per minute
# in an organization; past it a refusal is logged, not recorded.
KESTREL_AUDIT_REFUSALS_PER_MINUTE = env_int("KESTREL_AUDIT_REFUSALS_PER_MINUTE", 30)
if KESTREL_AUDIT_REFUSALS_PER_MINUTE < 1:
    raise ImproperlyConfigured("KESTREL_AUDIT_REFUSALS_PER_MINUTE must be at least 1")

# API tokens: how long a new token lives unless the caller asks for less.
KESTREL_TOKEN_DEFAULT_TTL = timedelta(days=env_int("KESTREL_TOKEN_DEFAULT_DAYS", 90))
KESTREL_TOKEN_MAX_TTL = timedelta(days=env_int("KESTREL_TOKEN_MAX_DAYS", 365))

# One-time sign-in links for people added without a password (docs/operations.md): how long
# a link works. Django's password-reset tokens carry it as PASSWORD_RESET_TIMEOUT.
KESTREL_SIGN_IN_LINK_HOURS = env_int("KESTREL_SIGN_IN_LINK_HOURS", 72)
if KESTREL_SIGN_IN_LINK_HOURS < 1:
    raise ImproperlyConfigured("KESTREL_SIGN_IN_LINK_HOURS must be at least 1")
PASSWORD_RESET_TIMEOUT = KESTREL_SIGN_IN_LINK_HOURS * 60 * 60
# The address people open the console at (scheme and host, e.g. https://kestrel.example.com),
# for links made outside a request (manage.py member_add) and preferred over the request's
# own host by the API. Unset in single-host mode: http://127.0.0.1:$PORT.
KESTREL_PUBLIC_URL = (env_str("KESTREL_PUBLIC_URL") or "").rstrip("/") or None
if KESTREL_PUBLIC_URL is not None:
    _public = urlsplit(KESTREL_PUBLIC_URL)
    if (
        _public.scheme not in {"http", "https"}
        or not _public.hostname
        or _public.query
        or _public.fragment
    ):
        raise ImproperlyConfigured(
            "KESTREL_PUBLIC_URL must be an http(s) address such as https://kestrel.example.com, "
            f"got {KESTREL_PUBLIC_URL!r}"
        )

# OAuth for MCP clients (docs/mcp-endpoint.md, "OAuth"). The access token a client gets is an
# ordinary API token of the consenting person, limited to one Project; it lives this long and
# is renewed with the refresh token, which lives (unused) this long.
KESTREL_OAUTH_ACCESS_TOKEN_TTL = timedelta(
    seconds=env_int("KESTREL_OAUTH_ACCESS_TOKEN_SECONDS", 3600)
)
KESTREL_OAUTH_REFRESH_TOKEN_TTL = timedelta(days=env_int("KESTREL_OAUTH_REFRESH_TOKEN_DAYS", 30))
KESTREL_OAUTH_CODE_TTL = timedelta(seconds=60)
# Dynamic client registration: at most this many clients an hour from one address / overall.
KESTREL_OAUTH_REGISTRATIONS_PER_ADDRESS_HOUR = env_int(
    "KESTREL_OAUTH_REGISTRATIONS_PER_ADDRESS_HOUR", 20
)
KESTREL_OAUTH_REGISTRATIONS_PER_HOUR = env_int("KESTREL_OAUTH_REGISTRATIONS_PER_HOUR", 500)
# /oauth/token and /oauth/revoke together: at most this many requests from one address (an
# IPv6 client as its /64), DRF's "N/second|minute|hour|day", counted in the shared "rate"
# cache. Each exchange or refresh writes a token, its audit and (refreshing) a retired row.
KESTREL_OAUTH_TOKEN_RATE = env_str("KESTREL_OAUTH_TOKEN_RATE", "60/min")
if not timedelta(minutes=1) <= KESTREL_OAUTH_ACCESS_TOKEN_TTL <= timedelta(days=1):
    raise ImproperlyConfigured("KESTREL_OAUTH_ACCESS_TOKEN_SECONDS must be between 60 and 86400")
# django-oauth-toolkit runs the protocol; kestrel_one.oauth.validators stores what it issues.
OAUTH2_PROVIDER = {
    # Only the authorization code grant (response type code) and refresh_token exist, as the
    # metadata says. oauthlib's default Server also runs the password grant far enough to
    # check the password (before DOT refuses the grant), which would make /oauth/token a
    # sign-in that answers whether a password is right, past the console's lockout.
    "OAUTH2_SERVER_CLASS": "oauthlib.oauth2.WebApplicationServer",
    "OAUTH2_VALIDATOR_CLASS": "kestrel_one.oauth.validators.KestrelOAuth2Validator",
    "SCOPES": {
        "projects:read": "Read threads, actions, events and receipts of the Project.",
        "projects:write": "Create threads and request actions in the Project.",
    },
    "DEFAULT_SCOPES": ["projects:read", "projects:write"],
    "PKCE_REQUIRED": True,
    # Registration (kestrel_one.oauth.registration) admits https, and http on loopback only
    # (RFC 8252); this DOT setting reaches only DOT's own views, which are not mounted.
    "ALLOWED_REDIRECT_URI_SCHEMES": ["https"],
    "AUTHORIZATION_CODE_EXPIRE_SECONDS": int(KESTREL_OAUTH_CODE_TTL.total_seconds()),
    "ACCESS_TOKEN_EXPIRE_SECONDS": int(KESTREL_OAUTH_ACCESS_TOKEN_TTL.total_seconds()),
    "ROTATE_REFRESH_TOKEN": True,
    "REQUEST_APPROVAL_PROMPT": "force",
    "COMPLIANT_BCP_RFC9700_IMPLICIT_GRANT": True,
    "COMPLIANT_BCP_RFC9700_PASSWORD_GRANT": True,
    "COMPLIANT_BCP_RFC9700_PKCE_METHOD": True,
    "COMPLIANT_BCP_RFC9700_TOKEN_STORAGE": True,
    "COMPLIANT_BCP_RFC9700_ACCESS_TOKEN_TRANSPORT": True,
    # RFC 9207: the redirect names this issuer, the one the metadata publishes.
    "COMPLIANT_BCP_RFC9700_AUTHZ_RESPONSE_ISS": True,
    "OIDC_ISS_ENDPOINT": KESTREL_PUBLIC_URL or "",
    # Kestrel's refresh tokens (kestrel_one.oauth) end their grant when replayed.
    "REFRESH_TOKEN_REUSE_PROTECTION": True,
}

# DOT's default models, named so migrations depending on them resolve (DOT's swappable setting).
OAUTH2_PROVIDER_APPLICATION_MODEL = "oauth2_provider.Application"

# Execution. The control plane signs commands with this Ed25519 key; runners hold only its
# public half. Hosted mode names the file; single-host generates one in the data folder.
KESTREL_SIGNING_KEY_FILE = Path(
    env_str("KESTREL_SIGNING_KEY_FILE") or KESTREL_DATA_DIR / "control_signing_key.pem"
)
if HOSTED and not env_str("KESTREL_SIGNING_KEY_FILE"):
    raise ImproperlyConfigured("KESTREL_MODE=hosted requires KESTREL_SIGNING_KEY_FILE to be set")
# Credentials (docs/credentials.md): the key-encryption key that wraps every credential's
# data key. Hosted mode names the file; single-host generates one (0600) in the data folder.
# The previous key file is read only during a key rotation, until every record is re-wrapped.
KESTREL_CREDENTIALS_KEY_FILE = Path(
    env_str("KESTREL_CREDENTIALS_KEY_FILE") or KESTREL_DATA_DIR / "credentials_key"
)
if HOSTED and not env_str("KESTREL_CREDENTIALS_KEY_FILE"):
    raise ImproperlyConfigured(
        "KESTREL_MODE=hosted requires KESTREL_CREDENTIALS_KEY_FILE to be set (the file holding "
        "the key that encrypts credentials; docs/credentials.md)"
    )
KESTREL_CREDENTIALS_PREVIOUS_KEY_FILE = env_str("KESTREL_CREDENTIALS_PREVIOUS_KEY_FILE")
KESTREL_DEFAULT_POOL = env_str("KESTREL_DEFAULT_POOL", "default")
# Every enrolled runner logs in to the broker as its own Redis ACL user, limited to its
# pool's keys and removed when it is revoked (kestrel_one/execution/broker_users.py). REDIS_URL
# must then name a user allowed ACL SETUSER/DELUSER/LIST and CLIENT KILL (Redis 6+). Only a
# single host may turn this off (runners then share the control plane's broker access).
KESTREL_RUNNER_BROKER_USERS = env_bool("KESTREL_RUNNER_BROKER_USERS", True)
if HOSTED and not KESTREL_RUNNER_BROKER_USERS:
    raise ImproperlyConfigured(
        "KESTREL_RUNNER_BROKER_USERS=0 is refused in hosted mode: without a broker user of "
        "its own, a revoked runner could still take commands. Use a Redis with ACLs (6+)."
    )

# The exact arguments of a call not ended yet (to sign its command, and to mask its own
# environment values in its output) are kept encrypted with a key derived from this (or from
# SECRET_KEY when unset), and erased when the call ends (docs/records.md, "Redaction").
KESTREL_ARGUMENT_ENCRYPTION_KEY = env_str("KESTREL_ARGUMENT_ENCRYPTION_KEY")
# How long a signed command stays valid for a runner to pick it up.
KESTREL_COMMAND_TTL_SECONDS = env_int("KESTREL_COMMAND_TTL_SECONDS", 120)
# The longest a call may run on a runner; runners use the same value for their broker
# visibility timeout, so a call is never redelivered while it still runs.
KESTREL_MAX_CALL_SECONDS = env_int("KESTREL_MAX_CALL_SECONDS", 600)
# The largest runner report recorded, in bytes (docs/runners.md#reports). Runners cut their
# results to fit the same variable on their side; a larger report ends its call as failed
# (report_refused) instead of being recorded.
KESTREL_MAX_REPORT_BYTES = env_int("KESTREL_MAX_REPORT_BYTES", DEFAULT_MAX_REPORT_BYTES)
# How long after its deadline the sweep waits before it ends a silent call.
KESTREL_CALL_GRACE_SECONDS = env_int("KESTREL_CALL_GRACE_SECONDS", 60)
# Single-host: calls the local runner (and reports the control worker) handle at once. On a
# 2-core host 4 slots measured slower than 2 (docs/performance.md); raise it on larger hosts.
KESTREL_LOCAL_CONCURRENCY = env_int("KESTREL_LOCAL_CONCURRENCY", 2)
# How long an action may wait for a person's decision before it expires.
KESTREL_APPROVAL_TTL_SECONDS = env_int("KESTREL_APPROVAL_TTL_SECONDS", 24 * 60 * 60)
# The most times one accepted plan step may run (a plan step's "uses"; 1 unless it says).
KESTREL_PLAN_STEP_MAX_USES = max(env_int("KESTREL_PLAN_STEP_MAX_USES", 100), 1)
# How long a replay of an Idempotency-Key returns the first response (at least a day).
KESTREL_IDEMPOTENCY_TTL_SECONDS = max(
    env_int("KESTREL_IDEMPOTENCY_TTL_SECONDS", 48 * 60 * 60), 24 * 60 * 60
)
# The longest a request may long-poll with ?wait=SECONDS.
KESTREL_MAX_WAIT_SECONDS = env_int("KESTREL_MAX_WAIT_SECONDS", 60)

# The MCP endpoint (docs/mcp-endpoint.md). A request body's bound, each caller's rate (DRF's
# "N/second|minute|hour|day", counted in the shared "rate" cache below), how long a
# tools/call waits for its action before answering "still running", and the web origins
# besides this service's own that may call it from a browser (DNS rebinding protection).
KESTREL_MCP_MAX_REQUEST_BYTES = env_int("KESTREL_MCP_MAX_REQUEST_BYTES", 1024 * 1024)
KESTREL_MCP_RATE = env_str("KESTREL_MCP_RATE", "600/min")
KESTREL_MCP_CALL_WAIT_SECONDS = min(
    env_int("KESTREL_MCP_CALL_WAIT_SECONDS", 30), KESTREL_MAX_WAIT_SECONDS
)
# A session unused this long is gone: its id answers 404 and the client starts a new one.
KESTREL_MCP_SESSION_IDLE_SECONDS = max(env_int("KESTREL_MCP_SESSION_IDLE_SECONDS", 24 * 3600), 60)
# The most sessions one caller (a person, an integration) keeps open in an organization; a
# new one pushes out the least recently used.
KESTREL_MCP_SESSIONS_PER_CALLER = max(env_int("KESTREL_MCP_SESSIONS_PER_CALLER", 100), 1)
KESTREL_MCP_ALLOWED_ORIGINS = [
    o.strip() for o in (env_str("KESTREL_MCP_ALLOWED_ORIGINS") or "").split(",") if o.strip()
]

# Caches: the default is per process; counts every web process must share (rate bounds) are
# kept in Redis, the broker's, under their own key prefix.
KESTREL_RATE_CACHE = "rate"
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    KESTREL_RATE_CACHE: {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "kestrel-rate",
    },
}

# Policy documents (docs/policy.md#caps): the most one PUT may hold, so that no tenant's
# document can hold a web worker. KESTREL_POLICY_MAX_BYTES caps the JSON body; each other
# caps one kind of list, per list (paths per fs.read/fs.write grant, tools per MCP server, ...).
KESTREL_POLICY_LIMITS = {
    "bytes": env_int("KESTREL_POLICY_MAX_BYTES", 64 * 1024),
    "paths": env_int("KESTREL_POLICY_MAX_PATHS", 256),
    "origins": env_int("KESTREL_POLICY_MAX_ORIGINS", 64),
    "commands": env_int("KESTREL_POLICY_MAX_COMMANDS", 128),
    "env": env_int("KESTREL_POLICY_MAX_ENV", 64),
    "models": env_int("KESTREL_POLICY_MAX_MODELS", 64),
    "servers": env_int("KESTREL_POLICY_MAX_SERVERS", 32),
    "tools": env_int("KESTREL_POLICY_MAX_TOOLS", 256),
    "adapters": env_int("KESTREL_POLICY_MAX_ADAPTERS", 32),
    "operations": env_int("KESTREL_POLICY_MAX_OPERATIONS", 128),
}
# The policy console's preview (docs/console.md#policy-console) replays the recorded decisions
# of the last KESTREL_POLICY_PREVIEW_DAYS against a draft, at most the newest
# KESTREL_POLICY_PREVIEW_MAX_ACTIONS of them, so one preview stays a bounded amount of work.
KESTREL_POLICY_PREVIEW_DAYS = max(env_int("KESTREL_POLICY_PREVIEW_DAYS", 14), 1)
KESTREL_POLICY_PREVIEW_MAX_ACTIONS = max(env_int("KESTREL_POLICY_PREVIEW_MAX_ACTIONS", 5000), 1)

# Execution needs a broker (Redis). When it does not answer, requests that would run
# something are refused with a clear error rather than queued where nothing will ever take
# them (kestrel_one/common/broker.py). REDIS_URL is redis-py's spelling; Celery's (kombu's)
# differs for a Unix socket (runners/contract/broker.py).
CELERY_BROKER_URL = kombu_url(REDIS_URL) if REDIS_URL else None
CELERY_TASK_ACKS_LATE = True
CELERY_TASK_REJECT_ON_WORKER_LOST = True
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_DEFAULT_QUEUE = "control"
# Every control-plane task runs on the control queue (runners have their own app and queues).
# Except the control tier's calls (adapter.invoke, model.invoke): their own queue, consumed
# by the adapter worker only; and what runners send (signed reports, heartbeats, inventories,
# adapter requests): queue "reports", whose worker runs nothing else (kestrel_one/celery.py).
# Exact names win over the pattern.
CELERY_TASK_ROUTES = {
    "control.adapter_invoke": {"queue": "adapters"},
    "control.model_invoke": {"queue": "adapters"},
    **{name: {"queue": REPORT_QUEUE} for name in sorted(RUNNER_SENT_TASKS)},
    "control.*": {"queue": "control"},
}
CELERY_BROKER_TRANSPORT_OPTIONS = {"visibility_timeout": KESTREL_MAX_CALL_SECONDS + 120}
# Workers keep database connections across tasks under Django's CONN_MAX_AGE rule instead of
# Celery's close-after-every-task (kestrel_one.celery); this turns Celery's own closing off.
CELERY_DB_REUSE_MAX = 1_000_000_000
CELERY_BEAT_SCHEDULE = {
    "sweep-silent-calls": {
        "task": "control.sweep",
        "schedule": 15.0,
        "options": {"queue": "control"},
    },
}
# Audit records are chained right after the transaction that wrote them commits; this sweep
# chains any that a crashed process left pending (docs/audit.md).
KESTREL_AUDIT_CHAIN_SWEEP_SECONDS = env_int("KESTREL_AUDIT_CHAIN_SWEEP_SECONDS", 10)
CELERY_BEAT_SCHEDULE["chain-audit-records"] = {
    "task": "control.audit.chain",
    "schedule": float(KESTREL_AUDIT_CHAIN_SWEEP_SECONDS),
    "options": {"queue": "control"},
}

# MCP servers (docs/mcp.md). A discovery's signed request lives this long; one nobody
# answered by then (plus KESTREL_CALL_GRACE_SECONDS) is failed by the sweep (no_runner),
# which also records each risk acceptance's expiry in the audit log once.
KESTREL_MCP_DISCOVERY_SECONDS = env_int("KESTREL_MCP_DISCOVERY_SECONDS", 300)
KESTREL_MCP_SWEEP_SECONDS = env_int("KESTREL_MCP_SWEEP_SECONDS", 30)
CELERY_BEAT_SCHEDULE["mcp-sweep"] = {
    "task": "control.mcp.sweep",
    "schedule": float(KESTREL_MCP_SWEEP_SECONDS),
    "options": {"queue": "control"},
}


def env_seconds_list(name: str, default: str) -> list[float]:
    raw = env_str(name, default) or default
    try:
        values = [float(part) for part in raw.split(",") if part.strip()]
    except ValueError as exc:
        raise ImproperlyConfigured(f"{name} must be comma-separated seconds, got {raw!r}") from exc
    if not values or any(value < 0 for value in values):
        raise ImproperlyConfigured(f"{name} needs at least one non-negative delay, got {raw!r}")
    return values


# Webhooks (docs/webhooks.md). Retries wait these delays in turn (each with +/-20% jitter):
# about 24 hours in all, then the delivery is failed.
KESTREL_WEBHOOK_RETRY_DELAYS = env_seconds_list(
    "KESTREL_WEBHOOK_RETRY_DELAYS", "5,30,120,600,1800,3600,7200,14400,28800,28800"
)
KESTREL_WEBHOOK_CONNECT_TIMEOUT_SECONDS = env_int("KESTREL_WEBHOOK_CONNECT_TIMEOUT_SECONDS", 5)
KESTREL_WEBHOOK_TIMEOUT_SECONDS = env_int("KESTREL_WEBHOOK_TIMEOUT_SECONDS", 15)
KESTREL_WEBHOOK_MAX_RESPONSE_BYTES = env_int("KESTREL_WEBHOOK_MAX_RESPONSE_BYTES", 64 * 1024)
# A claimed delivery whose worker went silent this long is taken again by the sweep; it must
# exceed the longest attempt (the timeout above).
KESTREL_WEBHOOK_LEASE_SECONDS = env_int("KESTREL_WEBHOOK_LEASE_SECONDS", 120)
KESTREL_WEBHOOK_SWEEP_SECONDS = env_int("KESTREL_WEBHOOK_SWEEP_SECONDS", 30)
# How long the previous signing secret keeps signing after a rotation unless the caller says.
KESTREL_WEBHOOK_ROTATION_OVERLAP_SECONDS = env_int(
    "KESTREL_WEBHOOK_ROTATION_OVERLAP_SECONDS", 24 * 60 * 60
)
# Signing secrets are encrypted with a key derived from this (or from SECRET_KEY when unset).
KESTREL_WEBHOOK_ENCRYPTION_KEY = env_str("KESTREL_WEBHOOK_ENCRYPTION_KEY")
# Development and tests only: addresses or CIDRs a destination may resolve to even though they
# are private, loopback or otherwise refused. Never set this in a hosted deployment.
KESTREL_WEBHOOK_ALLOW_ADDRESSES = [
    part.strip()
    for part in (env_str("KESTREL_WEBHOOK_ALLOW_ADDRESSES") or "").split(",")
    if part.strip()
]
# An extra CA bundle (PEM) to trust for destinations, e.g. a private CA; system CAs otherwise.
KESTREL_WEBHOOK_CA_BUNDLE = env_str("KESTREL_WEBHOOK_CA_BUNDLE")
# The one egress client (kestrel_one/common/egress.py, docs/operations.md#egress). Development
# and tests only: an exact host name pointed at a test address ("host=addr:port,..."), which
# is then reached even on loopback, and an extra CA bundle to trust for every destination.
# Both are refused in hosted mode unless KESTREL_EGRESS_OVERRIDES_IN_HOSTED says otherwise.
try:
    KESTREL_EGRESS_HOST_OVERRIDES = host_overrides_parse(env_str("KESTREL_EGRESS_HOST_OVERRIDES"))
except ValueError as exc:
    raise ImproperlyConfigured(str(exc)) from None
KESTREL_EGRESS_CA_BUNDLE = env_str("KESTREL_EGRESS_CA_BUNDLE")
KESTREL_EGRESS_OVERRIDES_IN_HOSTED = env_bool("KESTREL_EGRESS_OVERRIDES_IN_HOSTED", False)
if HOSTED and not KESTREL_EGRESS_OVERRIDES_IN_HOSTED:
    # The webhook allowlist too: it admits refused addresses for URLs tenants choose.
    for _name in (
        "KESTREL_EGRESS_HOST_OVERRIDES",
        "KESTREL_EGRESS_CA_BUNDLE",
        "KESTREL_WEBHOOK_ALLOW_ADDRESSES",
    ):
        if env_str(_name):
            raise ImproperlyConfigured(
                f"{_name} is refused in hosted mode unless KESTREL_EGRESS_OVERRIDES_IN_HOSTED=1"
            )
if KESTREL_EGRESS_CA_BUNDLE and not Path(KESTREL_EGRESS_CA_BUNDLE).is_file():
    raise ImproperlyConfigured(
        f"KESTREL_EGRESS_CA_BUNDLE names {KESTREL_EGRESS_CA_BUNDLE!r}, which is not a file"
    )
CELERY_BEAT_SCHEDULE["sweep-webhook-deliveries"] = {
    "task": "control.webhooks.sweep",
    "schedule": float(KESTREL_WEBHOOK_SWEEP_SECONDS),
    "options": {"queue": "control"},
}

# Records (docs/records.md). stdout/stderr past this many bytes are kept in full as an
# artifact; the action's result keeps this much inline with a marker.
KESTREL_ARTIFACT_INLINE_BYTES = env_int("KESTREL_ARTIFACT_INLINE_BYTES", 16 * 1024)
# Share links live this long unless the caller asks for less; never longer than the maximum.
KESTREL_SHARE_DEFAULT_SECONDS = env_int("KESTREL_SHARE_DEFAULT_SECONDS", 7 * 24 * 60 * 60)
KESTREL_SHARE_MAX_SECONDS = env_int("KESTREL_SHARE_MAX_SECONDS", 30 * 24 * 60 * 60)
KESTREL_RETENTION_SWEEP_SECONDS = env_int("KESTREL_RETENTION_SWEEP_SECONDS", 60 * 60)
CELERY_BEAT_SCHEDULE["retention-sweep"] = {
    "task": "control.retention",
    "schedule": float(KESTREL_RETENTION_SWEEP_SECONDS),
    "options": {"queue": "control"},
}

# The model gateway (docs/gateway.md). A project without a budget of its own gets these
# limits (tokens per UTC day / month); unset (the default) is no limit on that period.
KESTREL_GATEWAY_DEFAULT_TOKENS_PER_DAY = (
    env_int("KESTREL_GATEWAY_DEFAULT_TOKENS_PER_DAY", 0)
    if env_str("KESTREL_GATEWAY_DEFAULT_TOKENS_PER_DAY")
    else None
)
KESTREL_GATEWAY_DEFAULT_TOKENS_PER_MONTH = (
    env_int("KESTREL_GATEWAY_DEFAULT_TOKENS_PER_MONTH", 0)
    if env_str("KESTREL_GATEWAY_DEFAULT_TOKENS_PER_MONTH")
    else None
)
# The output bound sent to the provider (and reserved) when a call names no max_tokens.
KESTREL_GATEWAY_DEFAULT_MAX_TOKENS = env_int("KESTREL_GATEWAY_DEFAULT_MAX_TOKENS", 4096)
# A reservation nobody settled this long after it was taken is charged in full and released
# (the provider's own timeout is 120 s; a settled call never waits for this).
KESTREL_GATEWAY_RESERVATION_SECONDS = env_int("KESTREL_GATEWAY_RESERVATION_SECONDS", 300)
KESTREL_GATEWAY_SWEEP_SECONDS = env_int("KESTREL_GATEWAY_SWEEP_SECONDS", 60)
CELERY_BEAT_SCHEDULE["gateway-expire-reservations"] = {
    "task": "control.gateway.expire_reservations",
    "schedule": float(KESTREL_GATEWAY_SWEEP_SECONDS),
    "options": {"queue": "control"},
}

# MCP servers (docs/mcp.md): how far ahead an admin's risk acceptance (a custom server's
# unrestricted networking, MCP-4) may expire; it is a decision to revisit, never open-ended.
KESTREL_MCP_RISK_MAX_DAYS = env_int("KESTREL_MCP_RISK_MAX_DAYS", 90)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {
        "json": {
            "()": structlog.stdlib.ProcessorFormatter,
            "processors": [
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                # Last before rendering, so whatever any logger bound (stdlib or structlog,
                # exceptions included) is redacted by the same rules as audit data.
                redact_log_event,
                structlog.processors.JSONRenderer(),
            ],
            "foreign_pre_chain": [structlog.stdlib.add_log_level, structlog.stdlib.add_logger_name],
        }
    },
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "json"}},
    "root": {"handlers": ["console"], "level": env_str("KESTREL_LOG_LEVEL", "INFO")},
    # The MCP SDK logs each request's transport starting and stopping at INFO: the endpoint
    # makes one per request (kestrel_one/mcp_endpoint/bridge.py), so only its warnings count.
    "loggers": {"mcp.server": {"level": env_str("KESTREL_MCP_SDK_LOG_LEVEL", "WARNING")}},
}

structlog.configure(
    processors=[
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
    ],
    logger_factory=structlog.stdlib.LoggerFactory(),
    wrapper_class=structlog.stdlib.BoundLogger,
    cache_logger_on_first_use=True,
)
