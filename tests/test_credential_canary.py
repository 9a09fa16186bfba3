"""The credential canary (CRED-6, CRED-1): planted credentials are nowhere but where they
are sealed.

Real processes: a Docker runner worker, a control worker and the control tier's adapter
worker, and the test upstream (HTTPS with its own CA). Canary secrets are planted as org
credentials for every adapter and as a person's App connection, and rotated once. Then every
path that presents one runs: adapter reads with a credential and with a connection, an
external operation a person approves, a model call as a tool and through the
OpenAI-compatible endpoint (whole and streamed), an upstream error that echoes the
credential back, and a workload's call through the broker from inside the sandbox. Every
response, every webhook body, every table row, every Redis key, every log line (the
workers' and this process's) and ``docker inspect`` of every container must then be free
of each secret, in plain, base64, URL-encoded and hex form.
"""

from __future__ import annotations

import json
import logging
import time
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.db import connection

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.credentials.models import Credential
from kestrel_one.credentials.services import connection_create, credential_create
from kestrel_one.execution.models import Action
from kestrel_one.webhooks.events import EVENT_TYPES
from kestrel_one.webhooks.services import webhook_endpoint_create
from tests.console.surface import signed_in
from tests.execution.workers import governed_thread, real_workers_and_adapters
from tests.secret_search import SecretSearch
from tests.upstream import random_secret

RUNNER_ID = "run_CREDENTIALCANARY000000000"
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.docker]

MODELS = ["openai/gpt-4o-mini", "openai/kestrel-echo-credential", "anthropic/claude-3-5-haiku"]
POLICY = {
    "capabilities": {
        "shell.exec": {"limits": {"timeout_s": 60, "memory_mb": 256, "pids": 64}},
        "adapter.invoke": {
            "adapters": {
                "github": {"operations": ["issues.list", "issue_comment.create"]},
                "slack": {"operations": ["chat.postMessage"]},
            },
        },
        "model.invoke": {"models": MODELS},
    }
}
ISSUES = {"owner": "acme", "repo": "rocket"}
FINISHED = ("succeeded", "failed", "denied", "expired", "cancelled")


@pytest.fixture(scope="module")
def workers(django_db_setup, django_db_blocker, tmp_path_factory, docker_backend, upstream_server):
    with django_db_blocker.unblock():
        database = connection.settings_dict
    base = tmp_path_factory.mktemp("canary")
    with real_workers_and_adapters(
        base, runner_id=RUNNER_ID, database=database, upstream_env=upstream_server.env()
    ) as files:
        yield files


class Surfaces:
    """Every response the test received, to be searched at the end."""

    def __init__(self, logs):
        self.seen: dict[str, object] = {}
        self.logs = logs

    def keep(self, where: str, response) -> dict:
        if getattr(response, "streaming", False):
            body = b"".join(response.streaming_content).decode("utf-8", "replace")
        else:
            body = response.content.decode("utf-8", "replace")
        self.seen[f"{where} (HTTP {response.status_code})"] = {
            "headers": dict(response.items()),
            "body": body,
        }
        return json.loads(body) if body.startswith(("{", "[")) else {"text": body}

    def finished(self, client, base: str, action_id: str) -> dict:
        for _ in range(600):  # bounded: polls of 0.2 s
            body = client.get(f"{base}/actions/{action_id}").json()
            if body["state"] in FINISHED:
                return self.keep(
                    f"GET action {action_id}", client.get(f"{base}/actions/{action_id}")
                )
            time.sleep(0.2)
        names = ("runner.log", "control.log", "reports.log", "adapters.log")
        tail = "".join((self.logs / name).read_text()[-3000:] for name in names)
        raise AssertionError(f"{action_id} never finished; logs:\n{tail}")


