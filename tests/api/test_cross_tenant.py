"""Walks every organization-scoped route in the URL resolver as every kind of actor.

Outsiders get exactly the 404 a missing object gets; no foreign id or name appears in any
response; writes by outsiders and by roles lacking the scope change nothing.
"""

from __future__ import annotations

import pytest
from django.db import transaction

from kestrel_one.accounts.scopes import ROLE_SCOPES
from kestrel_one.api.base import OrgScopedViewSet
from kestrel_one.audit.models import AuditRecord
from tests.api.routes import (
    BODIES,
    KWARGS,
    OWN_REFUSALS,
    QUERIES,
    SELF_SERVICE,
    call,
    database_fingerprint,
    fill,
    org_scoped_routes,
)

# Objects a role may not see even inside its organization (a member sees only own tokens).
HIDDEN_FROM = {
    "api:token-detail": {"member", "limited"},
    # A connection is its owner's alone, whatever the caller's role (TEN-5); the walker's is
    # the owner's, so even an admin and the members get the 404.
    "api:connection-detail": {"admin", "member", "limited"},
}
MISSING_IDS = {
    "id": "tok_00000000000000000000000000",
    "env": "env_00000000000000000000000000",
    "prj": "prj_00000000000000000000000000",
    "surface": "no-such-surface",
}
# URL kwargs that name one of a fixed, public list (the surfaces), not a tenant's object: an
# unknown one is a 404 too, whose message may name the list, since it tells nobody anything
# about any organization.
PUBLIC_VOCABULARY = {"surface"}
WRITE_METHODS = {"post", "put", "patch", "delete"}
ORG_ACTORS = ("owner", "admin", "member", "viewer", "limited")


def foreign_markers(world) -> list[str]:
    """Identifiers and names of the acme organization that no outsider may ever see."""
    markers = [
        world.environment.public_id,
        world.empty_environment.public_id,
        world.project.public_id,
        world.other_project.public_id,
        "launchpad",
        "hangar",
        "Acme Rockets",
    ]
    for name in ORG_ACTORS:
        actor = world[name]
        markers += [actor.user.email, actor.token.public_id, actor.membership.public_id]
    return markers


def expected_for(route, method: str, actor_name: str, world) -> str:
    if actor_name == "anonymous":
        return "401"
    if actor_name == "outsider":
        return "404"
    # The scope is checked before any object is looked up, so a caller lacking it learns
    # nothing about which objects exist: 403 whether or not the object is there.
    required = route.view_class.scope_map.get(method.upper())
    if required not in ROLE_SCOPES[world[actor_name].role]:
        return "403"
    if actor_name == "limited" and "<str:prj>" in route.pattern:
        return "404"
    if actor_name in HIDDEN_FROM.get(route.name, set()):
        return "404"
    if (
        method in WRITE_METHODS
        and actor_name == "viewer"
        and (route.name, method) not in SELF_SERVICE | QUERIES
    ):
        pytest.fail(f"{route.name} {method}: a viewer may write here; is that intended?")
    return "2xx"


