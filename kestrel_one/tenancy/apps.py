from django.apps import AppConfig


class TenancyConfig(AppConfig):
    name = "kestrel_one.tenancy"
    label = "tenancy"
