"""Runner configuration, read only from the environment (RUN-7).

A runner is given its identity, its own private key, the control plane's public key, the
broker and where to keep call state, and nothing else: no database URL, no provider
secret. A missing or unsafe value stops the runner with a message naming the variable.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from runners.contract.broker import is_redis_url, kombu_url, redis_client_url
from runners.contract.names import runner_queue
from runners.contract.tokens import (
    DEFAULT_MAX_REPORT_BYTES,
    load_private_key,
    load_public_key,
)
from runners.contract.toolspec import DEFAULT_READ_MAX_FILE_BYTES
from runners.sandbox import BACKEND_FACTORIES

__all__ = ["SANDBOX_CHOICES", "RunnerConfig", "RunnerConfigError"]

# "auto", or one backend by name (runners.sandbox.BACKEND_FACTORIES, in preference order).
SANDBOX_CHOICES = ("auto", *BACKEND_FACTORIES)
DEFAULT_MAX_CALL_SECONDS = 600
# Most calls end well within a second; a call still running after this long gets its own
# "started" report, the others only their "finished" one (docs/runners.md#reports).
DEFAULT_STARTED_REPORT_DELAY_SECONDS = 1.0
# A report is cut to fit this (runners.report_budget); below the minimum not even an error
# report with its scope would fit.
MIN_REPORT_BYTES = 16 * 1024
# Each project's workspace is a filesystem of this size (runners.workspace.WorkspaceQuota).
DEFAULT_WORKSPACE_QUOTA_MB = 1024
# One call may grow its workspace by this much at most (runners.write_budget).
DEFAULT_CALL_WRITE_BUDGET_MB = 256
# How often a runner tells the control plane which workspaces it keeps, besides at start
# (runners.inventory): the bound on how long a deleted project's files outlive a missed
# project.delete on a host that is up.
DEFAULT_WORKSPACE_INVENTORY_SECONDS = 600.0

_RUNNER_ID = re.compile(r"^run_[A-Za-z0-9_-]{1,124}$")
_POOL = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_ORGANIZATION = re.compile(r"^org_[A-Za-z0-9_-]{1,124}$")


class RunnerConfigError(ValueError):
    """The runner's environment is incomplete or unsafe; the message names the variable."""