@pytest.mark.spec("TEN-1", "TEN-4")
def test_every_org_route_refuses_outsiders_like_missing_objects(world, capsys):
    routes = org_scoped_routes()
    assert routes, "the resolver returned no organization routes"
    uncovered = [r.name for r in routes if r.name not in KWARGS]
    uncovered += [
        f"{r.name} {m}"
        for r in routes
        for m in r.actions
        if m in {"post", "put", "patch"} and (r.name, m) not in BODIES
    ]
    assert not uncovered, f"routes without a walker entry in tests/api/routes.py: {uncovered}"
    not_scoped = [
        r.name for r in routes if not (r.view_class and issubclass(r.view_class, OrgScopedViewSet))
    ]
    assert not not_scoped, f"organization routes not built on OrgScopedViewSet: {not_scoped}"

    markers = foreign_markers(world)
    owner = world["owner"].client()
    probes = 0
    for route in routes:
        for method in route.actions:
            body = BODIES[(route.name, method)](world) if (route.name, method) in BODIES else None
            url = fill(route, world, "acme")

            # What a missing organization and a missing object look like to a real owner.
            missing_bodies = [call(owner, method, fill(route, world, "no-such-org"), body)]
            if KWARGS[route.name]:
                missing_url = fill(route, world, "acme", MISSING_IDS)
                missing = call(owner, method, missing_url, body)
                if set(KWARGS[route.name]) & PUBLIC_VOCABULARY:
                    assert missing.status_code == 404, (route.name, method, missing.content)
                    assert missing.json()["error"]["code"] == "not_found"
                    probes += 1
                else:
                    missing_bodies.append(missing)
            for missing in missing_bodies:
                assert missing.status_code == 404, (route.name, method, missing.content)
            missing_body = missing_bodies[0].content
            assert all(m.content == missing_body for m in missing_bodies)
            probes += len(missing_bodies)

            for actor_name in (*ORG_ACTORS, "outsider", "anonymous"):
                expected = expected_for(route, method, actor_name, world)
                with transaction.atomic():
                    before = database_fingerprint()
                    response = call(world[actor_name].client(), method, url, body)
                    after = database_fingerprint()
                    transaction.set_rollback(True)
                probes += 1
                where = f"{route.name} {method.upper()} {url} as {actor_name}"
                status = response.status_code
                if expected == "2xx" and (route.name, method) in OWN_REFUSALS:
                    own_status, own_code = OWN_REFUSALS[route.name, method]
                    assert status == own_status, f"{where}: {status} {response.content[:300]}"
                    assert response.json()["error"]["code"] == own_code, where
                    continue
                if expected == "2xx":
                    assert 200 <= status < 300, f"{where}: {status} {response.content[:300]}"
                    if (route.name, method) in QUERIES:
                        assert before == after, f"{where}: a query changed the database"
                    continue
                assert status == int(expected), f"{where}: {status} {response.content[:300]}"
                assert before == after, f"{where}: a refused request changed the database"
                assert response.json()["error"]["code"] in {
                    "not_found",
                    "permission_denied",
                    "not_authenticated",
                }
                if expected == "404":
                    assert response.content == missing_body, f"{where}: 404 differs from missing"
                text = response.content.decode()
                if actor_name == "outsider":
                    leaked = [m for m in markers if m in text]
                    assert not leaked, f"{where}: leaked {leaked}"

            # The outsider addressing acme's objects through its own organization.
            if set(KWARGS[route.name]) - PUBLIC_VOCABULARY:
                cross = fill(route, world, "globex")
                with transaction.atomic():
                    before = database_fingerprint()
                    response = call(world["outsider"].client(), method, cross, body)
                    after = database_fingerprint()
                    transaction.set_rollback(True)
                probes += 1
                assert response.status_code == 404, (route.name, method, response.content)
                assert before == after
                assert not [m for m in markers if m in response.content.decode()]

    # The outsider's own lists (and its own organization's surfaces) never show acme's rows.
    for route in routes:
        if not set(KWARGS[route.name]) - PUBLIC_VOCABULARY and "get" in route.actions:
            response = world["outsider"].client().get(fill(route, world, "globex"))
            probes += 1
            assert response.status_code == 200
            assert not [m for m in markers if m in response.content.decode()]

    with capsys.disabled():
        print(f"\ncross-tenant walker: {len(routes)} routes, {probes} probes")
    assert probes > 10 * len(routes)


@pytest.mark.spec("TEN-3", "TEN-4")
def test_limited_member_sees_only_granted_projects(world):
    client = world["limited"].client()
    listed = client.get("/api/v1/orgs/acme/projects").json()["results"]
    assert [p["id"] for p in listed] == [world.other_project.public_id]
    hidden = client.get(f"/api/v1/orgs/acme/projects/{world.project.public_id}")
    missing = client.get("/api/v1/orgs/acme/projects/prj_00000000000000000000000000")
    assert hidden.status_code == missing.status_code == 404
    assert hidden.content == missing.content


@pytest.mark.spec("TEN-3")
def test_an_admin_limited_to_projects_sees_the_project_they_create_and_nothing_more(world):
    admin = world["admin"]
    limited = (
        world["owner"]
        .client()
        .patch(
            f"/api/v1/orgs/acme/members/{admin.membership.public_id}",
            {"projects": [world.other_project.public_id]},
            format="json",
        )
    )
    assert limited.status_code == 200, limited.content
    client = admin.client()
    made = client.post(
        "/api/v1/orgs/acme/projects",
        {"name": "their-own", "environment": world.environment.public_id},
        format="json",
    )
    assert made.status_code == 201, made.content
    listed = client.get("/api/v1/orgs/acme/projects").json()["results"]
    assert sorted(p["id"] for p in listed) == sorted(
        [world.other_project.public_id, made.json()["id"]]
    )
    thread = client.post(
        f"/api/v1/orgs/acme/projects/{made.json()['id']}/threads", {"title": "t"}, format="json"
    )
    assert thread.status_code == 201
    assert client.get(f"/api/v1/orgs/acme/projects/{world.project.public_id}").status_code == 404
    membership = admin.membership
    membership.refresh_from_db()
    assert membership.all_projects is False  # still limited, now to two projects
    record = AuditRecord.objects.get(action="project.create", target_id=made.json()["id"])
    assert record.data["granted_to_creator"] == membership.public_id
