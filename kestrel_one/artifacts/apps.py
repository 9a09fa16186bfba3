from django.apps import AppConfig


class ArtifactsConfig(AppConfig):
    name = "kestrel_one.artifacts"
    label = "artifacts"

    def ready(self) -> None:
        from kestrel_one.artifacts import signals  # noqa: F401 - connects the receivers
