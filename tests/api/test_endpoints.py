"""Behaviour of the foundation endpoints: validation, members, environments, projects, docs."""

from __future__ import annotations

import json

import pytest

from kestrel_one.audit.models import AuditRecord


def test_health_needs_no_token(api, db):
    response = api.get("/api/v1/health")
    assert response.status_code == 200 and response.json()["status"] in {"ok", "degraded"}


def test_everything_else_needs_a_token_in_hosted_mode(api, db):
    for path in ("/api/v1/orgs", "/api/v1/schema?format=json", "/api/v1/orgs/acme"):
        response = api.get(path)
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "not_authenticated"


def test_schema_and_docs_are_served(world):
    owner = world["owner"].client()
    schema = owner.get("/api/v1/schema?format=json")
    assert schema.status_code == 200
    assert "/api/v1/orgs/{org}/projects" in json.loads(schema.content)["paths"]
    docs = owner.get("/api/v1/docs")
    assert docs.status_code == 200 and b"swagger" in docs.content.lower()


def test_the_schema_says_what_the_server_enforces(world):
    """Request bodies refuse unknown fields, and references that may be absent are null."""
    schema = json.loads(world["owner"].client().get("/api/v1/schema?format=json").content)
    components = schema["components"]["schemas"]
    requests = {name: c for name, c in components.items() if name.endswith("Request")}
    assert len(requests) > 10
    assert [n for n, c in requests.items() if c.get("additionalProperties") is not False] == []
    for component, field in (
        ("ShareLink", "artifact"),
        ("ShareLink", "thread"),
        ("Plan", "accepted_by"),
    ):
        assert components[component]["properties"][field]["nullable"] is True, (component, field)
    share = components["ShareCreateRequest"]["properties"]["expires_in"]
    assert (share["minimum"], share["maximum"]) == (60, 30 * 24 * 60 * 60)
    # And it does refuse one.
    unknown = (
        world["owner"]
        .client()
        .post("/api/v1/orgs/acme/environments", {"name": "x", "colour": "red"}, format="json")
    )
    assert unknown.status_code == 400 and "colour" in unknown.json()["error"]["details"]


