"""HTTP endpoints of the OAuth flow: metadata (RFC 9728, RFC 8414), registration (RFC 7591),
the consent page, the token endpoint and revocation (RFC 7009)."""

from __future__ import annotations

import math

from django.conf import settings
from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils.decorators import method_decorator
from django.views import View
from django.views.decorators.csrf import csrf_exempt
from oauth2_provider.exceptions import FatalClientError, OAuthToolkitError
from oauth2_provider.http import OAuth2ResponseRedirect
from oauth2_provider.models import get_application_model
from oauth2_provider.views.mixins import OAuthLibMixin
from oauthlib.common import add_params_to_uri

from kestrel_one.accounts.scopes import SCOPES
from kestrel_one.common.addresses import client_network, mcp_endpoint_url, public_origin
from kestrel_one.common.throttling import SharedRateThrottle
from kestrel_one.oauth import registration, services
from kestrel_one.oauth.resources import resource_project
from kestrel_one.oauth.services import REDIRECT_SCHEMES, S256_CHALLENGE

AUTHORIZE_PATH = "/console/oauth/authorize"


def _public_json(body: dict) -> JsonResponse:
    # Metadata is public and the same for everyone: browser-based clients may read it.
    response = JsonResponse(body)
    response["Access-Control-Allow-Origin"] = "*"
    return response


def protected_resource_metadata(request: HttpRequest, org_slug: str, prj_id: str) -> JsonResponse:
    """RFC 9728 for ``/api/v1/orgs/{org}/projects/{prj}/mcp``. The same document for any org
    and Project, existing or not, so it tells nobody which exist."""
    origin = public_origin(request)
    return _public_json(
        {
            "resource": mcp_endpoint_url(origin, org_slug, prj_id),
            "authorization_servers": [origin],
            "scopes_supported": list(services.OAUTH_SCOPES),
            "bearer_methods_supported": ["header"],
            "resource_name": "Kestrel One MCP endpoint",
            "resource_documentation": f"{origin}/api/docs",
        }
    )


def authorization_server_metadata(request: HttpRequest) -> JsonResponse:
    """RFC 8414: where a client registers, sends the person, and gets its tokens."""
    origin = public_origin(request)
    return _public_json(
        {
            "issuer": origin,
            "authorization_endpoint": origin + AUTHORIZE_PATH,
            "token_endpoint": origin + "/oauth/token",
            "registration_endpoint": origin + "/oauth/register",
            "revocation_endpoint": origin + "/oauth/revoke",
            "scopes_supported": list(services.OAUTH_SCOPES),
            "response_types_supported": ["code"],
            "response_modes_supported": ["query"],
            "grant_types_supported": ["authorization_code", "refresh_token"],
            "code_challenge_methods_supported": ["S256"],
            "token_endpoint_auth_methods_supported": ["none"],
            "revocation_endpoint_auth_methods_supported": ["none"],
            "authorization_response_iss_parameter_supported": True,
        }
    )


@method_decorator(csrf_exempt, name="dispatch")
class RegisterView(View):
    """``POST /oauth/register``: register a public client (RFC 7591)."""

    http_method_names = ["post", "options"]

    def post(self, request: HttpRequest) -> HttpResponse:
        remote_addr = client_network(request.META.get("REMOTE_ADDR"))
        try:
            name, redirect_uris, scopes = registration.parse_registration(request.body)
            registration.check_rate(remote_addr)
        except registration.RegistrationRefused as refusal:
            return refusal.response()
        application = services.client_register(
            name=name, redirect_uris=redirect_uris, remote_addr=remote_addr
        )
        response = JsonResponse(
            {
                "client_id": application.client_id,
                "client_id_issued_at": int(application.created.timestamp()),
                "client_name": application.name,
                "redirect_uris": redirect_uris,
                "grant_types": ["authorization_code", "refresh_token"],
                "response_types": ["code"],
                "token_endpoint_auth_method": "none",
                "scope": " ".join(scopes),
            },
            status=201,
        )
        response["Cache-Control"] = "no-store"
        return response


