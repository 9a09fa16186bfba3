"""OAuth URLs, mounted at the site root by kestrel_one.urls.

The protected resource metadata path mirrors the MCP endpoint's (RFC 9728 section 3.1). Its
document is the same for every org and Project, existing or not, so it is not an
organization route (converters are not named ``org``) and needs no tenancy check.
"""

from django.urls import path

from kestrel_one.oauth import views

urlpatterns = [
    path(
        ".well-known/oauth-protected-resource/api/v1/orgs/<str:org_slug>/projects/<str:prj_id>/mcp",
        views.protected_resource_metadata,
        name="oauth_protected_resource",
    ),
    path(
        ".well-known/oauth-authorization-server",
        views.authorization_server_metadata,
        name="oauth_authorization_server",
    ),
    path("oauth/register", views.RegisterView.as_view(), name="oauth_register"),
    path("oauth/token", views.TokenView.as_view(), name="oauth_token"),
    path("oauth/revoke", views.RevokeView.as_view(), name="oauth_revoke"),
    path("console/oauth/authorize", views.AuthorizeView.as_view(), name="oauth_authorize"),
]
