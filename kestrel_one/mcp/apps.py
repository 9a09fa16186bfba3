from django.apps import AppConfig


class McpConfig(AppConfig):
    name = "kestrel_one.mcp"
    label = "mcp"
    verbose_name = "MCP servers"

    def ready(self) -> None:
        # The mcp.call checks live here; judging and execution (lower layers) call them
        # through their hooks, and judging refuses mcp.call when they are not registered.
        from kestrel_one.execution.services import call_finished_hook_register
        from kestrel_one.governance.judging import ToolChecks, tool_checks_register
        from kestrel_one.mcp.calls import mcp_call_admit, mcp_call_dispatch, mcp_call_finished

        tool_checks_register(
            "mcp.call",
            ToolChecks(admit=mcp_call_admit, dispatch=mcp_call_dispatch),
        )
        call_finished_hook_register("mcp.call", mcp_call_finished)
