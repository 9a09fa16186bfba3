"""Secrets in a call's arguments and in its output appear on no surface and in no store.

Through the real runner (a Celery worker process, Docker) and a real control worker: a shell
call whose environment overlay and output carry secrets, one that a person approves first
(its command is signed later, from the sealed arguments), and one whose output is large
enough to be kept as an artifact. Then every projection (action and receipt as owner and
viewer, events, replay, plans, audit, webhook bodies, artifacts, a shared thread), every
database row and every Redis key must be free of each secret, in clear or encoded.
"""

from __future__ import annotations

import time

import pytest
import redis
from django.conf import settings
from django.db import connection

from kestrel_one.accounts.principal import system_principal
from kestrel_one.common.redaction import fingerprint
from kestrel_one.execution.models import Action, ActionState
from kestrel_one.governance.services import policy_publish_environment
from kestrel_one.tenancy.services import environment_create, project_create
from kestrel_one.threads.services import thread_create
from kestrel_one.webhooks.services import webhook_endpoint_create
from tests.execution.workers import governed_thread, real_workers
from tests.secret_search import SecretSearch, redis_values

RUNNER_ID = "run_SECRETSE2ERUNNER00000000"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.docker]

GITHUB_TOKEN = "ghp_" + "R4nd0mGitHubT0kenF0rTest5" + "AbCdEfGhIjK"
API_KEY = "plainvalue-4217-no-shape"  # no recognisable shape: only write-only-ness hides it
DB_PASSWORD = "hunter2-correct-horse"
PRINTED_KEY = "Zx81QwErTy00LkJhGfDsA"  # printed by the tool as API_KEY=...
PRINTED_PASSWORD = "tr0ub4dor-and-3"  # printed as password=...
SECRETS = (GITHUB_TOKEN, API_KEY, DB_PASSWORD, PRINTED_KEY, PRINTED_PASSWORD)
_search = SecretSearch(SECRETS)
_assert_no_secret = _search.check

POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["**"]},
        "shell.exec": {
            "env": ["API_KEY", "DB_PASSWORD", "GITHUB_TOKEN"],
            "limits": {"timeout_s": 30, "memory_mb": 256, "pids": 64},
        },
    }
}
APPROVAL_POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["**"]},
        "shell.exec": {
            "approval": "always",
            "env": ["API_KEY", "DB_PASSWORD", "GITHUB_TOKEN"],
            "limits": {"timeout_s": 30},
        },
    }
}
ENV = {"GITHUB_TOKEN": GITHUB_TOKEN, "API_KEY": API_KEY, "DB_PASSWORD": DB_PASSWORD}
SCRIPT = (
    'echo "token $GITHUB_TOKEN"; echo "$API_KEY"; echo "db $DB_PASSWORD" >&2; '
    f"echo API_KEY={PRINTED_KEY}; echo password={PRINTED_PASSWORD}; "
    f"printf 'API_KEY={PRINTED_KEY}\\n' > out.env"
)


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory, docker_backend):
    with django_db_blocker.unblock():
        database = connection.settings_dict
    # The test reads every key: start from an empty broker and call state, not from what an
    # earlier run (or an older runner) left.
    redis.Redis.from_url(settings.CELERY_BROKER_URL).flushdb()
    with real_workers(
        tmp_path_factory.mktemp("runner"), runner_id=RUNNER_ID, database=database
    ) as files:
        yield files


def _thread(organization, *, policy: dict, name: str):
    """One more agent thread, under its own environment's ``policy``, for the same runner."""
    system = system_principal("tests")
    environment = environment_create(actor=system, organization=organization, name=name)
    policy_publish_environment(actor=system, environment=environment, document=policy)
    project = project_create(
        actor=system, organization=organization, environment=environment, name=name
    )
    return thread_create(actor=system, project=project, title=name, mode="agent")


def _base(thread) -> str:
    return (
        f"/api/v1/orgs/{thread.organization.slug}/projects/{thread.project.public_id}"
        f"/threads/{thread.public_id}"
    )


def _post_action(client, thread, args: dict, key: str) -> dict:
    response = client.post(
        f"{_base(thread)}/actions",
        {"tool": "shell.exec", "args": args},
        format="json",
        HTTP_IDEMPOTENCY_KEY=key,
    )
    assert response.status_code == 201, response.content
    return response.json()


def _finished(client, thread, action_id: str, logs) -> dict:
    for _ in range(600):  # bounded by attempts: 600 polls of 0.2 s
        body = client.get(f"{_base(thread)}/actions/{action_id}").json()
        if body["state"] in {ActionState.SUCCEEDED, ActionState.FAILED}:
            return body
        time.sleep(0.2)
    tail = "".join(
        (logs / name).read_text()[-3000:] for name in ("runner.log", "control.log", "reports.log")
    )
    raise AssertionError(f"{action_id} never finished; worker logs:\n{tail}")


