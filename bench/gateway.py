"""A model-gateway call against the same provider request made directly, on this machine.

Run: ``.venv/bin/python bench/gateway.py [--quick]``. Needs PostgreSQL (a database made for
the run, dropped after). Django runs in this process (single-host settings), the provider is
the test upstream (``tests/upstream.py``: a real HTTPS server with its own CA, in its own
process), reached through the egress client's host overrides.

- gateway: ``POST .../model/v1/chat/completions`` through Django's WSGI handler (the full
  middleware, token authentication, tenancy, the policy, the budget's reservation, the
  credential's release) and the egress client's fresh TLS connection to the upstream, timed
  until the answer is in hand; the settlement and its audit record run after it, when the
  response is closed, as behind a WSGI server (the run checks every call was settled);
- direct: the very request the gateway sends (same body, same credential header) on a fresh
  TLS connection to the upstream, verified against its CA, with urllib3.

The two are timed interleaved, so load on the machine lands on both alike. Prints median and
p95 of each, the ratio of the medians and the overhead in milliseconds; target: gateway
median <= 1.3 x direct median + 10 ms. Writes ``bench/results/gateway.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import governed  # noqa: E402
from stats import percentile  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "gateway.json"
ADMIN_DATABASE_URL = os.environ.get(
    "KESTREL_BENCH_DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres"
)
MESSAGES = [{"role": "user", "content": "Give me a one-line status of the launch."}]
BODY = {"model": "openai/gpt-4o-mini", "messages": MESSAGES, "max_tokens": 32}
TARGET_RATIO = 1.3
TARGET_PLUS_MS = 10.0


def setup(database_url: str, upstream) -> None:
    """Django in this process on the run's database, its egress pointed at the upstream."""
    os.environ.update(
        DJANGO_SETTINGS_MODULE="kestrel_one.settings",
        KESTREL_MODE="single-host",
        KESTREL_DATA_DIR=str(Path(tempfile.mkdtemp(prefix="kestrel-bench-gateway-"))),
        DATABASE_URL=database_url,
        KESTREL_EGRESS_HOST_OVERRIDES=upstream.overrides,
        KESTREL_EGRESS_CA_BUNDLE=str(upstream.ca_bundle),
    )
    os.environ.pop("REDIS_URL", None)  # nothing here enqueues work
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", interactive=False, verbosity=0)


def make_project(upstream) -> tuple[str, str]:
    """An organization whose policy allows the model, its OpenAI credential (the upstream's
    test key), a project and a member's token: the endpoint's URL and the token."""
    from kestrel_one.accounts.models import User
    from kestrel_one.accounts.principal import system_principal
    from kestrel_one.accounts.scopes import ROLE_SCOPES, Role
    from kestrel_one.accounts.services import token_create
    from kestrel_one.credentials.services import credential_create
    from kestrel_one.governance.services import policy_publish_environment
    from kestrel_one.tenancy.models import Membership, Organization
    from kestrel_one.tenancy.services import environment_create, project_create

    system = system_principal("bench")
    org = Organization.objects.create(slug="bench-gateway", name="Bench gateway")
    user = User.objects.create_user(email="bench@gateway.example.com", password=None)
    Membership.objects.create(organization=org, user=user, role=Role.MEMBER.value)
    environment = environment_create(actor=system, organization=org, name="prod")
    policy_publish_environment(
        actor=system,
        environment=environment,
        document={"capabilities": {"model.invoke": {"models": [BODY["model"]]}}},
    )
    project = project_create(actor=system, organization=org, environment=environment, name="p")
    credential_create(
        actor=system,
        organization=org,
        name="openai",
        adapter="openai",
        secret=upstream.secret("openai"),
    )
    _, token = token_create(
        actor=system,
        organization=org,
        name="bench",
        scopes=sorted(ROLE_SCOPES[Role.MEMBER]),
        user=user,
    )
    url = f"/api/v1/orgs/{org.slug}/projects/{project.public_id}/model/v1/chat/completions"
    return url, token


class Gateway:
    """Calls the endpoint through Django's WSGI handler, as a WSGI server does: the time is
    until the answer's body is in hand (what the client waits for); the server's work after
    it, in ``close()`` (the settlement and its audit record), runs before the next call but
    outside the timed span, as it does behind a real server."""

    def __init__(self, url: str, token: str):
        from django.core.handlers.wsgi import WSGIHandler
        from django.test import RequestFactory

        self.handler = WSGIHandler()
        self.factory = RequestFactory(HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_HOST="127.0.0.1")
        self.url = url
        self.body = json.dumps(BODY)

    def call(self) -> float:
        environ = self.factory.post(self.url, self.body, content_type="application/json").environ
        status: list[str] = []
        started = time.perf_counter()
        response = self.handler(environ, lambda line, headers, exc_info=None: status.append(line))
        content = b"".join(response)
        elapsed = time.perf_counter() - started
        response.close()
        if not status or not status[0].startswith("200"):
            raise RuntimeError(f"gateway call: {status} {content[:300]!r}")
        return elapsed


