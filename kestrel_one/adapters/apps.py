from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "kestrel_one.adapters"
    label = "adapters"

    def ready(self) -> None:
        # The adapter.invoke checks live with the adapters; judging (a lower layer) calls
        # them through its hook, and refuses the tool when they are not registered.
        from kestrel_one.adapters.checks import adapter_call_admit, adapter_call_request
        from kestrel_one.governance.judging import ToolChecks, tool_checks_register

        tool_checks_register(
            "adapter.invoke",
            ToolChecks(request=adapter_call_request, admit=adapter_call_admit),
        )
