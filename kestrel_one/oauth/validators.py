"""django-oauth-toolkit's request validator, bound to Kestrel's storage.

oauthlib runs the protocol (client lookup, redirect URI matching, PKCE, error responses);
this class decides what is stored: codes and refresh tokens as digests in this app's tables,
and, as the access token, a Kestrel API token from ``services``. DOT's own Grant, AccessToken
and RefreshToken tables are never written.
"""

from __future__ import annotations

from django.conf import settings
from oauth2_provider.oauth2_validators import OAuth2Validator
from oauthlib.oauth2.rfc6749 import errors

from kestrel_one.oauth import services


class InvalidTargetError(errors.OAuth2Error):
    """RFC 8707 section 2: the token is asked for a resource the consent was not for."""

    error = "invalid_target"
    status_code = 400


def _check_resource(request, consented: str) -> None:
    """Every ``resource`` the token request names (RFC 8707, any number) must be the one the
    person consented to: the token is that Project's, so another one is refused, never
    answered with a token for a resource the client did not ask for."""
    asked = [value for key, value in request.decoded_body or [] if key == "resource"]
    if any(value != consented for value in asked):
        raise InvalidTargetError(
            description=f"This grant is for the resource {consented} only.", request=request
        )


class KestrelOAuth2Validator(OAuth2Validator):
    # --- the authorization code --------------------------------------------------------------
    def save_authorization_code(self, client_id, code, request, *args, **kwargs):
        # The consent page refuses anything else first; this is the last word.
        if request.code_challenge_method != "S256" or not services.S256_CHALLENGE.fullmatch(
            request.code_challenge or ""
        ):
            raise errors.InvalidRequestError(
                description="PKCE with code_challenge_method=S256 is required.", request=request
            )
        try:
            services.authorization_code_create(
                actor=services.consenting_person(request.user),
                application=request.client,
                project=request.kestrel_project,
                scopes=list(request.scopes),
                resource=request.kestrel_resource,
                redirect_uri=request.redirect_uri,
                code=code["code"],
                code_challenge=request.code_challenge,
            )
        except services.GrantRefused as refusal:
            raise errors.InvalidScopeError(description=str(refusal), request=request) from None

    def validate_code(self, client_id, code, client, request, *args, **kwargs):
        row = services.authorization_code_claim(application=client, code=code)
        if row is None:
            return False
        _check_resource(request, row.resource)
        request.kestrel_code = row
        request.user = row.user
        request.scopes = list(row.scopes)
        return True

    def get_code_challenge(self, code, request):
        row = getattr(request, "kestrel_code", None)
        return row.code_challenge if row is not None else None

    def get_code_challenge_method(self, code, request):
        return "S256" if getattr(request, "kestrel_code", None) is not None else None

    def confirm_redirect_uri(self, client_id, code, redirect_uri, client, request, *args, **kwargs):
        # Exactly the URI the consent was given for (RFC 6749 section 4.1.3).
        row = getattr(request, "kestrel_code", None)
        return row is not None and redirect_uri == row.redirect_uri

    def invalidate_authorization_code(self, client_id, code, request, *args, **kwargs):
        # Already claimed in validate_code, before the verifier was checked.
        return None

    def get_authorization_code_scopes(self, client_id, code, redirect_uri, request):
        row = getattr(request, "kestrel_code", None)
        return list(row.scopes) if row is not None else []

    def get_authorization_code_nonce(self, client_id, code, redirect_uri, request):
        return None

    # --- tokens ------------------------------------------------------------------------------
    def rotate_refresh_token(self, request):
        return True

    def save_bearer_token(self, token, request, *args, **kwargs):
        try:
            if request.grant_type == "authorization_code":
                _grant, plaintext, scopes = services.oauth_tokens_issue(
                    code=request.kestrel_code, refresh_token=token["refresh_token"]
                )
            elif request.grant_type == "refresh_token":
                _grant, plaintext, scopes = services.oauth_tokens_refresh(
                    grant=request.kestrel_grant,
                    refresh_token=request.refresh_token,
                    new_refresh_token=token["refresh_token"],
                    scopes=list(request.scopes or []),
                )
            else:
                raise errors.UnsupportedGrantTypeError(request=request)
        except services.GrantRefused as refusal:
            raise errors.InvalidGrantError(description=str(refusal), request=request) from None
        # What the client gets is the Kestrel token; oauthlib's random value is discarded.
        token["access_token"] = plaintext
        token["expires_in"] = int(settings.KESTREL_OAUTH_ACCESS_TOKEN_TTL.total_seconds())
        token["scope"] = " ".join(scopes)

    def validate_refresh_token(self, refresh_token, client, request, *args, **kwargs):
        grant = services.oauth_grant_for_refresh(application=client, refresh_token=refresh_token)
        if grant is None:
            return False
        _check_resource(request, grant.resource)
        request.kestrel_grant = grant
        request.user = grant.user
        return True

    def get_original_scopes(self, refresh_token, request, *args, **kwargs):
        return list(request.kestrel_grant.scopes)

    def revoke_token(self, token, token_type_hint, request, *args, **kwargs):
        services.oauth_token_revoke(application=request.client, token=token)

    def validate_bearer_token(self, token, scopes, request):
        # Kestrel's API authenticates its own tokens (kestrel_one.api.authentication).
        return False

    def introspect_token(self, token, token_type_hint, request, *args, **kwargs):
        return None
