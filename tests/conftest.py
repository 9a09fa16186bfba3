"""Shared fixtures: real PostgreSQL and Redis, and a world of actors in two organizations.

Every endpoint is probed by an owner, an admin, a member, a viewer, a member limited to one
project, and an outsider from another organization (healthchecks' alice/bob/charlie, widened).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import redis
from django.conf import settings
from guardian.shortcuts import assign_perm
from rest_framework.test import APIClient

from kestrel_one.accounts.models import ApiToken
from kestrel_one.accounts.principal import Principal, PrincipalKind, system_principal
from kestrel_one.accounts.scopes import ROLE_SCOPES, Role
from kestrel_one.accounts.services import token_create
from kestrel_one.common.egress import host_overrides_parse
from kestrel_one.execution.enrollment import runner_enroll
from kestrel_one.execution.models import Action, Receipt
from kestrel_one.execution.plans import plan_propose
from kestrel_one.execution.services import action_request
from kestrel_one.governance.services import policy_publish_environment
from kestrel_one.threads.services import thread_create
from runners.contract.tokens import generate_private_key_pem, public_key_pem
from runners.sandbox import DockerBackend, SandboxUnavailable
from tests.factories import (
    EnvironmentFactory,
    MembershipFactory,
    OrganizationFactory,
    ProjectFactory,
    UserFactory,
)
from tests.support import kestrel_containers, unmount_workspace_quotas
from tests.upstream import Upstream, upstream_start

# The acme production environment's ceiling in the shared world.
ENVIRONMENT_POLICY = {
    "capabilities": {
        "fs.read": {"paths": ["**"]},
        "fs.write": {"paths": ["src/**", "out/**"]},
        # env: the variables tests overlay beyond the always-allowed ones (docs/policy.md).
        "shell.exec": {
            "approval": "always",
            "env": ["API", "API_KEY", "GH"],
            "limits": {"timeout_s": 60},
        },
        "code.exec": {"limits": {"timeout_s": 30}},
        "net.http": {"allow": ["https://api.github.com:443"]},
    }
}


@pytest.fixture(scope="session", autouse=True)
def _real_services_present():
    """Fail, never skip, when the services the suite needs are missing."""
    client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(f"Redis at {settings.REDIS_URL} is required by the test suite: {exc}")


@pytest.fixture(scope="session", autouse=True)
def _control_signing_key():
    """The control plane's command-signing key, as an operator would provision it (0600)."""
    path = settings.KESTREL_SIGNING_KEY_FILE
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(generate_private_key_pem())
        path.chmod(0o600)
    return path


@pytest.fixture(scope="session", autouse=True)
def _credentials_key():
    """The key that encrypts credentials, as an operator would provision it (0600)."""
    from kestrel_one.credentials.crypto import key_generate

    path = settings.KESTREL_CREDENTIALS_KEY_FILE
    if not path.exists():
        try:
            key_generate(path)
        except FileExistsError:
            pass
    return path


