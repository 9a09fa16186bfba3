"""Two organizations' dedicated runners on one real broker: each reads and runs only its own
organization's calls, and a revoked one is cut off the broker and runs nothing more.

Real processes throughout: a control worker and a reports worker, and runner workers started
as an operator starts them (``python -m runners worker``) with their enrollment's broker user
and password file. The broker is the suite's redis-server, whose ACLs hold each runner's user.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import kombu.exceptions
import pytest
import redis
from celery import Celery
from django.conf import settings
from django.db import connection

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.celery import app as control_app
from kestrel_one.execution.broker_users import runner_broker_url
from kestrel_one.execution.control import thread_end_announce
from kestrel_one.execution.enrollment import runner_enroll, runner_pool_route
from kestrel_one.execution.keys import control_private_key, control_public_key_pem
from kestrel_one.execution.models import Action, ActionState, Receipt, Runner
from kestrel_one.execution.services import action_request
from kestrel_one.governance.services import policy_publish_environment
from kestrel_one.tenancy.services import environment_create, project_create
from kestrel_one.threads.selectors import scope_of
from kestrel_one.threads.services import thread_create
from runners.contract.names import EXECUTE_TASK, HEARTBEAT_TASK, runner_queue
from runners.contract.tokens import (
    generate_private_key_pem,
    public_key_pem,
    sign_command,
    sign_heartbeat,
)
from tests.execution.workers import ROOT, control_worker, reports_worker
from tests.support import stop

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.spec("RUN-1", "RUN-7")]

POLICY = {"capabilities": {"fs.write": {"paths": ["**"]}, "fs.read": {"paths": ["**"]}}}
LIMITS = {"timeout_s": 10, "memory_mb": 64, "cpus": 1, "pids": 16, "output_kb": 16}


@dataclass
class DedicatedRunner:
    """One enrolled, running runner of an organization's own pool."""

    runner_id: str
    pool: str
    password: str
    workspaces: Path
    log: Path
    process: subprocess.Popen

    def client(self) -> redis.Redis:
        """A plain redis-py client with this runner's own broker credential."""
        return redis.Redis.from_url(
            settings.REDIS_URL, username=self.runner_id, password=self.password
        )

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def wait_for(condition: Callable[[], bool], *, what: str, detail: Callable[[], str]) -> None:
    for _ in range(600):  # bounded by attempts: 600 polls of 0.1 s
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"gave up waiting for {what}:\n{detail()[-4000:]}")


