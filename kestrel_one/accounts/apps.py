from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "kestrel_one.accounts"
    label = "accounts"
