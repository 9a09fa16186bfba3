from django.apps import AppConfig


class AccountsConfig(AppConfig):
    name = "kestrel_one.accounts"
    label = "accounts"

    def ready(self) -> None:
        # Connects the sign-in stamp the session store holds the lifetime to.
        from kestrel_one.accounts import sessions  # noqa: F401
