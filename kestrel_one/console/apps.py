from django.apps import AppConfig


class ConsoleConfig(AppConfig):
    name = "kestrel_one.console"
    label = "console"
    verbose_name = "Console"

    def ready(self) -> None:
        from kestrel_one.console import sudo  # noqa: F401  (connects the sign-in signal)
