"""Methods a route does not have: OPTIONS included, every route answers 405 in the error shape."""

from __future__ import annotations

from tests.api.routes import org_scoped_routes
from tests.api.test_cross_tenant import fill


def test_options_is_a_405_error_on_every_route(world):
    owner = world["owner"].client()
    urls = [fill(route, world, "acme") for route in org_scoped_routes()]
    urls += ["/api/v1/orgs", "/api/v1/tools", "/api/v1/keys", "/api/v1/shared/ksh_unknown"]
    answers = {url: owner.options(url) for url in urls}
    wrong = {
        url: (response.status_code, response.content[:200])
        for url, response in answers.items()
        if response.status_code != 405 or response.json()["error"]["code"] != "method_not_allowed"
    }
    assert wrong == {}
    # It tells which methods the route has, so a client can correct itself.
    retention = answers["/api/v1/orgs/acme/retention"]
    assert "PUT" in retention["Allow"]
