from django.apps import AppConfig


class ApiConfig(AppConfig):
    name = "kestrel_one.api"
    label = "api"

    def ready(self) -> None:
        from kestrel_one.api import schema  # noqa: F401 - registers OpenAPI extensions