def test_a_body_nested_deeper_than_the_decoder_goes_is_a_400(world):
    response = (
        world["owner"]
        .client()
        .post(
            "/api/v1/orgs/acme/environments",
            data="[" * 100_000 + "]" * 100_000,
            content_type="application/json",
        )
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parse_error"
    assert "nested too deeply" in response.json()["error"]["message"]


def test_unknown_route_is_a_json_404(world):
    response = world["owner"].client().get("/api/v1/nowhere")
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "not_found"


def test_bad_input_names_the_field(world):
    response = (
        world["owner"].client().post("/api/v1/orgs/acme/projects", {"name": ""}, format="json")
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "invalid"
    assert set(error["details"]) == {"name", "environment"}
    assert "environment" in error["message"] and "name" in error["message"]


def test_unknown_fields_are_refused_not_ignored(world):
    response = (
        world["owner"]
        .client()
        .post(
            "/api/v1/orgs/acme/environments", {"name": "x", "organization": "globex"}, format="json"
        )
    )
    assert response.status_code == 400
    assert "organization" in response.json()["error"]["details"]


def test_malformed_json_is_a_parse_error(world):
    response = (
        world["owner"]
        .client()
        .post("/api/v1/orgs/acme/environments", "{not json", content_type="application/json")
    )
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "parse_error"


@pytest.mark.spec("TEN-4")
def test_project_cannot_use_a_foreign_environment(world):
    response = (
        world["owner"]
        .client()
        .post(
            "/api/v1/orgs/acme/projects",
            {"name": "p", "environment": world.foreign_environment.public_id},
            format="json",
        )
    )
    assert response.status_code == 400
    assert "environment" in response.json()["error"]["details"]
    assert world.foreign_environment.name not in response.content.decode()


def test_project_lifecycle_is_audited(world):
    owner = world["owner"].client()
    created = owner.post(
        "/api/v1/orgs/acme/projects",
        {"name": "rocket", "environment": world.environment.public_id},
        format="json",
    )
    assert created.status_code == 201
    project_id = created.json()["id"]
    assert project_id.startswith("prj_")
    assert created.json()["environment"] == world.environment.public_id
    renamed = owner.patch(
        f"/api/v1/orgs/acme/projects/{project_id}", {"name": "rocket-2"}, format="json"
    )
    assert renamed.json()["name"] == "rocket-2"
    moved = owner.patch(
        f"/api/v1/orgs/acme/projects/{project_id}",
        {"environment": world.empty_environment.public_id},
        format="json",
    )
    assert moved.status_code == 400, "a project's environment is fixed once it exists"
    assert owner.delete(f"/api/v1/orgs/acme/projects/{project_id}").status_code == 204
    actions = list(
        AuditRecord.objects.filter(organization=world.org, target_id=project_id)
        # Unsettled records have no sequence yet (audit_chain_settle numbers them after
        # commit): among those, the order they were written in.
        .order_by("sequence", "pk")
        .values_list("action", flat=True)
    )
    assert actions == ["project.create", "project.update", "project.delete"]


def test_duplicate_names_conflict(world):
    response = (
        world["owner"]
        .client()
        .post("/api/v1/orgs/acme/environments", {"name": "production"}, format="json")
    )
    assert response.status_code == 409
    assert response.json()["error"]["code"] == "conflict"


def test_environment_with_projects_cannot_be_deleted(world):
    response = (
        world["owner"]
        .client()
        .delete(f"/api/v1/orgs/acme/environments/{world.environment.public_id}")
    )
    assert response.status_code == 409
    assert world.project.public_id in str(response.json()["error"]["details"])


def test_lists_paginate_with_a_cursor_and_filter(world):
    owner = world["owner"].client()
    for n in range(5):
        owner.post("/api/v1/orgs/acme/environments", {"name": f"bulk-{n}"}, format="json")
    page = owner.get("/api/v1/orgs/acme/environments?limit=3").json()
    seen, pages = [], 0
    while True:
        pages += 1
        assert len(page["results"]) <= 3
        seen += [e["id"] for e in page["results"]]
        if not page["next"]:
            break
        page = owner.get(page["next"]).json()
    assert pages == 3
    assert len(seen) == len(set(seen)) == 7
    assert seen == sorted(seen), "ids are time-ordered, so the cursor walks in creation order"
    # limit is clamped to 1..200; anything but a whole number is refused, never ignored.
    for path in ("/api/v1/orgs/acme/environments", "/api/v1/orgs/acme/audit"):
        assert len(owner.get(f"{path}?limit=0").json()["results"]) == 1
        assert len(owner.get(f"{path}?limit=100000").json()["results"]) <= 200
        for bad in ("abc", "-1", "null", "2.5", "\u00b2", "\uff15"):
            refused = owner.get(f"{path}?limit={bad}")
            assert refused.status_code == 400, (path, bad)
            assert refused.json()["error"]["details"] == {"limit": ["invalid"]}
    filtered = owner.get("/api/v1/orgs/acme/environments?name=bulk").json()["results"]
    assert len(filtered) == 5
    by_env = owner.get(f"/api/v1/orgs/acme/projects?environment={world.environment.public_id}")
    assert len(by_env.json()["results"]) == 2


@pytest.mark.spec("TEN-3")
def test_admin_cannot_make_owners_and_last_owner_stays(world):
    admin = world["admin"].client()
    response = admin.post(
        "/api/v1/orgs/acme/members", {"email": "x@example.com", "role": "owner"}, format="json"
    )
    assert response.status_code == 403
    owner = world["owner"]
    demote = owner.client().patch(
        f"/api/v1/orgs/acme/members/{owner.membership.public_id}", {"role": "admin"}, format="json"
    )
    assert demote.status_code == 409


@pytest.mark.spec("TEN-3")
def test_member_can_be_limited_to_projects_and_widened_again(world):
    owner = world["owner"].client()
    created = owner.post(
        "/api/v1/orgs/acme/members",
        {
            "email": "contractor@example.com",
            "role": "member",
            "projects": [world.project.public_id],
        },
        format="json",
    ).json()
    assert created["all_projects"] is False and created["projects"] == [world.project.public_id]
    unknown = owner.patch(
        f"/api/v1/orgs/acme/members/{created['id']}",
        {"projects": [world.foreign_project.public_id]},
        format="json",
    )
    assert unknown.status_code == 400 and "projects[0]" in unknown.json()["error"]["details"]
    widened = owner.patch(
        f"/api/v1/orgs/acme/members/{created['id']}", {"projects": None}, format="json"
    )
    assert widened.json()["all_projects"] is True and widened.json()["projects"] is None


def test_member_list_shows_roles(world):
    members = world["viewer"].client().get("/api/v1/orgs/acme/members").json()["results"]
    roles = sorted(m["role"] for m in members)
    assert roles == ["admin", "member", "member", "owner", "viewer"]
    assert world["outsider"].user.email not in str(members)
