from django.apps import AppConfig


class McpConfig(AppConfig):
    name = "kestrel_one.mcp"
    label = "mcp"
    verbose_name = "MCP servers"
