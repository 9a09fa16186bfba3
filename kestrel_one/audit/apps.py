from django.apps import AppConfig


class AuditConfig(AppConfig):
    name = "kestrel_one.audit"
    label = "audit"
