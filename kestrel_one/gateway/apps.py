from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "kestrel_one.gateway"
    label = "gateway"

    def ready(self) -> None:
        # The model.invoke checks live with the gateway; judging (a lower layer) calls them
        # through its hook, and refuses the tool when they are not registered.
        from kestrel_one.gateway.invoke import model_call_admit, model_call_request
        from kestrel_one.governance.judging import ToolChecks, tool_checks_register

        tool_checks_register(
            "model.invoke",
            ToolChecks(request=model_call_request, admit=model_call_admit),
        )
