import pytest


@pytest.mark.spec("TEN-2")
def test_owner_lists_projects(world):
    response = world["owner"].client().get("/api/v1/orgs/acme/projects")
    assert response.status_code == 200, response.content
    names = sorted(p["name"] for p in response.json()["results"])
    assert names == ["hangar", "launchpad"]
