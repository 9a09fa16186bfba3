"""The console's surface policies page (POL-2): each surface's policy, shown and published."""

from __future__ import annotations

import json

import pytest

from kestrel_one.accounts.principal import Principal, PrincipalKind
from kestrel_one.audit.models import AuditRecord
from kestrel_one.console.sudo import SESSION_KEY
from kestrel_one.governance.models import SurfacePolicyVersion
from kestrel_one.governance.services import surface_policy_publish
from tests.console.surface import signed_in

URL = "/console/acme/surfaces"
READS_ONLY = {"capabilities": {"fs.read": {"paths": ["**"]}}}


def publish_form(surface: str, document) -> dict:
    text = document if isinstance(document, str) else json.dumps(document)
    return {"surface": surface, "document": text}


@pytest.mark.spec("POL-2", "SURF-2")
def test_every_member_sees_each_surface_and_admins_get_the_forms(world):
    owner_html = signed_in(world["owner"].user).get(URL).content.decode()
    for name in ("api", "console", "mcp"):
        assert f'id="surface-{name}"' in owner_html
        assert f'name="surface" value="{name}"' in owner_html
    assert owner_html.count("No policy published: this surface grants every capability.") == 3
    assert 'href="/console/acme/surfaces" aria-current="page"' in owner_html

    viewer = signed_in(world["viewer"].user).get(URL)
    assert viewer.status_code == 200
    assert 'name="document"' not in viewer.content.decode()


@pytest.mark.spec("POL-2", "SURF-2")
def test_an_admin_publishes_a_surface_policy_from_the_page(world):
    admin = signed_in(world["admin"].user)
    response = admin.post(URL, publish_form("mcp", READS_ONLY))
    assert response.status_code == 303
    assert response["Location"] == f"{URL}?published=mcp#surface-mcp"
    version = SurfacePolicyVersion.objects.get()
    assert version.surface == "mcp" and version.created_by == world["admin"].user.public_id
    assert AuditRecord.objects.filter(
        action="surface_policy.publish", target_id=version.public_id
    ).exists()
    html = admin.get(response["Location"]).content.decode()
    assert "Published the mcp surface policy" in html
    assert version.public_id in html and version.sha256 in html
    assert world["admin"].user.email in html
    # The other two still grant everything.
    assert html.count("No policy published: this surface grants every capability.") == 2


@pytest.mark.spec("POL-2")
def test_a_malformed_document_is_shown_at_its_path_and_nothing_is_published(world):
    owner = signed_in(world["owner"].user)
    text = '{"capabilities": {"fs.read": {"paths": ["src/**", 7]}}}'
    response = owner.post(URL, publish_form("console", text))
    assert response.status_code == 400
    html = response.content.decode()
    assert "<code>capabilities.fs.read.paths[1]</code>" in html
    assert 'id="surface-console-errors"' in html and 'aria-invalid="true"' in html
    # What the person wrote is kept for them to fix.
    assert "src/**&quot;, 7" in html
    assert not SurfacePolicyVersion.objects.exists()

    unknown = owner.post(URL, publish_form("fax", READS_ONLY))
    assert unknown.status_code == 400
    assert "Unknown surface" in unknown.content.decode()


@pytest.mark.spec("POL-2", "SURF-4")
def test_publishing_needs_sudo_mode_and_the_csrf_token(world):
    stale = signed_in(world["owner"].user)
    # A session signed in long ago: its sudo stamp is gone.
    session = stale.session
    session.pop(SESSION_KEY, None)
    session.save()
    response = stale.post(URL, publish_form("mcp", READS_ONLY))
    assert response.status_code == 303
    assert response["Location"].startswith("/console/sudo?")
    assert not SurfacePolicyVersion.objects.exists()

    no_token = signed_in(world["owner"].user, enforce_csrf_checks=True)
    assert no_token.post(URL, publish_form("mcp", READS_ONLY)).status_code == 403
    assert not SurfacePolicyVersion.objects.exists()

    for name in ("member", "viewer"):
        refused = signed_in(world[name].user).post(URL, publish_form("mcp", READS_ONLY))
        assert refused.status_code == 403, name
    assert not SurfacePolicyVersion.objects.exists()


@pytest.mark.spec("POL-2")
def test_the_console_explain_panel_judges_on_the_console_surface(world):
    version = surface_policy_publish(
        actor=Principal(PrincipalKind.SESSION, user=world["owner"].user),
        organization=world.org,
        surface="console",
        document=READS_ONLY,
    )
    owner = signed_in(world["owner"].user)
    query = {"tool": "shell.exec", "args": json.dumps({"argv": ["make"]}), "mode": "agent"}
    url = f"/console/acme/projects/{world.project.public_id}/policy/explain"
    html = owner.get(url, query).content.decode()
    assert "Denied" in html
    assert f"shell.exec is not granted by the console surface policy ({version.public_id})" in html
    assert f"+surface:console@{version.public_id}" in html
    # Through the API the same call still only needs an approval.
    api = (
        world["owner"]
        .client()
        .post(
            f"/api/v1/orgs/acme/projects/{world.project.public_id}/explain",
            {"tool": "shell.exec", "args": {"argv": ["make"]}},
            format="json",
        )
    )
    assert api.json()["decision"] == "needs_approval"
