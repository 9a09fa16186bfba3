from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "kestrel_one.api"
    label = "api"
