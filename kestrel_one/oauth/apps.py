from django.apps import AppConfig


class OAuthConfig(AppConfig):
    name = "kestrel_one.oauth"
    label = "kestrel_oauth"
    verbose_name = "OAuth for MCP clients"
    default_auto_field = "django.db.models.BigAutoField"
