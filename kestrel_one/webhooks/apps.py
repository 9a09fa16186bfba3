from django.apps import AppConfig


class WebhooksConfig(AppConfig):
    name = "kestrel_one.webhooks"
    label = "webhooks"
