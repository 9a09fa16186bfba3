"""A project whose policy allows a few models, with org credentials for both providers
pointed at the test upstream (tests/upstream.py), and a member's token for the endpoint."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kestrel_one.accounts.principal import system_principal
from kestrel_one.accounts.scopes import Role
from kestrel_one.governance.services import policy_publish_environment
from tests.conftest import make_person
from tests.factories import EnvironmentFactory, OrganizationFactory, ProjectFactory

MODELS = [
    "openai/gpt-4o-mini",
    "openai/kestrel-upstream-error",
    "openai/kestrel-echo-credential",
    "openai/kestrel-echo-credential-ok",
    "openai/kestrel-echo-credential-escaped",
    "openai/kestrel-slow",
    "anthropic/claude-3-5-haiku-latest",
    "anthropic/kestrel-upstream-error",
    "anthropic/kestrel-echo-credential-escaped",
]
POLICY = {"capabilities": {"model.invoke": {"models": MODELS}, "fs.read": {"paths": ["**"]}}}


@dataclass
class GatewayWorld:
    org: object
    project: object
    member: object
    admin: object
    credentials: dict

    def url(self, project=None) -> str:
        project = project or self.project
        return (
            f"/api/v1/orgs/{self.org.slug}/projects/{project.public_id}/model/v1/chat/completions"
        )


def gateway_world_make(upstream) -> GatewayWorld:
    from kestrel_one.credentials.services import credential_create

    org = OrganizationFactory(slug="skyward", name="Skyward Labs")
    environment = EnvironmentFactory(organization=org, name="prod")
    policy_publish_environment(
        actor=system_principal("tests"), environment=environment, document=POLICY
    )
    project = ProjectFactory(organization=org, environment=environment, name="copilot")
    credentials = {
        adapter: credential_create(
            actor=system_principal("tests"),
            organization=org,
            name=f"{adapter} key",
            adapter=adapter,
            secret=upstream.secret(adapter),
        )
        for adapter in ("openai", "anthropic")
    }
    return GatewayWorld(
        org=org,
        project=project,
        member=make_person(org, Role.MEMBER, name="member"),
        admin=make_person(org, Role.ADMIN, name="admin"),
        credentials=credentials,
    )


@pytest.fixture
def gateway_world(db, upstream) -> GatewayWorld:
    return gateway_world_make(upstream)
