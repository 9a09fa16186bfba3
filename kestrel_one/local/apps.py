from django.apps import AppConfig


class LocalConfig(AppConfig):
    name = "kestrel_one.local"
    label = "local"
