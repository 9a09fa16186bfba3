from django.apps import AppConfig


class AdaptersConfig(AppConfig):
    name = "kestrel_one.adapters"
    label = "adapters"
