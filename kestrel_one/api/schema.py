"""OpenAPI descriptions of Kestrel One's own authentication classes."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class KestrelTokenScheme(OpenApiAuthenticationExtension):
    target_class = "kestrel_one.api.authentication.KestrelTokenAuthentication"
    name = ["bearer", "kestrelToken"]

    def get_security_definition(self, auto_schema):
        return [
            {"type": "http", "scheme": "bearer", "description": "An API token (kst_...)."},
            {"type": "apiKey", "in": "header", "name": "X-Kestrel-Token"},
        ]


class ConsoleSessionScheme(OpenApiAuthenticationExtension):
    target_class = "kestrel_one.api.views.ConsoleSessionAuthentication"
    name = "consoleSession"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "cookie",
            "name": "sessionid",
            "description": "Schema and docs only; the API never accepts the session.",
        }