@dataclass(frozen=True)
class RunnerConfig:
    """Everything a runner process needs, validated."""

    runner_id: str
    pool: str
    key_file: Path
    control_public_key_file: Path
    broker_url: str
    state_url: str
    workspace_root: Path
    sandbox: str = "auto"
    max_call_seconds: int = DEFAULT_MAX_CALL_SECONDS
    # 0 sends "started" as soon as the call starts, for every call.
    started_report_delay_s: float = DEFAULT_STARTED_REPORT_DELAY_SECONDS
    # The signed finished report's size budget; keep it at most the control plane's
    # KESTREL_MAX_REPORT_BYTES (the same variable and default on both sides).
    max_report_bytes: int = DEFAULT_MAX_REPORT_BYTES
    # 0: no quota filesystem (an unprivileged runner, which cannot mount one).
    workspace_quota_mb: int = DEFAULT_WORKSPACE_QUOTA_MB
    # 0: no per-call budget. It lives on the quota filesystem, so it needs the quota too.
    call_write_budget_mb: int = DEFAULT_CALL_WRITE_BUDGET_MB
    read_max_file_bytes: int = DEFAULT_READ_MAX_FILE_BYTES
    # The organization a dedicated runner was enrolled for (its public id); None for a
    # shared runner. A command bound to any other organization is refused.
    organization: str | None = None
    workspace_inventory_s: float = DEFAULT_WORKSPACE_INVENTORY_SECONDS

    @property
    def call_write_budget_bytes(self) -> int:
        """What one call may add to its workspace; 0 (none) without a quota filesystem."""
        if not self.workspace_quota_mb:
            return 0
        return self.call_write_budget_mb * 1024 * 1024

    @property
    def queue(self) -> str:
        """The Celery queue (and command audience) this runner serves."""
        return runner_queue(self.pool)

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> RunnerConfig:
        env = os.environ if environ is None else environ

        def required(name: str) -> str:
            value = env.get(name, "").strip()
            if not value:
                raise RunnerConfigError(f"{name} is required and not set")
            return value

        runner_id = required("KESTREL_RUNNER_ID")
        if not _RUNNER_ID.fullmatch(runner_id):
            raise RunnerConfigError(
                f"KESTREL_RUNNER_ID must be the enrolled runner id (run_...), got {runner_id!r}"
            )
        pool = required("KESTREL_RUNNER_POOL")
        if not _POOL.fullmatch(pool):
            raise RunnerConfigError(
                f"KESTREL_RUNNER_POOL must be letters, digits, '_', '-' or '.', got {pool!r}"
            )
        organization = env.get("KESTREL_RUNNER_ORGANIZATION", "").strip() or None
        if organization is not None and not _ORGANIZATION.fullmatch(organization):
            raise RunnerConfigError(
                "KESTREL_RUNNER_ORGANIZATION must be the organization id the runner was "
                f"enrolled for (org_...), got {organization!r}"
            )
        password = broker_password(env)
        # Either spelling of a Redis on a Unix socket is taken (runners.contract.broker): Celery
        # gets kombu's, the call state redis-py's.
        broker_url = kombu_url(required("KESTREL_BROKER_URL"))
        if password is not None:
            # The runner's own broker user is named by its runner id (docs/runners.md); call
            # state on the broker (the default) uses it too.
            broker_url = with_credentials(broker_url, runner_id, password)
        state_url = env.get("KESTREL_RUNNER_STATE_URL", "").strip()
        if not state_url:
            if not is_redis_url(broker_url):
                raise RunnerConfigError(
                    "KESTREL_RUNNER_STATE_URL is required when KESTREL_BROKER_URL is not "
                    "a Redis URL (call state lives in Redis)"
                )
            state_url = broker_url
        if not is_redis_url(state_url):
            raise RunnerConfigError(
                "KESTREL_RUNNER_STATE_URL must be a Redis URL (redis://, rediss:// or "
                "unix:///path/to/redis.sock)"
            )
        state_url = redis_client_url(state_url)
        sandbox = env.get("KESTREL_SANDBOX", "auto").strip() or "auto"
        if sandbox not in SANDBOX_CHOICES:
            raise RunnerConfigError(
                f"KESTREL_SANDBOX must be one of {', '.join(SANDBOX_CHOICES)}, got {sandbox!r}"
            )
        max_call = env_whole_number(env, "KESTREL_MAX_CALL_SECONDS", DEFAULT_MAX_CALL_SECONDS)
        started_delay = env_seconds(
            env,
            "KESTREL_STARTED_REPORT_DELAY_SECONDS",
            DEFAULT_STARTED_REPORT_DELAY_SECONDS,
        )
        max_report = env_whole_number(
            env, "KESTREL_MAX_REPORT_BYTES", DEFAULT_MAX_REPORT_BYTES, hint=" of bytes"
        )
        if max_report < MIN_REPORT_BYTES:
            raise RunnerConfigError(
                f"KESTREL_MAX_REPORT_BYTES must be at least {MIN_REPORT_BYTES}, got {max_report}"
            )
        quota_text = env.get("KESTREL_WORKSPACE_QUOTA_MB", "").strip()
        quota_mb = (
            0
            if quota_text == "0"
            else env_whole_number(
                env, "KESTREL_WORKSPACE_QUOTA_MB", DEFAULT_WORKSPACE_QUOTA_MB, hint=" (or 0)"
            )
        )
        if quota_mb and os.geteuid() != 0:
            raise RunnerConfigError(
                "KESTREL_WORKSPACE_QUOTA_MB needs a runner running as root (each workspace "
                "is a loop-mounted filesystem of that size); set it to 0 to run without a "
                "workspace quota"
            )
        budget_text = env.get("KESTREL_CALL_WRITE_BUDGET_MB", "").strip()
        budget_mb = (
            0
            if budget_text == "0"
            else env_whole_number(
                env, "KESTREL_CALL_WRITE_BUDGET_MB", DEFAULT_CALL_WRITE_BUDGET_MB, hint=" (or 0)"
            )
        )
        read_max = env_whole_number(
            env, "KESTREL_READ_MAX_FILE_BYTES", DEFAULT_READ_MAX_FILE_BYTES, hint=" of bytes"
        )
        inventory_every = env_seconds(
            env,
            "KESTREL_WORKSPACE_INVENTORY_SECONDS",
            DEFAULT_WORKSPACE_INVENTORY_SECONDS,
            above_zero=True,
        )
        workspace_root = Path(required("KESTREL_WORKSPACE_ROOT"))
        if not workspace_root.is_dir():
            raise RunnerConfigError(
                f"KESTREL_WORKSPACE_ROOT {str(workspace_root)!r} is not an existing directory"
            )
        config = cls(
            runner_id=runner_id,
            pool=pool,
            key_file=Path(required("KESTREL_RUNNER_KEY_FILE")),
            control_public_key_file=Path(required("KESTREL_CONTROL_PUBLIC_KEY_FILE")),
            broker_url=broker_url,
            state_url=state_url,
            workspace_root=workspace_root,
            sandbox=sandbox,
            max_call_seconds=max_call,
            started_report_delay_s=started_delay,
            max_report_bytes=max_report,
            workspace_quota_mb=quota_mb,
            call_write_budget_mb=budget_mb,
            read_max_file_bytes=read_max,
            organization=organization,
            workspace_inventory_s=inventory_every,
        )
        # Read both keys now so that a bad file stops the runner at start, not at a call.
        config.private_key()
        config.control_public_key()
        return config

    def private_key(self) -> Ed25519PrivateKey:
        """The runner's own signing key; refused if anyone but its owner could read it."""
        try:
            mode = self.key_file.stat().st_mode
        except OSError as error:
            raise RunnerConfigError(
                f"KESTREL_RUNNER_KEY_FILE {str(self.key_file)!r} cannot be read: {error.strerror}"
            ) from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise RunnerConfigError(
                f"KESTREL_RUNNER_KEY_FILE {str(self.key_file)!r} is readable by group or "
                f"others (mode {stat.S_IMODE(mode):04o}); chmod 600 it"
            )
        try:
            return load_private_key(self.key_file.read_bytes())
        except (ValueError, TypeError) as error:
            raise RunnerConfigError(
                f"KESTREL_RUNNER_KEY_FILE {str(self.key_file)!r} is not an Ed25519 private key "
                f"PEM ({error})"
            ) from None

    def control_public_key(self) -> Ed25519PublicKey:
        """The key every command must be signed with."""
        try:
            return load_public_key(self.control_public_key_file.read_bytes())
        except OSError as error:
            raise RunnerConfigError(
                f"KESTREL_CONTROL_PUBLIC_KEY_FILE {str(self.control_public_key_file)!r} "
                f"cannot be read: {error.strerror}"
            ) from None
        except (ValueError, TypeError) as error:
            raise RunnerConfigError(
                f"KESTREL_CONTROL_PUBLIC_KEY_FILE {str(self.control_public_key_file)!r} is "
                f"not an Ed25519 public key PEM ({error})"
            ) from None


