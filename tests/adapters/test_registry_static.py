"""The adapter registry: each operation is one exact HTTPS resource (CRED-2, CRED-4)."""

from __future__ import annotations

from dataclasses import replace
from urllib.parse import urlsplit

import pytest

from kestrel_one.adapters.registry import (
    ADAPTERS,
    CREDENTIAL_KINDS,
    GITHUB,
    Effect,
    InvalidOperationArguments,
    UnknownAdapter,
    UnknownOperation,
    get_operation,
    prepare_request,
    registry_check,
)

COMMENT = {"owner": "acme", "repo": "rocket", "issue_number": 7, "body": "Deployed."}


@pytest.mark.spec("CRED-2")
def test_every_operation_is_one_https_resource_on_its_own_host():
    for adapter in ADAPTERS.values():
        assert adapter.credential_kind in CREDENTIAL_KINDS
        for operation in adapter.operations.values():
            assert operation.effect in (Effect.READ, Effect.EXTERNAL)
            assert operation.response_max_bytes > 0 and operation.timeout_s > 0
            resource = operation.resource()
            assert resource.startswith(f"{operation.method} https://{operation.host}/")


@pytest.mark.spec("CRED-2")
def test_a_path_parameter_cannot_reach_another_resource():
    # A slash or dot-dot in a value is refused by the parameter's type, never encoded through.
    for owner in ("acme/../admin", "..", "a b", "", "x" * 40):
        with pytest.raises(InvalidOperationArguments) as refused:
            prepare_request("github", "issue_comment.create", {**COMMENT, "owner": owner})
        assert refused.value.field == "args.args.owner"
    for repo in ("..", ".", "rocket/../../orgs"):
        with pytest.raises(InvalidOperationArguments):
            prepare_request("github", "issue_comment.create", {**COMMENT, "repo": repo})
    request = prepare_request("github", "issue_comment.create", COMMENT)
    parts = urlsplit(request.url)
    assert (request.method, parts.scheme, parts.hostname, parts.port) == (
        "POST",
        "https",
        "api.github.com",
        None,
    )
    assert parts.path == "/repos/acme/rocket/issues/7/comments"
    assert request.body == b'{"body":"Deployed."}'
    assert "Authorization" not in request.headers  # the credential is added at send time only


@pytest.mark.spec("CRED-4")
def test_unknown_adapters_operations_and_arguments_fail_closed():
    with pytest.raises(UnknownAdapter, match="the adapters are: anthropic, github"):
        get_operation("gitlab", "issues.list")
    with pytest.raises(UnknownOperation, match=r"its operations are: issue_comment\.create"):
        get_operation("github", "repos.delete")
    for name in (None, 3, ["github"]):
        with pytest.raises(UnknownAdapter):
            get_operation(name, "issues.list")
    with pytest.raises(InvalidOperationArguments) as refused:
        prepare_request("github", "issues.list", {"owner": "acme", "repo": "r", "url": "x"})
    assert refused.value.field == "args.args.url"
    with pytest.raises(InvalidOperationArguments) as refused:
        prepare_request("slack", "chat.postMessage", {"channel": "C1"})
    assert refused.value.field == "args.args.text"


def test_query_arguments_are_encoded_in_a_stable_order():
    request = prepare_request(
        "github", "issues.list", {"owner": "acme", "repo": "rocket", "state": "all", "page": 2}
    )
    assert request.url == "https://api.github.com/repos/acme/rocket/issues?page=2&state=all"
    assert request.body is None


def test_write_operations_are_external_and_model_calls_are_reads():
    effects = {
        (adapter.name, operation.name): operation.effect
        for adapter in ADAPTERS.values()
        for operation in adapter.operations.values()
    }
    assert effects == {
        ("github", "issues.list"): Effect.READ,
        ("github", "issue_comment.create"): Effect.EXTERNAL,
        ("slack", "chat.postMessage"): Effect.EXTERNAL,
        ("openai", "chat.completions"): Effect.READ,
        ("anthropic", "messages.create"): Effect.READ,
    }


@pytest.mark.spec("CRED-4")
def test_an_operation_with_an_effect_kind_method_or_host_not_known_is_refused_at_import():
    comment = GITHUB.operations["issue_comment.create"]
    broken = {  # each a registry entry a typo or a bad merge could write
        "effect": replace(comment, effect="write"),
        "plain-string effect": replace(comment, effect="external"),
        "method": replace(comment, method="CONNECT"),
        "host": replace(comment, host="api.github.com:8443"),
        "placeholder": replace(comment, path="/repos/{owner}/{repo}/issues/{number}/comments"),
    }
    for what, operation in broken.items():
        adapter = replace(GITHUB, operations={operation.name: operation})
        with pytest.raises(TypeError, match=r"^github\.issue_comment\.create: "):
            registry_check({adapter.name: adapter})
            pytest.fail(f"a wrong {what} was accepted")
    for kind in ("", "AWS Key", "x" * 65):
        adapter = replace(GITHUB, credential_kind=kind)
        with pytest.raises(TypeError, match="credential kind"):
            registry_check({adapter.name: adapter})
    assert registry_check({"github": GITHUB})  # the real one passes


@pytest.mark.spec("CRED-4", "CRED-1")
@pytest.mark.django_db
def test_a_stored_credential_of_an_unknown_kind_is_never_released(world):
    from kestrel_one.accounts.principal import system_principal
    from kestrel_one.credentials.models import Credential
    from kestrel_one.credentials.release import CredentialRefused, secret_release
    from kestrel_one.credentials.services import credential_create

    credential = credential_create(
        actor=system_principal("tests"),
        organization=world.org,
        name="ci",
        adapter="github",
        secret="ghp_kind-test-secret-000",
    )
    Credential.objects.filter(pk=credential.pk).update(kind="aws_access_key")
    with pytest.raises(CredentialRefused) as refused:
        secret_release(
            organization=world.org,
            adapter="github",
            reference={"credential": credential.public_id},
            user=None,
            token=None,
        )
    assert refused.value.code == "credential_not_found"
    assert "ghp_kind-test-secret-000" not in str(refused.value)
