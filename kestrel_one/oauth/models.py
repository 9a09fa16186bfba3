"""What the OAuth flow keeps: who registered a client, the one-time codes a person's consent
produced, each consent's refresh token and the ones it rotated away. Secrets are kept only as
SHA-256 digests.

django-oauth-toolkit's Application is the client; its Grant, AccessToken and RefreshToken
tables stay empty: the access token a client gets is a Kestrel ``ApiToken`` (kst_...), so it
authenticates, expires and is revoked like every other API token.
"""

from __future__ import annotations

from django.conf import settings
from django.db import models
from oauth2_provider.settings import oauth2_settings


class ClientRegistration(models.Model):
    """A client that registered itself (RFC 7591): from which address, and when."""

    application = models.OneToOneField(
        oauth2_settings.APPLICATION_MODEL, on_delete=models.CASCADE, related_name="registration"
    )
    # Who registered, as the rate limit counts them (an IPv6 client as its /64).
    remote_addr = models.GenericIPAddressField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    def __str__(self) -> str:
        return f"registration of {self.application_id}"


class AuthorizationCode(models.Model):
    """A person's consent for one client on one Project, as a one-time code (its digest)."""

    code_hash = models.CharField(max_length=64, unique=True)
    application = models.ForeignKey(
        oauth2_settings.APPLICATION_MODEL, on_delete=models.CASCADE, related_name="+"
    )
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="+")
    scopes = models.JSONField(default=list)
    resource = models.URLField(max_length=2000)
    redirect_uri = models.TextField()
    # S256 only: the digest of the client's verifier, as the client sent it.
    code_challenge = models.CharField(max_length=128)
    expires_at = models.DateTimeField()
    used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"code for {self.application_id} on {self.project_id}"


class OAuthGrant(models.Model):
    """One consent's tokens: the refresh token (its digest) and the API token it last minted."""

    application = models.ForeignKey(
        oauth2_settings.APPLICATION_MODEL, on_delete=models.CASCADE, related_name="+"
    )
    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="+")
    project = models.ForeignKey("tenancy.Project", on_delete=models.CASCADE, related_name="+")
    scopes = models.JSONField(default=list)
    resource = models.URLField(max_length=2000)
    # The code it came from: a code presented twice revokes what it produced (RFC 6749 4.1.2).
    code = models.OneToOneField(
        AuthorizationCode, null=True, on_delete=models.SET_NULL, related_name="grant"
    )
    # The current refresh token; every one it replaced is a RetiredRefreshToken.
    refresh_hash = models.CharField(max_length=64, unique=True)
    api_token = models.OneToOneField(
        "accounts.ApiToken", null=True, on_delete=models.SET_NULL, related_name="oauth_grant"
    )
    created_at = models.DateTimeField(auto_now_add=True)
    refreshed_at = models.DateTimeField(null=True, blank=True)
    refresh_expires_at = models.DateTimeField()
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"grant of {self.application_id} on {self.project_id}"


class RetiredRefreshToken(models.Model):
    """A refresh token its grant rotated away (its digest). Presented again, however many
    rotations later, it is a replay: someone else holds a copy, and the grant ends
    (RFC 9700 section 4.14.2)."""

    grant = models.ForeignKey(OAuthGrant, on_delete=models.CASCADE, related_name="retired")
    refresh_hash = models.CharField(max_length=64, unique=True)
    retired_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"retired refresh token of {self.grant_id}"
