from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "kestrel_one.webhooks"
    label = "webhooks"

    def ready(self) -> None:
        # Registers the delivery task in every process, so services find it by name
        # (webhooks.services.deliveries_enqueue) without importing the module that calls them.
        from kestrel_one.webhooks import tasks  # noqa: F401
