"""A runner's broker user may wait for its own pool's answers, and no other pool's."""

from __future__ import annotations

import uuid

import pytest
import redis

from runners.contract.adapter_broker import new_request_id, reply_key
from runners.contract.broker_access import runner_acl_rules
from tests.runners.support import RUNNER_REDIS_URL

pytestmark = [pytest.mark.spec("CRED-3")]


@pytest.fixture
def pool_user():
    admin = redis.Redis.from_url(RUNNER_REDIS_URL)
    db = admin.connection_pool.connection_kwargs.get("db", 0)
    name, password = f"run_acl{uuid.uuid4().hex[:10]}", uuid.uuid4().hex
    admin.execute_command(
        "ACL", "SETUSER", name, "reset", "on", f">{password}", *runner_acl_rules("blue", db=db)
    )
    kwargs = dict(admin.connection_pool.connection_kwargs)
    user = redis.Redis(
        host=kwargs.get("host", "127.0.0.1"), port=kwargs.get("port", 6379), db=db,
        username=name, password=password,
    )  # fmt: skip
    yield admin, user
    user.close()
    admin.execute_command("ACL", "DELUSER", name)
    admin.close()


def test_the_broker_user_pops_its_pools_answers_only(pool_user):
    admin, user = pool_user
    own, other = reply_key("blue", new_request_id()), reply_key("green", new_request_id())
    admin.lpush(own, "answer")
    admin.lpush(other, "not yours")
    assert user.brpop([own], timeout=1) == (own.encode(), b"answer")
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.brpop([other], timeout=1)
    # Nor may it forge an answer for another pool's broker.
    with pytest.raises(redis.exceptions.NoPermissionError):
        user.lpush(other, "forged")
    assert admin.llen(other) == 1
    admin.delete(own, other)