def broker_password(env: Mapping[str, str]) -> str | None:
    """The runner's broker password from ``KESTREL_BROKER_PASSWORD_FILE`` (mode 0600), or
    None when the broker URL carries the credentials itself (or the broker needs none)."""
    name = "KESTREL_BROKER_PASSWORD_FILE"
    path = env.get(name, "").strip()
    if not path:
        return None
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as error:
        reason = getattr(error, "strerror", None) or "not ASCII text"
        raise RunnerConfigError(f"{name} {path!r} cannot be read: {reason}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise RunnerConfigError(
            f"{name} {path!r} is readable by group or others (mode {stat.S_IMODE(mode):04o}); "
            "chmod 600 it"
        )
    if not text or any(ch.isspace() for ch in text):
        raise RunnerConfigError(f"{name} {path!r} must hold the broker password on one line")
    return text


def with_credentials(url: str, username: str, password: str) -> str:
    """``url`` authenticating as ``username`` with ``password`` (replacing any it names)."""
    parts = urlsplit(url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(username, safe='')}:{quote(password, safe='')}@{host}"
    return urlunsplit(parts._replace(netloc=netloc))


def env_seconds(
    env: Mapping[str, str], name: str, default: float, *, above_zero: bool = False
) -> float:
    """A number of seconds from ``env`` (``default`` when unset or blank), finite and >= 0,
    or > 0 with ``above_zero``. NaN is refused: it compares false with every deadline."""
    text = env.get(name, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (above_zero and value == 0):
        bound = "> 0" if above_zero else ">= 0"
        raise RunnerConfigError(f"{name} must be a number of seconds {bound}, got {text!r}")
    return value


def env_whole_number(env: Mapping[str, str], name: str, default: int, *, hint: str = "") -> int:
    """A whole number >= 1 from ``env`` (``default`` when unset or blank), in ASCII digits."""
    text = env.get(name, "").strip()
    if not text:
        return default
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise RunnerConfigError(f"{name} must be a positive whole number{hint}, got {text!r}")
    return int(text)
