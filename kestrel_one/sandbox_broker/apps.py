from django.apps import AppConfig


class SandboxBrokerConfig(AppConfig):
    """The control plane's side of the broker beside the sandbox (CRED-3)."""

    name = "kestrel_one.sandbox_broker"
    label = "sandbox_broker"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        # The answer to a waiting workload is sent when its child action ends.
        from kestrel_one.sandbox_broker import answers  # noqa: F401
