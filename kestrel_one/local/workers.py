"""Single-host mode: the control plane's workers and a runner as child processes of ``serve``.

The local runner is enrolled like any other: its own key in the data folder (0600), its
public key registered, the control plane's public key handed to it, and a broker user of its
own (its password in the data folder, 0600). It gets no database URL and no secret but its
key and that password, exactly as a hosted runner, so single-host runs the same signed path.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys

from django.conf import settings

from kestrel_one.accounts.principal import system_principal
from kestrel_one.execution.broker_users import (
    BrokerAclUnavailable,
    broker_users_enabled,
    runner_broker_user_issue,
    runner_broker_users_reconcile,
)
from kestrel_one.execution.enrollment import runner_enroll
from kestrel_one.execution.keys import control_public_key_pem
from kestrel_one.execution.models import Runner
from kestrel_one.local.runtime import die_with_parent, runtime_paths
from runners.contract.names import ADAPTERS_QUEUE, CONTROL_QUEUE, REPORT_QUEUE
from runners.contract.tokens import generate_private_key_pem, public_key_pem

# Only what a process needs to run at all; the runner gets nothing else from our environment.
_BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "DOCKER_HOST", "VIRTUAL_ENV")
# The runner's own tuning (docs/runners.md), passed on when set: none of it is a secret.
_RUNNER_TUNING = (
    "KESTREL_STARTED_REPORT_DELAY_SECONDS",
    "KESTREL_WARM_SANDBOXES",
    "KESTREL_WARM_IDLE_SECONDS",
    "KESTREL_WARM_MAX_CONTAINERS",
    "KESTREL_WARM_AGENT_DIR",
    "KESTREL_ADAPTER_BROKER_DIR",
    "KESTREL_WORKSPACE_QUOTA_MB",
    "KESTREL_CALL_WRITE_BUDGET_MB",
    "KESTREL_READ_MAX_FILE_BYTES",
    "KESTREL_WORKSPACE_INVENTORY_SECONDS",
)


def local_runner_environment() -> dict[str, str]:
    """Enroll the local runner if needed and return the environment its process gets."""
    folder = settings.KESTREL_DATA_DIR / "runner"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    key_file = folder / "runner.key"
    if not key_file.exists():
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as handle:
            handle.write(generate_private_key_pem())
    public = public_key_pem(key_file.read_bytes()).decode()
    runner = Runner.objects.filter(
        public_key=public,
        organization__isnull=True,
        revoked_at__isnull=True,
        pool=settings.KESTREL_DEFAULT_POOL,
    ).first()
    if runner is None:
        runner = runner_enroll(
            actor=system_principal("serve"),
            pool=settings.KESTREL_DEFAULT_POOL,
            public_key_pem=public,
            name="single-host runner",
        )
    broker = {"KESTREL_BROKER_URL": settings.CELERY_BROKER_URL}
    if broker_users_enabled():
        broker["KESTREL_BROKER_PASSWORD_FILE"] = str(_local_broker_password(runner, folder))
        # The embedded broker keeps no ACL file: every start recreates the runner users.
        runner_broker_users_reconcile()
    control_key = folder / "control.pub"
    control_key.write_text(control_public_key_pem())
    workspaces = settings.KESTREL_DATA_DIR / "workspaces"
    workspaces.mkdir(parents=True, exist_ok=True)
    tuning = {name: os.environ[name] for name in _BASE_ENV + _RUNNER_TUNING if name in os.environ}
    # A quota filesystem per workspace needs root (it is loop-mounted); a single host served
    # by its own user runs without one unless told otherwise (docs/runners.md).
    if os.geteuid() != 0:
        tuning.setdefault("KESTREL_WORKSPACE_QUOTA_MB", "0")
    # Warm sandboxes' host-side directories under the data folder too, unless set explicitly.
    tuning.setdefault(
        "KESTREL_WARM_AGENT_DIR", str(runtime_paths(settings.KESTREL_DATA_DIR).warm_agent_dir)
    )
    return {
        **tuning,
        "KESTREL_RUNNER_ID": runner.public_id,
        "KESTREL_RUNNER_POOL": runner.pool,
        "KESTREL_RUNNER_KEY_FILE": str(key_file),
        "KESTREL_CONTROL_PUBLIC_KEY_FILE": str(control_key),
        **broker,
        "KESTREL_WORKSPACE_ROOT": str(workspaces),
        "KESTREL_SANDBOX": os.environ.get("KESTREL_SANDBOX", "auto"),
        "KESTREL_MAX_CALL_SECONDS": str(settings.KESTREL_MAX_CALL_SECONDS),
        # The runner fits its reports into what this control plane records.
        "KESTREL_MAX_REPORT_BYTES": str(settings.KESTREL_MAX_REPORT_BYTES),
    }


def _local_broker_password(runner: Runner, folder) -> os.PathLike:
    """The local runner's broker password file (0600), issuing a new password when the file
    is missing or no longer matches the hash the database keeps."""
    path = folder / "broker.password"
    try:
        known = path.read_text().strip()
    except FileNotFoundError:
        known = ""
    if not known or hashlib.sha256(known.encode()).hexdigest() != runner.broker_password_sha256:
        password = getattr(runner, "broker_password", None) or runner_broker_user_issue(
            runner=runner
        )
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(f"{password}\n")
    return path


def control_worker_argv(
    *,
    concurrency: int = 2,
    beat_schedule: str | None = None,
    queues: tuple[str, ...] = (CONTROL_QUEUE,),
) -> list[str]:
    """The control worker's command line: queue ``control`` only, and the scheduler with it
    when a schedule file is given (one scheduler per deployment). With other ``queues`` it is
    the adapter worker (``adapters_worker_argv``) or the reports worker
    (``reports_worker_argv``)."""
    argv = [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "kestrel_one.celery",
        "worker",
        "-Q",
        ",".join(queues),
        "--concurrency",
        str(concurrency),
        "--without-gossip",
        "--without-mingle",
    ]
    if beat_schedule:
        argv += ["--beat", "--schedule", beat_schedule]
    return argv


def adapters_worker_argv(*, concurrency: int = 2) -> list[str]:
    """The control tier's adapter worker: queue ``adapters`` only (adapter.invoke,
    model.invoke). Its own process, so that a slow provider never holds up the control
    queue's reports and sweeps, and so that only it needs the credentials key."""
    return [
        *control_worker_argv(concurrency=concurrency, queues=(ADAPTERS_QUEUE,)),
        "-n",
        "adapters@%h",
    ]


