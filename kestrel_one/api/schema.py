"""OpenAPI descriptions of what drf-spectacular cannot infer: our authentication classes and
strict request bodies."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension, OpenApiSerializerExtension


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


class StrictSerializerScheme(OpenApiSerializerExtension):
    """A strict serializer refuses unknown fields, so its request schema says so."""

    target_class = "kestrel_one.api.serializers.StrictSerializer"
    match_subclasses = True

    def map_serializer(self, auto_schema, direction):
        schema = auto_schema._map_serializer(self.target, direction, bypass_extensions=True)
        if direction == "request":
            schema["additionalProperties"] = False
        return schema