def start_runner(base: Path, *, organization, pool: str) -> DedicatedRunner:
    """Enroll a runner for ``organization`` in its own ``pool``, route the organization's
    calls there, and start it with exactly what enrollment handed out."""
    base.mkdir()
    key = base / "runner.key"
    key.write_bytes(generate_private_key_pem())
    key.chmod(0o600)
    control = base / "control.pub"
    control.write_text(control_public_key_pem())
    workspaces = base / "workspaces"
    workspaces.mkdir()
    system = system_principal("tests")
    runner = runner_enroll(
        actor=system,
        organization=organization,
        pool=pool,
        public_key_pem=public_key_pem(key.read_bytes()).decode(),
    )
    runner_pool_route(actor=system, organization=organization, pool=pool)
    password_file = base / "broker.password"
    password_file.write_text(runner.broker_password)
    password_file.chmod(0o600)
    log = base / "runner.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KESTREL_", "DJANGO_"))}
    process = subprocess.Popen(
        [sys.executable, "-m", "runners", "worker", "--concurrency", "1"],
        cwd=ROOT,
        env={
            **env,
            "KESTREL_RUNNER_ID": runner.public_id,
            "KESTREL_RUNNER_POOL": pool,
            "KESTREL_RUNNER_ORGANIZATION": organization.public_id,
            "KESTREL_RUNNER_KEY_FILE": str(key),
            "KESTREL_CONTROL_PUBLIC_KEY_FILE": str(control),
            # The broker's address without the control plane's credentials, plus its own.
            "KESTREL_BROKER_URL": runner_broker_url(),
            "KESTREL_BROKER_PASSWORD_FILE": str(password_file),
            "KESTREL_WORKSPACE_ROOT": str(workspaces),
            "KESTREL_SANDBOX": "bubblewrap",
            "KESTREL_MAX_CALL_SECONDS": "30",
        },
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    started = DedicatedRunner(
        runner.public_id, pool, runner.broker_password, workspaces, log, process
    )
    wait_for(
        lambda: " ready." in started.log_text(),
        what=f"runner {runner.public_id} to be ready",
        detail=started.log_text,
    )
    return started


@contextlib.contextmanager
def processes(base: Path) -> Iterator[list[subprocess.Popen]]:
    """The control and reports workers, plus every runner process the test appends."""
    database = connection.settings_dict
    running = [control_worker(base, database=database), reports_worker(base, database=database)]
    try:
        yield running
    finally:
        for process in running:
            stop(process)


def org_thread(organization, name: str):
    system = system_principal("tests")
    environment = environment_create(actor=system, organization=organization, name=name)
    policy_publish_environment(actor=system, environment=environment, document=POLICY)
    project = project_create(
        actor=system, organization=organization, environment=environment, name=name
    )
    return thread_create(actor=system, project=project, title=name, mode="agent")


def request(actor, thread, path: str, content: str) -> Action:
    action = action_request(
        actor=actor, thread=thread, tool="fs.write", args={"path": path, "content": content}
    )
    assert action.state == ActionState.QUEUED, action.decision
    return action


def finished(action: Action, *logs: Path) -> Action:
    def done() -> bool:
        action.refresh_from_db()
        return action.state in {ActionState.SUCCEEDED, ActionState.FAILED}

    wait_for(done, what=f"{action.public_id} to finish", detail=lambda: tail(*logs))
    return action


def tail(*logs: Path) -> str:
    return "".join(f"--- {log}\n{log.read_text(errors='replace')[-2500:]}" for log in logs)


def injected_command(*, pool: str, thread, org: str, path: str) -> tuple[str, str]:
    """A command the control plane's key signed for ``pool``, claiming organization ``org``:
    what a misrouting (or anyone with broker access) could put on the pool's queue."""
    call_id = f"act_{uuid.uuid4().hex}"
    token = sign_command(
        {
            "iss": "kestrel-control",
            "aud": runner_queue(pool),
            "jti": call_id,
            "org": org,
            "env": thread.project.environment.public_id,
            "prj": thread.project.public_id,
            "thr": thread.public_id,
            "tool": "fs.write",
            "args": {"path": path, "content": "not yours"},
            "policy_version": "env:pol_injected",
            "limits": LIMITS,
            "attempt": 1,
        },
        control_private_key(),
    )
    control_app.send_task(EXECUTE_TASK, args=[token], queue=runner_queue(pool))
    return call_id, token


def person(world, name: str) -> Principal:
    actor = world[name]
    return Principal(PrincipalKind.TOKEN, user=actor.user, token=actor.token)


def test_a_dedicated_runner_reads_and_runs_only_its_own_organizations_calls(world, tmp_path):
    admin = redis.Redis.from_url(settings.REDIS_URL)
    acme_thread = org_thread(world.org, "acme-iso")
    globex_thread = org_thread(world.other_org, "globex-iso")
    with processes(tmp_path) as running:
        acme = start_runner(tmp_path / "acme", organization=world.org, pool="acme-iso")
        running.append(acme.process)
        globex = start_runner(tmp_path / "globex", organization=world.other_org, pool="globex-iso")
        running.append(globex.process)
        logs = (acme.log, globex.log, tmp_path / "control.log", tmp_path / "reports.log")

        # Each organization's call goes to its own pool and is run by its own runner.
        mine = finished(request(person(world, "owner"), acme_thread, "a.txt", "acme"), *logs)
        assert mine.state == ActionState.SUCCEEDED, mine.error
        assert mine.pool == "acme-iso"
        assert Receipt.objects.get(action=mine).runner == acme.runner_id
        theirs = request(person(world, "outsider"), globex_thread, "g.txt", "globex")
        assert finished(theirs, *logs).state == ActionState.SUCCEEDED, theirs.error
        assert Receipt.objects.get(action=theirs).runner == globex.runner_id
        assert (acme.workspaces / acme_thread.project.public_id / "a.txt").exists()
        assert not (globex.workspaces / acme_thread.project.public_id).exists()

        # Globex's runner, with its own credential, can read none of acme's pool: not its
        # queue, not its messages in flight, not its call results, not anyone's reports.
        result_key = f"kestrel:pool:acme-iso:result:{mine.public_id}"
        assert admin.exists(result_key)  # the key is there; only the credential stops it
        spy = globex.client()
        for attempt in (
            lambda: spy.llen(runner_queue("acme-iso")),
            lambda: spy.brpop([runner_queue("acme-iso")], timeout=1),
            lambda: spy.lpush(runner_queue("acme-iso"), "x"),
            lambda: spy.get(result_key),
            lambda: spy.hgetall("kestrel:pool:acme-iso:unacked"),
            lambda: spy.hgetall("unacked"),
            lambda: spy.lrange("reports", 0, -1),
            lambda: spy.sadd("_kombu.binding.reports", "reports\x06\x16\x06\x16runner.globex-iso"),
            lambda: spy.lpush("control", "x"),
            lambda: spy.keys("*"),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                attempt()
        spy.close()

        # A command bound to acme that reaches globex's pool anyway is refused by globex's
        # runner: not claimed, not run. The same command bound to globex runs.
        refused_id, _ = injected_command(
            pool="globex-iso", thread=acme_thread, org=world.org.public_id, path="stolen.txt"
        )
        ran_id, _ = injected_command(
            pool="globex-iso", thread=acme_thread, org=world.other_org.public_id, path="ok.txt"
        )
        wait_for(
            lambda: (
                f'"call_id": "{ran_id}"' in globex.log_text()
                and "call_finished" in globex.log_text().split(ran_id, 1)[-1]
            ),
            what="globex's runner to run the command bound to globex",
            detail=globex.log_text,
        )
        log = globex.log_text()
        refusal = next(line for line in log.splitlines() if refused_id in line)
        assert '"code": "wrong_organization"' in refusal and "command_refused" in refusal
        workspace = globex.workspaces / acme_thread.project.public_id
        assert (workspace / "ok.txt").exists()
        assert not (workspace / "stolen.txt").exists()
        assert not admin.exists(f"kestrel:pool:globex-iso:call:{refused_id}")
        assert admin.exists(f"kestrel:pool:globex-iso:call:{ran_id}")

        # Its pool's control messages still reach it, on the one channel it may subscribe to.
        scope = scope_of(
            organization=world.other_org,
            environment=globex_thread.project.environment,
            project=globex_thread.project,
            thread=globex_thread,
        )
        assert thread_end_announce(scope=scope, pools=["globex-iso"]) == 1
        wait_for(
            lambda: f'"thread": "{globex_thread.public_id}"' in globex.log_text(),
            what="globex's runner to act on the thread's end",
            detail=globex.log_text,
        )
        assert '"event": "thread_ended"' in globex.log_text()
        assert "thread_ended" not in acme.log_text()


def test_a_revoked_runner_is_cut_off_the_broker_and_runs_nothing_more(world, tmp_path):
    admin = redis.Redis.from_url(settings.REDIS_URL)
    thread = org_thread(world.other_org, "globex-revoked")
    with processes(tmp_path) as running:
        runner = start_runner(tmp_path / "globex", organization=world.other_org, pool="globex-rv")
        running.append(runner.process)
        logs = (runner.log, tmp_path / "control.log", tmp_path / "reports.log")
        before = finished(request(person(world, "outsider"), thread, "before.txt", "1"), *logs)
        assert before.state == ActionState.SUCCEEDED, before.error

        def connections() -> list[dict]:
            return [c for c in admin.client_list() if c.get("user") == runner.runner_id]

        assert connections()  # it is connected, as itself
        response = (
            world["outsider"].client().delete(f"/api/v1/orgs/globex/runners/{runner.runner_id}")
        )
        assert response.status_code == 200 and response.json()["revoked_at"]

        # Its user is gone and every connection it had was ended; it cannot log in again.
        assert admin.execute_command("ACL", "GETUSER", runner.runner_id) is None
        assert connections() == []
        with pytest.raises(redis.exceptions.AuthenticationError):
            runner.client().ping()

        # A call sent to its pool now stays on the queue: the runner keeps trying to get back
        # on the broker and is refused each time.
        queue = runner_queue("globex-rv")
        after = request(person(world, "outsider"), thread, "after.txt", "2")
        refused_before = runner.log_text().count("invalid username-password pair")
        wait_for(
            lambda: (
                runner.process.poll() is not None
                or runner.log_text().count("invalid username-password pair") >= refused_before + 2
            ),
            what="the revoked runner to try the broker again",
            detail=runner.log_text,
        )
        assert admin.llen(queue) == 1
        after.refresh_from_db()
        assert after.state == ActionState.QUEUED
        assert not (runner.workspaces / thread.project.public_id / "after.txt").exists()
        assert connections() == []
        admin.delete(queue)


def test_a_runner_host_cannot_start_the_control_planes_own_tasks(world, tmp_path):
    """The control plane's own tasks (sweeps, webhook deliveries, adapter calls) are unsigned:
    they trust their message. A runner host, whose broker credential may send messages, used
    to be able to append to their queue ``control`` and have the control worker run whichever
    it named. Now a runner may append to ``reports`` only, and that queue's worker runs the
    runners' signed tasks and nothing else.

    The effect watched: ``control.sweep`` recreates an active runner's broker user that the
    broker lost. A runner host sends it every way it could (on ``control``; on ``reports``;
    as the link or error link of a runner's own task there), then a signed heartbeat after it
    on the same queue; once the heartbeat is recorded the forged sweep has been taken, and the
    lost user is still gone. The control plane's own sweep then brings it back, so the effect
    was there to be seen."""
    admin = redis.Redis.from_url(settings.REDIS_URL)
    system = system_principal("tests")
    victim = runner_enroll(
        actor=system,
        pool="lost-user",
        public_key_pem=public_key_pem(generate_private_key_pem()).decode(),
    )
    key = generate_private_key_pem()
    host = runner_enroll(actor=system, pool="forger", public_key_pem=public_key_pem(key).decode())
    credential = urlsplit(runner_broker_url())
    host_url = urlunsplit(
        credential._replace(netloc=f"{host.public_id}:{host.broker_password}@{credential.netloc}")
    )
    host_app = Celery("forger", broker=host_url, set_as_current=False)
    with processes(tmp_path):
        logs = (tmp_path / "control.log", tmp_path / "reports.log")
        admin.execute_command("ACL", "DELUSER", victim.public_id)  # the broker lost it

        # The control plane's queue is not the host's to write, by hand or through Celery.
        own = redis.Redis.from_url(host_url)
        with pytest.raises(redis.exceptions.NoPermissionError):
            own.lpush("control", "{}")
        with pytest.raises(kombu.exceptions.OperationalError, match="no permissions"):
            host_app.send_task("control.sweep", queue="control", declare=[], retry=False)
        # The reports queue is, but its worker does not run what the message names there:
        # neither another task, nor one a runner's own task names to run after it.
        host_app.send_task("control.sweep", queue="reports", declare=[], retry=False)
        sweep = host_app.signature("control.sweep", immutable=True, queue="control")
        for follow_up in ({"link": sweep}, {"link_error": sweep}):
            host_app.send_task(
                HEARTBEAT_TASK, args=["not.a.token"], queue="reports", declare=[], **follow_up
            )
        heartbeat = sign_heartbeat(
            pool=host.pool, sandbox="docker", private_key_pem=key, runner_id=host.public_id
        )
        host_app.send_task(HEARTBEAT_TASK, args=[heartbeat], queue="reports", declare=[])

        def seen() -> bool:
            return Runner.objects.get(pk=host.pk).last_seen_at is not None

        wait_for(seen, what="the host's heartbeat", detail=lambda: _tails(logs))
        assert admin.execute_command("ACL", "GETUSER", victim.public_id) is None
        reports = logs[1].read_text()
        assert "Received unregistered task of type 'control.sweep'" in reports
        assert reports.count("runner message refused: it names tasks to run after it") == 2

        control_app.send_task("control.sweep")  # the control plane's own: routed to control
        wait_for(
            lambda: admin.execute_command("ACL", "GETUSER", victim.public_id) is not None,
            what="the control plane's sweep to recreate the lost user",
            detail=lambda: _tails(logs),
        )
    own.close()
    host_app.close()


def _tails(paths) -> str:
    return "".join(p.read_text(errors="replace")[-3000:] for p in paths if p.exists())
