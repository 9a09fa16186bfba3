from django.apps import AppConfig


class CredentialsConfig(AppConfig):
    name = "kestrel_one.credentials"
    label = "credentials"
