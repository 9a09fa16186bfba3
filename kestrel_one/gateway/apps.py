from django.apps import AppConfig


class GatewayConfig(AppConfig):
    name = "kestrel_one.gateway"
    label = "gateway"