@pytest.mark.spec("CRED-6", "CRED-1", "CRED-3")
def test_planted_credentials_appear_in_no_response_row_key_log_or_container(
    workers, world, upstream, caplog
):
    caplog.set_level(logging.DEBUG)
    system = system_principal("tests")
    owner = world["owner"]
    thread = governed_thread(workers, world.org, runner_id=RUNNER_ID, policy=POLICY, name="cnr")
    org_base = f"/api/v1/orgs/{world.org.slug}"
    base = f"{org_base}/projects/{thread.project.public_id}/threads/{thread.public_id}"
    client = owner.client()
    surfaces = Surfaces(workers["logs"])

    # Planted: an org credential per adapter (GitHub's rotated once: both values are canaries)
    # and the owner's own GitHub connection. The upstream accepts exactly these.
    secrets = {
        adapter: random_secret(f"canary-{adapter}")
        for adapter in ("github", "slack", "openai", "anthropic")
    }
    rotated = random_secret("canary-rotated")
    personal = random_secret("canary-connection")
    credentials = {
        adapter: credential_create(
            actor=system, organization=world.org, name=adapter, adapter=adapter, secret=secret
        )
        for adapter, secret in secrets.items()
    }
    rotate = client.post(
        f"{org_base}/credentials/{credentials['github'].public_id}/rotate",
        {"secret": rotated},
        format="json",
    )
    surfaces.keep("POST rotate", rotate)
    assert rotate.status_code == 200, rotate.content
    own = connection_create(
        actor=Principal(PrincipalKind.SESSION, user=owner.user),
        organization=world.org,
        adapter="github",
        secret=personal,
    )
    upstream.expect("github", rotated, personal)
    for adapter in ("slack", "openai", "anthropic"):
        upstream.expect(adapter, secrets[adapter])
    search = SecretSearch([*secrets.values(), rotated, personal])
    # Every event a consumer can subscribe to is queued for it (the outbox is searched too).
    webhook_endpoint_create(
        actor=system,
        organization=world.org,
        url="https://hooks.example.com/kestrel",
        event_types=sorted(EVENT_TYPES),
    )

    def act(tool: str, args: dict, key: str) -> dict:
        response = client.post(
            f"{base}/actions",
            {"tool": tool, "args": args},
            format="json",
            HTTP_IDEMPOTENCY_KEY=key,
        )
        assert response.status_code == 201, response.content
        return surfaces.keep(f"POST {tool} {key}", response)

    github = credentials["github"].public_id
    read = act(
        "adapter.invoke",
        {"adapter": "github", "operation": "issues.list", "args": ISSUES, "credential": github},
        "read-credential",
    )
    mine = act(
        "adapter.invoke",
        {
            "adapter": "github",
            "operation": "issues.list",
            "args": ISSUES,
            "connection": own.public_id,
        },
        "read-connection",
    )
    post = act(
        "adapter.invoke",
        {
            "adapter": "slack",
            "operation": "chat.postMessage",
            "args": {"channel": "C0CANARY", "text": "Deployed."},
            "credential": credentials["slack"].public_id,
            "idempotency_key": "canary-post-1",
        },
        "post",
    )
    assert post["state"] == "awaiting_approval", post
    approved = (
        world["admin"].client().post(f"{base}/actions/{post['id']}/approve", {}, format="json")
    )
    surfaces.keep("POST approve", approved)
    assert approved.status_code == 200, approved.content
    messages = [{"role": "user", "content": "Say hello."}]
    model = act(
        "model.invoke",
        {"provider": "openai", "model": "gpt-4o-mini", "messages": messages, "max_tokens": 32},
        "model",
    )
    echoed = act(
        "model.invoke",
        {
            "provider": "openai",
            "model": "kestrel-echo-credential",
            "messages": messages,
            "max_tokens": 32,
        },
        "model-echo",
    )
    brokered = act(
        "shell.exec",
        {
            "script": "kestrel-adapter github issues.list "
            f"'{json.dumps(ISSUES)}' --credential {github}; env; cat /proc/self/environ",
            "timeout_s": 60,
        },
        "broker",
    )

    ends = {
        name: surfaces.finished(client, base, body["id"])
        for name, body in {
            "read": read,
            "mine": mine,
            "post": post,
            "model": model,
            "echoed": echoed,
            "brokered": brokered,
        }.items()
    }
    for name in ("read", "mine", "post", "model", "brokered"):
        assert ends[name]["state"] == "succeeded", ends[name]
    assert ends["echoed"]["state"] == "failed", ends["echoed"]
    # The credentials really were presented: the upstream got each one (and counted them).
    presented = {
        value
        for request in upstream.requests()
        for name, value in request["headers"].items()
        if name in ("authorization", "x-api-key")
    }
    assert {
        f"Bearer {rotated}",
        f"Bearer {personal}",
        f"Bearer {secrets['slack']}",
        f"Bearer {secrets['openai']}",
    } <= presented, presented
    # The workload got the adapter's answer through the broker, with no credential in it.
    assert '"status": 200' in ends["brokered"]["result"]["stdout"], ends["brokered"]["result"]

    # The model gateway's endpoint, whole and streamed (Anthropic's answer translated).
    gateway = f"{org_base}/projects/{thread.project.public_id}/model/v1/chat/completions"
    for stream in (False, True):
        answer = client.post(
            gateway,
            {
                "model": "anthropic/claude-3-5-haiku",
                "messages": messages,
                "max_tokens": 32,
                "stream": stream,
            },
            format="json",
        )
        assert answer.status_code == 200, answer.content if not stream else answer
        surfaces.keep(f"POST chat completions stream={stream}", answer)

    # Every projection a person or an integration reads.
    for action in ends.values():
        for tail in ("", "/receipt"):
            surfaces.keep(f"GET {tail}", client.get(f"{base}/actions/{action['id']}{tail}"))
    for path in (f"{base}/events", f"{base}/replay", f"{base}/actions"):
        surfaces.keep(f"GET {path}", client.get(path))
    for path in (
        "/credentials",
        f"/credentials/{github}",
        "/connections",
        f"/connections/{own.public_id}",
        "/audit",
        "/artifacts",
    ):
        surfaces.keep(f"GET {path}", client.get(f"{org_base}{path}"))
    surfaces.keep("GET /api/v1/adapters", client.get("/api/v1/adapters"))
    console = signed_in(owner.user)
    project = f"projects/{thread.project.public_id}"
    for page in (
        "credentials",
        "connections",
        "adapters",
        "usage",
        f"{project}/usage",
        f"{project}/threads/{thread.public_id}",
    ):
        response = console.get(f"/console/{world.org.slug}/{page}")
        assert response.status_code == 200, (page, response.status_code)
        surfaces.keep(f"console {page}", response)
    with connection.cursor() as cursor:
        cursor.execute("SELECT body FROM webhooks_webhookmessage")
        bodies = [row[0] for row in cursor.fetchall()]
    assert len(bodies) >= 6, "the consumer got no webhook message"
    surfaces.seen["webhook bodies"] = bodies
    for where, shown in surfaces.seen.items():
        search.check(where, shown)

    # Stores and logs: every row, every key of the Redis the workers share, every log line.
    assert search.check_tables() > 30
    redis_url = urlsplit(settings.CELERY_BROKER_URL)
    for db in range(16):
        search.check_redis(redis_url._replace(path=f"/{db}").geturl())
    assert search.check_files(workers["logs"].glob("*.log")) >= 3
    search.check("this process's log records", [r.getMessage() for r in caplog.records])
    search.check_containers()
    # The sealed rows are where the secrets are: each still opens to its canary.
    assert Credential.objects.filter(organization=world.org, revoked_at__isnull=True).count() == 4
    assert Action.objects.filter(thread=thread).count() >= 6
