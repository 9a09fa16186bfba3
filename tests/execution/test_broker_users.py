"""Each runner's own broker user on the real broker (the suite's redis-server, with ACLs),
and pools that are shared or dedicated to one organization."""

from __future__ import annotations

import uuid

import pytest
import redis
from django.conf import settings

from kestrel_one.accounts.principal import system_principal
from kestrel_one.common.errors import Unavailable, ValidationFailed
from kestrel_one.execution.broker_users import (
    BrokerAclUnavailable,
    runner_broker_users_reconcile,
)
from kestrel_one.execution.enrollment import (
    call_pool_for,
    runner_enroll,
    runner_pool_route,
    runner_revoke,
)
from kestrel_one.execution.models import Runner
from runners.contract.tokens import generate_private_key_pem, public_key_pem

pytestmark = pytest.mark.spec("RUN-1", "RUN-7")

SYSTEM = system_principal("tests")


def enroll(pool: str, organization=None) -> Runner:
    return runner_enroll(
        actor=SYSTEM,
        pool=pool,
        organization=organization,
        public_key_pem=public_key_pem(generate_private_key_pem()).decode(),
    )


def admin() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL)


def login(runner: Runner, password: str | None = None) -> redis.Redis:
    return redis.Redis.from_url(
        settings.REDIS_URL, username=runner.public_id, password=password or runner.broker_password
    )


def test_an_enrolled_runner_reaches_only_its_own_pool_on_the_broker(db):
    runner = enroll("blue")
    own = login(runner)
    own.lpush("runner.blue", "command")
    assert own.brpop(["runner.blue"], timeout=1) == (b"runner.blue", b"command")
    assert own.set("kestrel:pool:blue:call:act_1", "lease")
    assert own.lpush("reports", "report")  # it may report...
    for attempt in (
        lambda: own.lrange("reports", 0, -1),  # ...but read no one's reports
        lambda: own.lpush("control", "task"),  # ...nor send the control plane its own tasks
        lambda: own.llen("runner.green"),
        lambda: own.get("kestrel:pool:green:call:act_1"),
        lambda: own.get("kestrel:call:act_1"),
        lambda: own.hgetall("unacked"),
        lambda: own.keys("*"),
        lambda: own.execute_command("ACL", "SETUSER", runner.public_id, "+@all", "~*"),
        lambda: own.execute_command("CLIENT", "LIST"),
        lambda: own.flushdb(),
    ):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    own.close()
    admin().delete("reports", "kestrel:pool:blue:call:act_1")
    # Only a hash is kept: the database cannot log in as the runner.
    stored = Runner.objects.get(pk=runner.pk).broker_password_sha256
    assert len(stored) == 64 and runner.broker_password not in stored


def test_revoking_a_runner_ends_its_connections_and_its_login(db):
    runner = enroll("blue")
    connected = login(runner)
    assert connected.ping()

    runner_revoke(actor=SYSTEM, runner=runner)

    with pytest.raises(redis.exceptions.ConnectionError):
        connected.llen("runner.blue")  # the open connection was killed (no retry: user gone)
    assert admin().execute_command("ACL", "GETUSER", runner.public_id) is None
    with pytest.raises(redis.exceptions.AuthenticationError):
        login(runner).ping()


def test_a_broker_that_cannot_make_runner_users_fails_enrollment_closed(db, settings):
    """A REDIS_URL user without ACL rights (or a Redis without ACLs): no runner is enrolled
    on a broker credential that could never be taken back."""
    name, password = f"kestrel-noacl-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    server = admin()
    rules = ("on", f">{password}", "~*", "&*", "+@all", "-acl")
    server.execute_command("ACL", "SETUSER", name, *rules)
    try:
        url = redis.connection.parse_url(settings.REDIS_URL)
        settings.REDIS_URL = f"redis://{name}:{password}@{url['host']}:{url['port']}/{url['db']}"
        with pytest.raises(BrokerAclUnavailable, match="per-runner users") as refused:
            enroll("blue")
        assert refused.value.code == "broker_acl_unavailable" and refused.value.status == 503
        assert password not in refused.value.message
        assert not Runner.objects.filter(pool="blue").exists()
    finally:
        server.execute_command("ACL", "DELUSER", name)


def test_reconcile_recreates_lost_users_and_removes_a_revocation_the_broker_missed(db):
    kept, missed = enroll("blue"), enroll("green")
    server = admin()
    server.execute_command("ACL", "DELUSER", kept.public_id)  # as after a broker restart
    Runner.objects.filter(pk=missed.pk).update(revoked_at="2026-01-01T00:00:00Z")

    counts = runner_broker_users_reconcile()

    assert counts["created"] >= 1 and counts["removed"] >= 1
    assert login(kept).ping()  # the same password works again: only its hash was needed
    assert server.execute_command("ACL", "GETUSER", missed.public_id) is None


def test_pools_are_shared_or_dedicated_to_one_organization(world):
    with pytest.raises(ValidationFailed, match="default pool"):
        enroll(settings.KESTREL_DEFAULT_POOL, world.org)
    enroll("acme-own", world.org)
    enroll("acme-own", world.org)  # more runners of the same organization: fine
    with pytest.raises(ValidationFailed, match="cannot join"):
        enroll("acme-own", world.other_org)
    with pytest.raises(ValidationFailed, match="cannot join"):
        enroll("acme-own")  # a shared runner would serve everyone from acme's pool
    enroll("platform")
    with pytest.raises(ValidationFailed, match="cannot join"):
        enroll("platform", world.other_org)


def test_an_organizations_calls_go_only_to_its_own_pool_or_the_shared_one(world):
    assert call_pool_for(world.org) == settings.KESTREL_DEFAULT_POOL
    enroll("globex-own", world.other_org)
    with pytest.raises(ValidationFailed, match="not dedicated"):
        runner_pool_route(actor=SYSTEM, organization=world.org, pool="globex-own")
    assert call_pool_for(world.org) == settings.KESTREL_DEFAULT_POOL
    runner_pool_route(actor=SYSTEM, organization=world.other_org, pool="globex-own")
    assert call_pool_for(world.other_org) == "globex-own"
    assert call_pool_for(world.org) == settings.KESTREL_DEFAULT_POOL
    assert world.other_org.audit_records.filter(action="runner.pool_route").count() == 1
    runner_pool_route(actor=SYSTEM, organization=world.other_org, pool=None)
    assert call_pool_for(world.other_org) == settings.KESTREL_DEFAULT_POOL


def test_a_default_pool_that_is_someones_own_takes_no_other_organizations_calls(world, settings):
    enroll("acme-own", world.org)
    settings.KESTREL_DEFAULT_POOL = "acme-own"  # changed after the pool was dedicated
    assert call_pool_for(world.org) == "acme-own"
    with pytest.raises(Unavailable, match="dedicated to one organization"):
        call_pool_for(world.other_org)
