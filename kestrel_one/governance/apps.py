from django.apps import AppConfig


class GovernanceConfig(AppConfig):
    name = "kestrel_one.governance"
    label = "governance"