class TokenRateThrottle(SharedRateThrottle):
    """At most ``KESTREL_OAUTH_TOKEN_RATE`` requests to ``/oauth/token`` and ``/oauth/revoke``
    from one address (an IPv6 client as its /64), counted in the shared cache. Counted per
    address, not per client: a client id is public, so counting by it would let anyone lock
    a client out."""

    scope = "oauth-token"
    rate_setting = "KESTREL_OAUTH_TOKEN_RATE"

    def get_cache_key(self, request, view):
        network = client_network(request.META.get("REMOTE_ADDR")) or "unknown"
        return self.cache_format % {"scope": self.scope, "ident": network}


def _throttled(view, request: HttpRequest) -> HttpResponse | None:
    """The 429 for a request past the address's bound (RFC 6585), or None."""
    throttle = TokenRateThrottle()
    if throttle.allow_request(request, view):
        return None
    wait = math.ceil(throttle.wait() or 1)
    response = JsonResponse(
        {
            "error": "temporarily_unavailable",
            "error_description": f"Too many token requests from this address; try again in "
            f"{wait} seconds.",
        },
        status=429,
    )
    response["Cache-Control"] = "no-store"
    response["Retry-After"] = str(wait)
    return response


@method_decorator(csrf_exempt, name="dispatch")
class TokenView(OAuthLibMixin, View):
    """``POST /oauth/token``: authorization_code (with the PKCE verifier) and refresh_token.

    DOT's own TokenView looks the issued token up in its AccessToken table, which Kestrel
    does not use; this one only relays oauthlib's answer.
    """

    http_method_names = ["post"]

    def post(self, request: HttpRequest) -> HttpResponse:
        if (refused := _throttled(self, request)) is not None:
            return refused
        _uri, headers, body, status = self.create_token_response(request)
        response = HttpResponse(body, status=status, content_type="application/json")
        for key, value in headers.items():
            response[key] = value
        response["Cache-Control"] = "no-store"
        return response


@method_decorator(csrf_exempt, name="dispatch")
class RevokeView(OAuthLibMixin, View):
    """``POST /oauth/revoke`` (RFC 7009): ends the consent the token belongs to."""

    http_method_names = ["post"]

    def post(self, request: HttpRequest) -> HttpResponse:
        if (refused := _throttled(self, request)) is not None:
            return refused
        _uri, headers, body, status = self.create_revocation_response(request)
        response = HttpResponse(body or "", status=status)
        for key, value in headers.items():
            response[key] = value
        return response


