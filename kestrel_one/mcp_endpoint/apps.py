from django.apps import AppConfig


class McpEndpointConfig(AppConfig):
    name = "kestrel_one.mcp_endpoint"
    label = "mcp_endpoint"
    verbose_name = "MCP endpoint"
    default_auto_field = "django.db.models.BigAutoField"
