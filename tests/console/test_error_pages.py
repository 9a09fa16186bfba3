"""The console's error pages: its own look, and the same 404 for hidden and missing."""

from __future__ import annotations

import pytest
from django.test import Client


@pytest.mark.spec("SURF-4")
def test_a_form_posted_without_its_csrf_token_is_refused_on_a_console_page(world):
    client = Client(enforce_csrf_checks=True)
    client.force_login(world["owner"].user)
    refused = client.post("/console/acme/tokens", {"name": "forged", "scopes": ["org:read"]})
    assert refused.status_code == 403
    assert b"security token" in refused.content and b'<main id="main"' in refused.content
    assert not world["owner"].user.tokens.filter(name="forged").exists()


def test_api_paths_keep_json_errors(world):
    missing = Client().get("/api/v1/no-such-thing")
    assert missing.status_code == 404
    assert missing["Content-Type"].startswith("application/json")
    page = Client().get("/console/no-such-page/at/all")
    assert page.status_code == 404 and page["Content-Type"].startswith("text/html")
    assert b"Not found" in page.content