class AuthorizeView(OAuthLibMixin, View):
    """``/console/oauth/authorize``: the signed-in person sees which client asks for which
    Project with which scopes, and allows or denies. The Project comes from the ``resource``
    parameter (RFC 8707) and must be one the person sees."""

    http_method_names = ["get", "post"]

    def get(self, request: HttpRequest) -> HttpResponse:
        return self._handle(request)

    def post(self, request: HttpRequest) -> HttpResponse:
        return self._handle(request)

    def _handle(self, request: HttpRequest) -> HttpResponse:
        if not request.user.is_authenticated:
            return redirect_to_login(request.get_full_path())
        try:
            scopes, credentials = self.validate_authorization_request(request)
        except FatalClientError as error:
            return _error_page(
                request,
                "This link from the application is not valid",
                "The application sent an unknown client or a redirect address it did not "
                f"register ({error.oauthlib_error.description}). Start again from the "
                "application; if it keeps happening, tell whoever maintains it.",
            )
        except OAuthToolkitError as error:
            return _redirect_error(request, error)
        if "redirect_uri" not in request.GET:
            return _error_page(
                request,
                "This link from the application is not valid",
                "The application did not say where to send you back (redirect_uri).",
            )
        redirect_uri = credentials["redirect_uri"]
        state = credentials.get("state")
        if credentials.get("code_challenge_method") != "S256":
            return _redirect_to_client(
                request,
                redirect_uri,
                error="invalid_request",
                description="PKCE with code_challenge_method=S256 is required.",
                state=state,
            )
        if not S256_CHALLENGE.fullmatch(credentials.get("code_challenge") or ""):
            return _redirect_to_client(
                request,
                redirect_uri,
                error="invalid_request",
                description="code_challenge must be the unpadded base64url SHA-256 of the "
                "verifier: 43 characters of A-Z, a-z, 0-9, '-' and '_' (RFC 7636 section 4.2).",
                state=state,
            )
        resources = request.GET.getlist("resource")
        person = services.consenting_person(request.user)
        project = (
            resource_project(principal=person, resource=resources[0], origin=public_origin(request))
            if len(resources) == 1
            else None
        )
        if project is None:
            return _error_page(
                request,
                "No such Project",
                "The application asks for access to "
                f"{resources[0][:300] if resources else 'nothing in particular'}, which is not the "
                "MCP endpoint of a Project you can see. Connect the application to "
                "/api/v1/orgs/{org}/projects/{prj}/mcp of one of your Projects and try again.",
                status=404,
            )
        organization = project.organization
        held = person.scopes_in(organization)
        granted = [scope for scope in scopes if scope in held and scope in services.OAUTH_SCOPES]
        if not granted:
            return _error_page(
                request,
                "Nothing to allow",
                f"Your role in {organization.name} holds none of the scopes the application "
                f"asks for ({', '.join(scopes) or 'none'}).",
                status=403,
            )
        application = get_application_model().objects.get(client_id=credentials["client_id"])
        if request.method != "POST":
            return self._consent_page(request, application, project, granted, scopes, redirect_uri)
        decision = request.POST.get("decision")
        if decision not in {"allow", "deny"}:
            return _error_page(request, "Choose Allow or Deny", "The form was incomplete.")
        oauth_credentials = {
            "client_id": credentials["client_id"],
            "redirect_uri": redirect_uri,
            "response_type": credentials["response_type"],
            "state": state,
            "code_challenge": credentials["code_challenge"],
            "code_challenge_method": "S256",
            "kestrel_project": project,
            "kestrel_resource": resources[0],
        }
        try:
            uri, _headers, _body, _status = self.create_authorization_response(
                request=request,
                scopes=" ".join(granted),
                credentials=oauth_credentials,
                allow=decision == "allow",
            )
        except OAuthToolkitError as error:
            return _redirect_error(request, error)
        return OAuth2ResponseRedirect(uri, REDIRECT_SCHEMES)

    def _consent_page(self, request, application, project, granted, asked, redirect_uri):
        context = {
            "client_name": application.name or application.client_id,
            "redirect_host": services.redirect_host(redirect_uri),
            "target_org": project.organization,
            "target_project": project,
            "scopes": [{"name": s, "description": SCOPES[s]} for s in granted],
            "dropped": [s for s in asked if s not in granted],
            "action": request.get_full_path(),
            "minutes": int(settings.KESTREL_OAUTH_ACCESS_TOKEN_TTL.total_seconds() // 60),
        }
        response = render(request, "oauth/authorize.html", context)
        response["Cache-Control"] = "no-store"
        # The form posts here, and the answer redirects to the client. Browsers hold the
        # redirect to the page's form-action too, so this page allows the client's own origin
        # (only that, for this response) or Allow would be blocked in the browser.
        client_origin = services.redirect_origin(redirect_uri)
        if client_origin is not None:
            response._csp_update = {"form-action": [client_origin]}  # type: ignore[attr-defined]
        return response


def _error_page(request, title: str, message: str, status: int = 400) -> HttpResponse:
    response = render(
        request,
        "console/error.html",
        {"title": title, "message": message, "status": status},
        status=status,
    )
    response["Cache-Control"] = "no-store"
    return response


def _redirect_error(request, error: OAuthToolkitError) -> HttpResponse:
    oauthlib_error = error.oauthlib_error
    if not oauthlib_error.redirect_uri:
        return HttpResponse(oauthlib_error.json, status=400, content_type="application/json")
    params = [*oauthlib_error.twotuples, ("iss", public_origin(request))]
    location = add_params_to_uri(oauthlib_error.redirect_uri, params)
    return OAuth2ResponseRedirect(location, REDIRECT_SCHEMES)


def _redirect_to_client(
    request, redirect_uri: str, *, error: str, description: str, state
) -> HttpResponse:
    params = [("error", error), ("error_description", description)]
    if state:
        params.append(("state", state))
    params.append(("iss", public_origin(request)))
    return OAuth2ResponseRedirect(add_params_to_uri(redirect_uri, params), REDIRECT_SCHEMES)
