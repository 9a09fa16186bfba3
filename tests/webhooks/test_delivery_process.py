"""Webhooks through real processes: a Celery control worker (with its beat sweep) delivers to
a consumer process on loopback that verifies every request with ``standardwebhooks``.

The worker uses its own Redis database, so it never takes another suite's control tasks, and
the test process's Celery app is pointed at the same one for the module. Retry delays, lease
and sweep period are tiny here; the waits are bounded by attempts, never asserted on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import redis
from django.conf import settings
from django.db import connection, transaction

from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.execution.services import action_request
from kestrel_one.governance.services import policy_publish_environment
from kestrel_one.threads.services import thread_create
from kestrel_one.webhooks.events import EVENT_TYPES
from kestrel_one.webhooks.models import DeliveryState, WebhookDelivery, WebhookEndpoint
from kestrel_one.webhooks.services import (
    webhook_emit,
    webhook_endpoint_create,
    webhook_secret_rotate,
)
from tests.webhooks.conftest import Consumer, free_port

ROOT = Path(__file__).resolve().parents[2]
WORKER_REDIS_URL = os.environ.get("TEST_WEBHOOK_REDIS_URL", "redis://127.0.0.1:6379/11")
SYSTEM = system_principal("tests")
CANARY = "ghp_" + "W3bh00kC4n4ryT0k3nTh4tMustN3v3rL34k"
PLAIN_CANARY = "canary-b61e0f-plain-text-never-in-a-webhook"

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("webhook_settings")]


def wait_for(predicate, what: str, *, logs: Path | None = None, attempts: int = 300):
    """Poll every 0.2 s, at most ``attempts`` times (a bound, not a timing assertion)."""
    for _ in range(attempts):
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    tail = logs.read_text()[-4000:] if logs and logs.exists() else ""
    raise AssertionError(f"gave up waiting for {what}\n{tail}")


def _stop(process: subprocess.Popen, sig=signal.SIGTERM) -> None:
    if process.poll() is not None:
        return
    os.killpg(process.pid, sig)  # its own session: the worker and its embedded beat
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@pytest.fixture(scope="module")
def module_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("webhook-e2e")


@pytest.fixture(scope="module")
def worker_broker():
    """Point this process's Celery app at the worker's Redis database for the module."""
    from kestrel_one.celery import app

    client = redis.Redis.from_url(WORKER_REDIS_URL)
    client.delete("control", "unacked", "unacked_index")

    def point(url: str) -> None:
        app.conf.broker_url = url
        app._pool = None
        if "amqp" in app.__dict__:
            app.__dict__["amqp"]._producer_pool = None

    saved = app.conf.broker_url
    point(WORKER_REDIS_URL)
    yield WORKER_REDIS_URL
    point(saved)


class ConsumerProcess(Consumer):
    def __init__(self, base: Path, tls: dict[str, Path]):
        super().__init__(free_port(), base / "secrets.json", base / "received.jsonl")
        self.tls = tls
        self.base = base
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.webhooks.consumer",
                "--port",
                str(self.port),
                "--cert",
                str(self.tls["cert"]),
                "--key",
                str(self.tls["key"]),
                "--secrets",
                str(self.secrets_file),
                "--log",
                str(self.log_file),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=open(self.base / "consumer.err", "a"),
            start_new_session=True,
        )
        assert self.process.stdout.readline().strip() == b"listening"

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)
            self.process = None


class Worker:
    def __init__(self, base: Path, env: dict[str, str]):
        self.base = base
        self.env = env
        self.log = base / "worker.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "kestrel_one.celery",
                "worker",
                "-Q",
                "control",
                "--pool",
                "solo",
                "--without-gossip",
                "--without-mingle",
                "--beat",
                "--schedule",
                str(self.base / "beat-schedule"),
                "--loglevel",
                "INFO",
            ],
            cwd=ROOT,
            env=self.env,
            stdout=open(self.log, "a"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill(self) -> None:
        """SIGKILL, as a crashed host would: no clean shutdown, no ack."""
        if self.process is not None:
            _stop(self.process, signal.SIGKILL)
            self.process = None

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)
            self.process = None


@pytest.fixture(scope="module")
def consumer(module_dir, tls_identity):
    process = ConsumerProcess(module_dir, tls_identity)
    process.start()
    yield process
    process.stop()


@pytest.fixture(scope="module")
def worker(django_db_setup, django_db_blocker, module_dir, tls_identity, worker_broker):
    with django_db_blocker.unblock():
        database = connection.settings_dict
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("KESTREL_", "DJANGO_"))}
    env = {
        **base_env,
        "DJANGO_SETTINGS_MODULE": "kestrel_one.settings_test",
        "TEST_DATABASE_URL": (
            f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/{database['NAME']}"
        ),
        "TEST_REDIS_URL": worker_broker,
        "KESTREL_DATA_DIR": str(settings.KESTREL_DATA_DIR),
        # Tests only: the consumer listens on loopback, with its own CA.
        "KESTREL_WEBHOOK_ALLOW_ADDRESSES": "127.0.0.1/32",
        "KESTREL_EGRESS_OVERRIDES_IN_HOSTED": "1",
        "KESTREL_WEBHOOK_CA_BUNDLE": str(tls_identity["cert"]),
        "KESTREL_WEBHOOK_RETRY_DELAYS": ",".join(["0.2", "0.5"] + ["1"] * 18),
        "KESTREL_WEBHOOK_TIMEOUT_SECONDS": "20",
        "KESTREL_WEBHOOK_LEASE_SECONDS": "4",
        "KESTREL_WEBHOOK_SWEEP_SECONDS": "1",
    }
    process = Worker(module_dir, env)
    process.start()
    yield process
    process.stop()


def endpoint(world, consumer: Consumer, path: str, *event_types: str):
    created, secret = webhook_endpoint_create(
        actor=SYSTEM,
        organization=world.org,
        url=consumer.url(path),
        event_types=list(event_types or EVENT_TYPES),
    )
    consumer.trust(path, secret)
    return created, secret


def emit_many(world, count: int) -> list[str]:
    ids = []
    for number in range(count):
        with transaction.atomic():
            message = webhook_emit(
                organization=world.org, event_type="policy.published", payload={"n": number}
            )
        ids.append(message.public_id)
    return ids


def all_delivered(endpoint_row) -> bool:
    states = set(
        WebhookDelivery.objects.filter(endpoint=endpoint_row).values_list("state", flat=True)
    )
    return states == {DeliveryState.DELIVERED}


def by_id(records: list[dict], path: str) -> dict[str, list[dict]]:
    grouped = defaultdict(list)
    for record in records:
        if record["path"] == path:
            grouped[record["id"]].append(record)
    return grouped


@pytest.mark.spec("API-5")
def test_a_real_consumer_verifies_every_delivery_across_a_secret_rotation(world, worker, consumer):
    hook, old_secret = endpoint(world, consumer, "/ok/main", "policy.published")
    before = emit_many(world, 4)
    wait_for(lambda: all_delivered(hook), "the first deliveries", logs=worker.log)

    hook, new_secret = webhook_secret_rotate(actor=SYSTEM, endpoint=hook, overlap_seconds=3600)
    consumer.trust("/ok/main", new_secret, old_secret)
    after = emit_many(world, 4)
    wait_for(lambda: all_delivered(hook), "the deliveries after rotation", logs=worker.log)

    received = by_id(consumer.received(), "/ok/main")
    assert set(received) == set(before + after)
    for message_id, records in received.items():
        for record in records:
            assert record["verified_with"], f"{message_id} did not verify"
    for message_id in after:  # during the overlap both secrets verify the same request
        assert received[message_id][0]["verified_with"] == [0, 1]
        assert len(received[message_id][0]["headers"]["webhook-signature"].split(" ")) == 2


@pytest.mark.spec("API-5")
def test_consumer_down_then_up_loses_nothing_and_duplicates_share_the_webhook_id(
    world, worker, consumer
):
    hook, _ = endpoint(world, consumer, "/ok/outage", "policy.published")
    consumer.stop()
    try:
        ids = emit_many(world, 5)

        def all_failed_once():
            rows = WebhookDelivery.objects.filter(endpoint=hook)
            return rows.count() == 5 and all(
                row.attempts >= 1 and "send failed" in row.last_error for row in rows
            )

        wait_for(all_failed_once, "attempts against the stopped consumer", logs=worker.log)
    finally:
        consumer.start()
    wait_for(lambda: all_delivered(hook), "delivery after the consumer came back", logs=worker.log)
    received = by_id(consumer.received(), "/ok/outage")
    assert set(received) == set(ids)
    for records in received.values():
        assert len({record["body"] for record in records}) == 1  # a duplicate is the same message
        assert all(record["verified_with"] for record in records)


@pytest.mark.spec("API-5")
def test_a_worker_killed_mid_delivery_loses_nothing(world, worker, consumer):
    hook, _ = endpoint(world, consumer, "/hold/crash", "policy.published")
    (message_id,) = emit_many(world, 1)
    wait_for(
        lambda: by_id(consumer.received(), "/hold/crash").get(message_id),
        "the consumer to hold the first attempt",
        logs=worker.log,
    )
    worker.kill()
    assert WebhookDelivery.objects.get(endpoint=hook).state == DeliveryState.DELIVERING
    worker.start()
    wait_for(lambda: all_delivered(hook), "the sweep to recover the delivery", logs=worker.log)
    records = by_id(consumer.received(), "/hold/crash")[message_id]
    assert len(records) >= 2 and records[0].get("held")
    assert len({record["body"] for record in records}) == 1
    assert all(record["verified_with"] for record in records)


@pytest.mark.spec("API-5")
def test_a_redirect_is_never_followed_and_410_disables_at_once(world, worker, consumer):
    redirected, _ = endpoint(world, consumer, "/redirect/r", "policy.published")
    gone, _ = endpoint(world, consumer, "/gone/g", "policy.published")
    emit_many(world, 1)
    wait_for(
        lambda: WebhookEndpoint.objects.filter(pk=gone.pk, enabled=False).exists(),
        "the 410 to disable its endpoint",
        logs=worker.log,
    )
    wait_for(
        lambda: WebhookDelivery.objects.filter(endpoint=redirected, attempts__gte=2).exists(),
        "a second attempt at the redirecting endpoint",
        logs=worker.log,
    )
    redirect_row = WebhookDelivery.objects.get(endpoint=redirected)
    assert redirect_row.state != DeliveryState.DELIVERED
    assert redirect_row.last_status_code == 302
    paths = [record["path"] for record in consumer.received()]
    assert "/ok/followed" not in paths
    assert WebhookEndpoint.objects.get(pk=gone.pk).disabled_reason == "gone"
    WebhookEndpoint.objects.filter(pk=redirected.pk).delete()  # stop its retries


@pytest.mark.spec("CRED-1", "API-5")
def test_no_secret_ever_appears_in_a_delivered_body_or_header(world, worker, consumer):
    hook, secret = endpoint(world, consumer, "/ok/canary")
    owner = world["owner"]
    actor = Principal(PrincipalKind.TOKEN, user=owner.user, token=owner.token)
    thread = thread_create(actor=SYSTEM, project=world.project, title="canary", mode="agent")
    action_request(
        actor=actor,
        thread=thread,
        tool="shell.exec",
        args={"argv": ["deploy", f"--token={CANARY}", PLAIN_CANARY], "env": {"API": CANARY}},
    )
    action_request(
        actor=actor,
        thread=thread,
        tool="fs.write",
        args={"path": f"secrets/{PLAIN_CANARY}", "content": CANARY},
    )
    policy_publish_environment(
        actor=SYSTEM,
        environment=world.environment,
        document={"capabilities": {"fs.read": {"paths": [f"{PLAIN_CANARY}/**"]}}},
    )
    wait_for(
        lambda: WebhookDelivery.objects.filter(endpoint=hook).count() == 3 and all_delivered(hook),
        "the canary deliveries",
        logs=worker.log,
    )
    received = [r for r in consumer.received() if r["path"] == "/ok/canary"]
    types = {json.loads(r["body"])["type"] for r in received}
    assert types == {"action.awaiting_approval", "action.denied", "policy.published"}
    forbidden = [CANARY, PLAIN_CANARY, secret, secret.removeprefix("whsec_"), owner.plaintext]
    for record in received:
        assert record["verified_with"] == [0]
        wire = record["body"] + json.dumps(record["headers"])
        leaked = [value for value in forbidden if value in wire]
        assert not leaked, f"{record['id']} leaked {leaked}"