def check_settled() -> dict[str, int]:
    """Every call was settled (after its answer) and charged: the figure is of real calls."""
    from kestrel_one.gateway.models import BudgetWindow, ModelUsage

    states = {
        state: ModelUsage.objects.filter(state=state).count()
        for state in ("reserved", "settled", "expired")
    }
    if states["reserved"] or states["expired"]:
        raise RuntimeError(f"calls left unsettled: {states}")
    window = BudgetWindow.objects.get(period="day")
    return {**states, "used": window.used, "reserved_tokens": window.reserved}


def direct_request(upstream):
    """The provider request the gateway makes for BODY (the registry's exact request)."""
    from kestrel_one.adapters.registry import get_adapter, prepare_request
    from kestrel_one.gateway.providers import ModelRequest, provider_args

    request = ModelRequest("openai", "gpt-4o-mini", tuple(MESSAGES), BODY["max_tokens"])
    prepared = prepare_request("openai", "chat.completions", provider_args(request))
    presentation = get_adapter("openai").presentation
    headers = {
        **prepared.headers,
        presentation.header: presentation.header_value(upstream.secret("openai")),
    }
    return prepared, headers


def direct_call(upstream, prepared, headers) -> float:
    import urllib3

    started = time.perf_counter()
    # A fresh verified TLS connection per call, as the egress client makes one.
    with urllib3.HTTPSConnectionPool(
        "127.0.0.1",
        upstream.port,
        server_hostname="api.openai.com",
        assert_hostname="api.openai.com",
        ca_certs=str(upstream.ca_bundle),
        cert_reqs="CERT_REQUIRED",
        maxsize=1,
    ) as pool:
        response = pool.urlopen(
            prepared.method,
            "/v1/chat/completions",
            body=prepared.body,
            headers={**headers, "Host": "api.openai.com"},
            retries=False,
            preload_content=True,
        )
    elapsed = time.perf_counter() - started
    if response.status != 200:
        raise RuntimeError(f"direct call: {response.status}")
    return elapsed


def measure(samples: int, warmup: int) -> dict[str, Any]:
    from tests.upstream import upstream_start

    upstream = upstream_start(Path(tempfile.mkdtemp(prefix="kestrel-bench-upstream-")))
    try:
        name = f"kestrel_bench_gateway_{uuid.uuid4().hex[:8]}"
        with governed.scratch_database(ADMIN_DATABASE_URL, name) as database_url:
            setup(database_url, upstream)
            url, token = make_project(upstream)
            endpoint = Gateway(url, token)
            prepared, headers = direct_request(upstream)
            for _ in range(warmup):
                endpoint.call()
                direct_call(upstream, prepared, headers)
            gateway, direct = [], []
            for index in range(samples):
                # Alternate which goes first, so neither always follows the other.
                if index % 2:
                    direct.append(direct_call(upstream, prepared, headers))
                    gateway.append(endpoint.call())
                else:
                    gateway.append(endpoint.call())
                    direct.append(direct_call(upstream, prepared, headers))
            settled = check_settled()
            from django.db import connection

            connection.close()
    finally:
        upstream.stop()
    gateway_ms = statistics.median(gateway) * 1000
    direct_ms = statistics.median(direct) * 1000
    return {
        "samples": samples,
        "gateway_median_ms": gateway_ms,
        "gateway_p95_ms": percentile(gateway, 0.95) * 1000,
        "direct_median_ms": direct_ms,
        "direct_p95_ms": percentile(direct, 0.95) * 1000,
        "ratio": gateway_ms / direct_ms,
        "overhead_ms": gateway_ms - direct_ms,
        "target": f"gateway <= {TARGET_RATIO} x direct + {TARGET_PLUS_MS:.0f} ms",
        "target_ms": TARGET_RATIO * direct_ms + TARGET_PLUS_MS,
        "met": gateway_ms <= TARGET_RATIO * direct_ms + TARGET_PLUS_MS,
        "settled": settled,
        "samples_s": {"gateway": gateway, "direct": direct},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--json", type=Path, default=RESULTS, help="where to write the figures")
    options = parser.parse_args(argv)
    samples, warmup = (30, 5) if options.quick else (200, 20)
    figures = measure(samples, warmup)
    print(
        f"gateway call  median {figures['gateway_median_ms']:7.2f} ms  "
        f"p95 {figures['gateway_p95_ms']:7.2f} ms\n"
        f"direct call   median {figures['direct_median_ms']:7.2f} ms  "
        f"p95 {figures['direct_p95_ms']:7.2f} ms\n"
        f"ratio {figures['ratio']:.2f}x, overhead {figures['overhead_ms']:.2f} ms; "
        f"target {figures['target']} = {figures['target_ms']:.2f} ms: "
        f"{'met' if figures['met'] else 'NOT met'}"
    )
    options.json.parent.mkdir(parents=True, exist_ok=True)
    options.json.write_text(
        json.dumps({"machine": platform.platform(), **figures}, indent=2, sort_keys=True)
    )
    return 0 if figures["met"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
