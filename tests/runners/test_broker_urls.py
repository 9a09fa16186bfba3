"""One Redis, two client libraries: every broker address is accepted in either spelling of a
Unix socket, and converted in one place (runners.contract.broker)."""

from __future__ import annotations

from pathlib import Path

import pytest

from runners.config import RunnerConfig
from runners.contract.broker import broker_label, is_redis_url, kombu_url, redis_client_url
from runners.contract.tokens import generate_private_key_pem, public_key_pem

SOCKET = "/srv/kestrel/var/run/redis.sock"


@pytest.mark.parametrize(
    ("given", "for_redis_py", "for_kombu"),
    [
        (
            f"unix://{SOCKET}?db=0",
            f"unix://{SOCKET}?db=0",
            f"redis+socket://{SOCKET}?virtual_host=0",
        ),
        (
            f"redis+socket://{SOCKET}?virtual_host=3",
            f"unix://{SOCKET}?db=3",
            f"redis+socket://{SOCKET}?virtual_host=3",
        ),
        ("redis://:pw@redis.internal:6380/2", "redis://:pw@redis.internal:6380/2", None),
        ("rediss://redis.internal/0", "rediss://redis.internal/0", None),
    ],
)
def test_each_client_gets_its_spelling(given, for_redis_py, for_kombu):
    assert redis_client_url(given) == for_redis_py
    assert kombu_url(given) == (for_kombu or given)
    assert is_redis_url(given)


def test_not_a_redis_address():
    assert not is_redis_url("sqla+sqlite:///broker.sqlite3")
    assert not is_redis_url("unix://")


def test_the_label_never_carries_a_credential():
    assert broker_label("redis://kestrel:hunter2@redis.internal:6380/2") == (
        "redis://redis.internal:6380/2"
    )
    assert broker_label(f"unix://{SOCKET}?db=0&password=hunter2") == f"unix socket {SOCKET} (db 0)"
    assert broker_label(None) == "none"


def test_a_runner_takes_the_embedded_brokers_socket_address(tmp_path: Path):
    key = tmp_path / "runner.pem"
    key.write_bytes(generate_private_key_pem())
    key.chmod(0o600)
    control = tmp_path / "control.pub"
    control.write_bytes(public_key_pem(generate_private_key_pem()))
    config = RunnerConfig.from_environment(
        {
            "KESTREL_RUNNER_ID": "run_01JSOCKET",
            "KESTREL_RUNNER_POOL": "default",
            "KESTREL_RUNNER_KEY_FILE": str(key),
            "KESTREL_CONTROL_PUBLIC_KEY_FILE": str(control),
            "KESTREL_BROKER_URL": f"unix://{SOCKET}?db=0",
            "KESTREL_WORKSPACE_ROOT": str(tmp_path),
        }
    )
    assert config.broker_url == f"redis+socket://{SOCKET}?virtual_host=0"
    assert config.state_url == f"unix://{SOCKET}?db=0"