def reports_worker_argv(*, concurrency: int = 2) -> list[str]:
    """The reports worker: queue ``reports`` only, where runners send their signed reports,
    heartbeats, inventories and adapter requests. Its own process, which runs those tasks
    and no other (kestrel_one.celery.RunnerTasksOnly): the one queue a runner host may
    write to starts nothing of the control plane's own."""
    return [
        *control_worker_argv(concurrency=concurrency, queues=(REPORT_QUEUE,)),
        "-n",
        "reports@%h",
    ]


def start_local_workers(stdout) -> list[subprocess.Popen]:
    """Start the control worker (with the scheduler), the reports worker, the adapter worker
    and the local runner, as children that end when ``serve`` ends, however it ends."""
    schedule = str(runtime_paths(settings.KESTREL_DATA_DIR).beat_schedule)
    slots = str(settings.KESTREL_LOCAL_CONCURRENCY)
    try:
        runner_env = local_runner_environment()
    except BrokerAclUnavailable as error:
        # Its broker user cannot be made (a REDIS_URL nobody answers, or one without ACLs):
        # calls that would execute are refused (503) meanwhile; restart serve once it can.
        runner_env = None
        stdout.write(f"Runner:  not started. {error.message}")
    control = subprocess.Popen(
        control_worker_argv(concurrency=settings.KESTREL_LOCAL_CONCURRENCY, beat_schedule=schedule),
        env=os.environ.copy(),
        preexec_fn=die_with_parent,  # serve starts no thread before its workers
    )
    reports = subprocess.Popen(
        reports_worker_argv(concurrency=settings.KESTREL_LOCAL_CONCURRENCY),
        env=os.environ.copy(),
        preexec_fn=die_with_parent,
    )
    adapters = subprocess.Popen(
        adapters_worker_argv(concurrency=settings.KESTREL_LOCAL_CONCURRENCY),
        env=os.environ.copy(),
        preexec_fn=die_with_parent,
    )
    if runner_env is None:
        return [control, reports, adapters]
    runner = subprocess.Popen(
        [sys.executable, "-m", "runners", "worker", "--concurrency", slots],
        env=runner_env,
        preexec_fn=die_with_parent,
    )
    stdout.write(
        "Control worker, reports worker, adapter worker and runner started "
        f"(pool {settings.KESTREL_DEFAULT_POOL})."
    )
    return [control, reports, adapters, runner]


def stop_local_workers(children: list[subprocess.Popen]) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