@pytest.mark.spec("CRED-1", "AUD-2")
def test_secrets_in_arguments_and_output_appear_in_no_projection_row_or_redis_key(workers, world):
    thread = governed_thread(workers, world.org, runner_id=RUNNER_ID, policy=POLICY, name="sec")
    waiting = _thread(world.org, policy=APPROVAL_POLICY, name="sec-approve")
    webhook_endpoint_create(
        actor=system_principal("tests"),
        organization=world.org,
        url="https://hooks.example.com/kestrel",
        event_types=["action.succeeded", "action.awaiting_approval", "action.approved"],
    )
    member, owner, viewer = world["member"], world["owner"], world["viewer"]
    args = {"script": SCRIPT, "env": ENV, "outputs": ["out.env"]}

    posted = _post_action(member.client(), thread, args, key="secrets-1")
    _assert_no_secret("the action's creation response", posted)
    # Output past the inline cap is kept as an artifact: redacted by the same path.
    big = {"script": SCRIPT + "; head -c 20000 /dev/zero | tr '\\0' x", "env": ENV}
    large = _post_action(member.client(), thread, big, key="secrets-2")
    # Approved by a person: its command is signed after the request, from sealed arguments.
    pending = _post_action(member.client(), waiting, args, key="secrets-3")
    assert pending["state"] == "awaiting_approval"
    _assert_no_secret("an action awaiting approval", pending)
    approved = owner.client().post(
        f"{_base(waiting)}/actions/{pending['id']}/approve", {}, format="json"
    )
    assert approved.status_code == 200, approved.content

    finished = [
        (thread, _finished(member.client(), thread, posted["id"], workers["logs"])),
        (thread, _finished(member.client(), thread, large["id"], workers["logs"])),
        (waiting, _finished(member.client(), waiting, pending["id"], workers["logs"])),
    ]
    for _, body in finished:
        assert body["state"] == "succeeded", body
        # The call really ran with the real values: the sandbox printed them (masked here).
        assert body["result"]["exit_code"] == 0
        assert body["result"]["stdout"].count("[redacted]") >= 3, body["result"]
        # The overlay is write-only: its names and a fingerprint of each value, no value.
        assert body["args"]["env"] == {name: fingerprint(value) for name, value in ENV.items()}
    large_action = Action.objects.get(public_id=large["id"])
    assert large_action.artifacts.filter(kind="stdout").exists()

    surfaces: dict[str, object] = {}
    for thread_of, body in finished:
        base = _base(thread_of)
        for actor in (owner, viewer):
            client = actor.client()
            for tail in ("", "/receipt"):
                response = client.get(f"{base}/actions/{body['id']}{tail}")
                assert response.status_code == 200, response.content
                surfaces[f"{actor.name} GET action{tail} {body['id']}"] = response.json()
    for thread_of in (thread, waiting):
        client = owner.client()
        base = _base(thread_of)
        surfaces[f"events {thread_of.title}"] = client.get(f"{base}/events").json()
        surfaces[f"replay {thread_of.title}"] = client.get(f"{base}/replay").json()
        surfaces[f"action list {thread_of.title}"] = client.get(f"{base}/actions").json()
        link = client.post(f"{base}/share", {"expires_in": 3600}, format="json").json()
        surfaces[f"shared thread {thread_of.title}"] = client.get(link["url"]).json()
    surfaces["audit"] = owner.client().get("/api/v1/orgs/acme/audit").json()
    artifacts = owner.client().get("/api/v1/orgs/acme/artifacts").json()["results"]
    assert {a["kind"] for a in artifacts} >= {"stdout", "file"}
    for artifact in artifacts:
        content = owner.client().get(f"/api/v1/orgs/acme/artifacts/{artifact['id']}/content")
        surfaces[f"artifact {artifact['name']}"] = b"".join(content.streaming_content).decode()
    with connection.cursor() as cursor:
        cursor.execute("SELECT body FROM webhooks_webhookmessage")
        bodies = [row[0] for row in cursor.fetchall()]
    assert bodies, "the endpoint got no webhook message"
    surfaces["webhook bodies"] = bodies
    for where, shown in surfaces.items():
        _assert_no_secret(where, shown)

    # Every row of every table, read raw.
    assert _search.check_tables() > 20

    # The runner's call state and the broker (one Redis here): no key holds a secret.
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    keys = set()
    for key, values in redis_values(client):
        keys.add(key)
        for value in values:
            _assert_no_secret(f"redis key {key}", value)
    # The runner kept each call's state (under its pool's namespace), minus its report's content.
    for _, body in finished:
        assert any(key.endswith(f":result:{body['id']}") for key in keys), body["id"]