@pytest.fixture(scope="session", autouse=True)
def _no_workspace_quota_left_mounted(tmp_path_factory):
    """Runners mount a quota filesystem per workspace; whatever a test's runner left mounted
    under this session's temporary directories is unmounted at the end, so no loop device
    outlives the suite (the runner fixtures unmount their own already)."""
    yield
    unmount_workspace_quotas(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def upstream_server(tmp_path_factory):
    """The test upstream (tests/upstream.py), one process for the session."""
    try:
        server = upstream_start(tmp_path_factory.mktemp("upstream"))
    except RuntimeError as error:
        pytest.fail(str(error), pytrace=False)
    yield server
    server.stop()


@pytest.fixture
def upstream(upstream_server, settings) -> Upstream:
    """The test upstream for one test: the egress client in this process reaches the four
    provider names there (its CA trusted, the overrides allowed in the tests' hosted mode);
    ``requests()`` counts only this test's requests; ``env()`` is for worker subprocesses."""
    handle = upstream_server.reset()
    settings.KESTREL_EGRESS_HOST_OVERRIDES = host_overrides_parse(handle.overrides)
    settings.KESTREL_EGRESS_CA_BUNDLE = handle.ca_bundle
    settings.KESTREL_EGRESS_OVERRIDES_IN_HOSTED = True
    return handle


REPO = Path(__file__).resolve().parents[1]
ENSURE_DOCKER = REPO / "deploy" / "scripts" / "ensure-docker.sh"
BUILD_IMAGE = REPO / "deploy" / "images" / "tool-runtime" / "build.sh"


def _run_setup_script(script: Path) -> str:
    completed = subprocess.run(
        ["bash", str(script)], capture_output=True, text=True, timeout=900, check=False
    )
    if completed.returncode != 0:
        pytest.fail(
            f"Docker is required for this test and {script.name} failed "
            f"(exit {completed.returncode}):\n{completed.stderr[-2000:]}",
            pytrace=False,
        )
    return completed.stdout.strip()


@pytest.fixture(scope="session")
def docker_backend() -> Iterator[DockerBackend]:
    """The Docker backend on the local engine, pinned to the tool image's id. At the end of
    the session no Kestrel container that was not there at its start may be left, whichever
    test (or process a test started) left it."""
    _run_setup_script(ENSURE_DOCKER)
    image_id = _run_setup_script(BUILD_IMAGE).splitlines()[-1]
    try:
        backend = DockerBackend.from_environment()
    except SandboxUnavailable as error:
        pytest.fail(f"Docker is required for this test: {error}", pytrace=False)
    assert backend.image_id == image_id
    before = kestrel_containers(backend.client)
    yield backend
    after = kestrel_containers(backend.client)
    leftovers = [what for container_id, what in after.items() if container_id not in before]
    assert leftovers == [], f"containers left behind by the session: {leftovers}"


@dataclass
class Actor:
    name: str
    role: Role | None
    user: object | None
    token: ApiToken | None
    plaintext: str | None
    membership: object | None = None

    def client(self) -> APIClient:
        client = APIClient(REMOTE_ADDR="203.0.113.7")
        if self.plaintext:
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {self.plaintext}")
        return client


@dataclass
class World:
    org: object
    other_org: object
    environment: object
    project: object
    other_project: object
    foreign_environment: object
    foreign_project: object
    empty_environment: object
    runner: object
    actors: dict[str, Actor] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Actor:
        return self.actors[name]


def make_person(organization, role: Role, *, name: str, projects=None) -> Actor:
    user = UserFactory(email=f"{name}@{organization.slug}.example.com")
    membership = MembershipFactory(
        organization=organization, user=user, role=role, all_projects=projects is None
    )
    for project in projects or []:
        assign_perm("tenancy.view_project", user, project)
    token, plaintext = token_create(
        actor=system_principal("tests"),
        organization=organization,
        name=f"{name} token",
        scopes=sorted(ROLE_SCOPES[role]),
        user=user,
    )
    return Actor(name, role, user, token, plaintext, membership)


def add_work(world: World) -> None:
    """Threads, actions, a receipt and a plan in acme, made by an integration (an agent), so
    that every person in the walker is someone other than the requester."""
    token, _ = token_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="agent",
        scopes=["org:read", "projects:read", "projects:write"],
        integration=True,
    )
    agent = Principal(PrincipalKind.TOKEN, token=token)
    world.agent = agent
    world.thread = thread_create(actor=agent, project=world.project, title="build", mode="agent")
    world.action = action_request(
        actor=agent, thread=world.thread, tool="shell.exec", args={"argv": ["make", "test"]}
    )
    assert world.action.state == "awaiting_approval"
    finished = action_request(
        actor=agent, thread=world.thread, tool="fs.read", args={"path": "README.md"}
    )
    Action.objects.filter(pk=finished.pk).update(state="succeeded", result={"content": "hi"})
    finished.refresh_from_db()
    Receipt.objects.create(
        action=finished,
        organization=world.org,
        call_id=finished.public_id,
        tool=finished.tool,
        args=finished.args,
        args_digest=finished.args_digest,
        action_digest=finished.action_digest,
        scope={"prj": world.project.public_id},
        outcome="succeeded",
        result=finished.result,
        policy_version=finished.policy_version,
    )
    world.finished_action = finished
    world.plan_thread = thread_create(
        actor=agent, project=world.project, title="plan it", mode="plan"
    )
    world.plan = plan_propose(
        actor=agent,
        thread=world.plan_thread,
        steps=[{"tool": "fs.write", "args": {"path": "src/a.py", "content": "x"}}],
    )


@pytest.fixture
def world(db) -> World:
    org = OrganizationFactory(slug="acme", name="Acme Rockets")
    other_org = OrganizationFactory(slug="globex", name="Globex Secret Labs")
    environment = EnvironmentFactory(organization=org, name="production")
    policy_publish_environment(
        actor=system_principal("tests"), environment=environment, document=ENVIRONMENT_POLICY
    )
    project = ProjectFactory(organization=org, environment=environment, name="launchpad")
    other_project = ProjectFactory(organization=org, environment=environment, name="hangar")
    foreign_environment = EnvironmentFactory(organization=other_org, name="globex-env")
    foreign_project = ProjectFactory(
        organization=other_org, environment=foreign_environment, name="globex-vault"
    )
    # An environment with no projects, which an admin is allowed to delete.
    empty_environment = EnvironmentFactory(organization=org, name="scratch")
    runner = runner_enroll(
        actor=system_principal("tests"),
        organization=org,
        pool="acme-pool",
        public_key_pem=public_key_pem(generate_private_key_pem()).decode(),
    )
    world = World(
        org,
        other_org,
        environment,
        project,
        other_project,
        foreign_environment,
        foreign_project,
        empty_environment,
        runner,
    )
    for role in (Role.OWNER, Role.ADMIN, Role.MEMBER, Role.VIEWER):
        world.actors[role.value] = make_person(org, role, name=role.value)
    world.actors["limited"] = make_person(
        org, Role.MEMBER, name="limited", projects=[other_project]
    )
    world.actors["outsider"] = make_person(other_org, Role.OWNER, name="outsider")
    add_work(world)
    world.actors["anonymous"] = Actor("anonymous", None, None, None, None)
    return world


@pytest.fixture
def api():
    return APIClient(REMOTE_ADDR="203.0.113.7")
