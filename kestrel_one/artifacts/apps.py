from django.apps import AppConfig


class ArtifactsConfig(AppConfig):
    name = "kestrel_one.artifacts"
    label = "artifacts"
